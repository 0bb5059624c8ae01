"""The ``sglang.srt.plugins`` entry point: TLT's hooks in every SGLang process.

Owns :func:`load`, the one function SGLang's plugin loader calls. SGLang calls :func:`load` in each process it starts (HTTP server, scheduler / TP workers), then
applies the hook registry. SGLang only logs a plugin that raises, so a failure here prints its
traceback to stderr and ends the process (``SystemExit`` passes SGLang's ``except Exception``):
a server must not come up half-hooked, serving with SGLang's own policy or without the lossless
guard while the user believes TLT is on. ``TLT_SGLANG_PLUGIN=0`` turns the plugin off.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

log = logging.getLogger(__name__)
ENV_OFF = "TLT_SGLANG_PLUGIN"


def enabled() -> bool:
    return os.environ.get(ENV_OFF, "1").strip().lower() not in ("0", "false", "no", "off")


def load() -> None:
    if not enabled():
        log.info("TLT's SGLang plugin is off (%s=0)", ENV_OFF)
        return
    from tlt.integrations.sglang import hook_table

    try:
        hook_table.install()
    except Exception as e:  # noqa: BLE001 - any failure must stop this SGLang process
        traceback.print_exc(file=sys.stderr)
        sys.stderr.write(f"error: TLT's SGLang plugin failed: {e}\n"
                         f"       (set {ENV_OFF}=0 to run SGLang without TLT)\n")
        raise SystemExit(1) from e
