import sys

from tlt.cli import main

sys.exit(main())
