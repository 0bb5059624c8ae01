"""What the research experiments share: their command line, the printed summary and the JSON record.

Each experiment in this folder exposes ``run(args) -> dict`` (a record with a ``summary`` list of
lines) and ends with ``main(run, __doc__)``. They are studies, not product: the CLI's ``tlt bench``
holds the benchmarks of what TLT ships.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path


def main(run: Callable[[argparse.Namespace], dict], doc: str, argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the result record here")
    p.add_argument("--quick", action="store_true", help="smaller workload (for smoke tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1, as the recorded figures ran; 0: torch's default)")
    p.add_argument("--target-steps", type=int, default=0,
                   help="train the demo's target this many steps instead (0: the demo's own target)")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings only")
    args = p.parse_args(argv)
    if args.threads < 0 or args.target_steps < 0:
        p.error(f"--threads={args.threads}, --target-steps={args.target_steps}: use >= 0")
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    record = run(args)
    print("\n".join(record["summary"]))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit("run one of this folder's experiments, e.g. python examples/research/tuner_surface.py --quick")
