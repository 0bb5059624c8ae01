"""The research experiments (examples/research/) import as their scripts do: from their own folder."""

import sys
from pathlib import Path

RESEARCH = Path(__file__).resolve().parents[2] / "examples" / "research"
if str(RESEARCH) not in sys.path:
    sys.path.insert(0, str(RESEARCH))
