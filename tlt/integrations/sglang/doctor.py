"""``tlt doctor sglang``: is TLT's SGLang plugin registered, and did every hook land here?

Owns the report: the installed SGLang version, the hook table used, each hook applied or missing,
and whether the ``sglang.srt.plugins`` entry point that makes SGLang load the plugin is installed.
Applying the hooks here is what every SGLang process does at start, so a clean report means the
server's processes will come up hooked.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

GROUP = "sglang.srt.plugins"


def entry_point() -> str | None:
    for ep in importlib.metadata.entry_points(group=GROUP):
        if ep.value.startswith("tlt."):
            return f"{ep.name} = {ep.value}"
    return None


def report() -> dict[str, Any]:
    """The doctor's record; raises ValueError when SGLang is not importable."""
    try:
        import sglang  # noqa: F401
    except ImportError as e:
        raise ValueError(f"SGLang is not importable here ({e}); install a supported version "
                         "(pip install 'tlt-rollout[sglang]' on a GPU machine)") from None
    from tlt.integrations.sglang import hook_table

    try:
        version, table_version, table, applied, missing = hook_table.apply()
        errors: list[str] = []
    except Exception as e:  # noqa: BLE001 - reported, not raised: the doctor explains
        version = hook_table.sglang_version()
        table_version, table = hook_table.table_for(version)
        errors = [f"{type(e).__name__}: {e}"]
        applied, missing = hook_table.status(table)
    return {"sglang_version": version, "table": table_version, "entry_point": entry_point(),
            "hooks_applied": applied, "hooks_missing": missing, "errors": errors,
            "hooks": [{"target": h.target, "kind": h.kind, "why": h.why, "applied": h.target in applied}
                      for h in table]}


def lines(r: dict[str, Any]) -> list[str]:
    out = [f"SGLang {r['sglang_version']} (hook table {r['table']}); entry point "
           f"{r['entry_point'] or 'NOT installed (pip install tlt in this environment)'}"]
    for h in r["hooks"]:
        out.append(f"  {'applied' if h['applied'] else 'MISSING'}  {h['kind']:7s} {h['target']}  - {h['why']}")
    out += [f"  error: {e}" for e in r["errors"]]
    out.append(f"{len(r['hooks_applied'])} applied, {len(r['hooks_missing'])} missing")
    return out
