"""Simulated RL steps of the adaptive drafter on this machine, and its loss curve.

Four rollout-worker processes per RL step: w0 and w1 drain early and start a 2-rank FSDP2/gloo
session, w2 drains later and joins it (the group re-forms with 3 ranks from the latest checkpoint),
w3 is the long tail whose end preempts training. The drafter trains only in those idle windows,
across RL steps, from each worker's DataBuffer (synthetic learnable data, see ``simloop``, beside it).

    python examples/adaptive_loop.py --steps 6 --png docs/adaptive_loop.png --json docs/bench/adaptive_loop.json

Needs matplotlib for the PNG (``pip install -e ".[report]"``). CPU only; about 10 s per RL step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

from simloop import SimConfig, run

log = logging.getLogger("adaptive_loop")


def durations(steps: int, seed: int) -> tuple[tuple[float, ...], ...]:
    """Per worker, per RL step rollout seconds: two early workers, one late, one long tail."""
    rng = random.Random(seed)
    rows = ([0.3] * steps, [0.8] * steps, [rng.uniform(2.5, 3.5) for _ in range(steps)],
            [rng.uniform(7.0, 9.0) for _ in range(steps)])
    return tuple(tuple(round(t, 2) for t in r) for r in rows)


def failures(per_step: list[dict]) -> list[dict]:
    """Formations that failed on some rank (worker, RL step, epoch, error)."""
    return [{"rl_step": s["step"], "epoch": r["formation"]["epoch"], "rank": r["formation"]["rank"],
             "members": r["formation"]["members"], "error": r["error"]}
            for s in per_step for r in s["records"] if r["result"] is None]


def summarize(per_step: list[dict]) -> list[dict]:
    """One row per formation (rank 0's view), in training order."""
    rows = []
    for s in per_step:
        for r in sorted((r for r in s["records"] if r["result"] and r["formation"]["rank"] == 0),
                        key=lambda r: r["formation"]["epoch"]):
            res = r["result"]
            rows.append({"rl_step": s["step"], "epoch": r["formation"]["epoch"],
                         "world_size": len(r["formation"]["members"]), "start_step": res["start_step"],
                         "end_step": res["end_step"], "losses": list(res["losses"]),
                         "stop_reason": res["stop_reason"], "preempt_latency_s": res["preempt_latency_s"]})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.2))
    colors = {1: "tab:gray", 2: "tab:blue", 3: "tab:orange", 4: "tab:green"}
    seen: set[int] = set()
    for r in rows:
        xs = list(range(r["start_step"] + 1, r["end_step"] + 1))
        w = r["world_size"]
        ax.plot(xs, r["losses"], color=colors.get(w, "k"), lw=1.2,
                label=None if w in seen else f"{w}-rank FSDP2 group")
        seen.add(w)
    for s in sorted({r["rl_step"] for r in rows}):
        first = min(r["start_step"] for r in rows if r["rl_step"] == s)
        ax.axvline(first, color="k", lw=0.5, ls=":")
        ax.text(first + 1, 0.02, f"RL {s}", fontsize=8, transform=ax.get_xaxis_transform())
    ax.set_xlabel("drafter optimizer step (resumed across sessions from selective DCP checkpoints)")
    ax.set_yscale("log")
    ax.set_ylabel("TTT loss (global, all ranks; log scale)")
    ax.set_title("Spot training of the drafter in the rollout long tail (simulated RL steps, CPU)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="RL steps to simulate (default 6)")
    p.add_argument("--seed", type=int, default=0, help="seed of the rollout durations")
    p.add_argument("--lr", type=float, default=2e-3, help="drafter learning rate (default 2e-3)")
    p.add_argument("--png", type=Path, default=Path("adaptive_loop.png"), help="loss-curve PNG to write")
    p.add_argument("--json", type=Path, default=None, help="also write the per-formation record here")
    p.add_argument("--checkpoints", type=Path, default=None,
                   help="checkpoint root (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps={args.steps}: simulate at least 1 RL step")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    base = SimConfig(durations=durations(args.steps, args.seed))
    cfg = dataclasses.replace(base, spot=dataclasses.replace(base.spot, lr=args.lr))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        per_step = run(cfg, args.checkpoints or tmp)
    rows = summarize(per_step)
    for f in failures(per_step):
        log.warning("RL step %d: formation %d %s failed on rank %d: %s", f["rl_step"], f["epoch"],
                    f["members"], f["rank"], f["error"])
    if not rows:
        log.error("no training happened")
        return 1
    for s in range(args.steps):
        rs = [r for r in rows if r["rl_step"] == s]
        losses = [x for r in rs for x in r["losses"]]
        log.info("RL step %d: groups %s, drafter steps %d -> %d, mean loss %.3f", s,
                 "+".join(str(r["world_size"]) for r in rs), rs[0]["start_step"], rs[-1]["end_step"],
                 sum(losses) / max(1, len(losses)))
    first, last = rows[0]["losses"], rows[-1]["losses"]
    log.info("loss %.3f (first step) -> %.3f (last step) over %d drafter steps in %.0fs",
             first[0], last[-1], rows[-1]["end_step"], time.monotonic() - t0)
    plot(rows, args.png)
    log.info("wrote %s", args.png)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"durations": cfg.durations, "formations": rows,
                                         "failures": failures(per_step),
                                         "outcomes": [s["outcome"] for s in per_step]}, indent=1))
        log.info("wrote %s", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
