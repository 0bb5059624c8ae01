"""``python -m tlt.coordinator --bind tcp://127.0.0.1:5555``: run the coordinator standalone."""

import sys

from tlt.coordinator.cli import main

sys.exit(main())
