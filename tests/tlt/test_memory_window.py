"""examples/memory_window.py (the memory issue's GPU check) in its CPU smoke mode: on the same
pretend card the paged engine admits every request while the static one holds fewer rows, both
decode, and the record says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_memory_window_quick_runs_both_engines(tmp_path):
    out = tmp_path / "mw.json"
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "memory_window.py"), "--quick", "--seconds", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads(out.read_text())
    paged, static = rec["runs"]["paged"], rec["runs"]["static"]
    assert rec["static_rows"] < rec["requests"] == paged["largest_batch"]
    assert static["largest_batch"] == rec["static_rows"]
    assert paged["tokens"] > 0 and static["tokens"] > 0 and paged["peak_blocks"] > 0
    assert "paged / static tokens per second" in rec["summary"][-1]
