"""`python -m labsrc.launch ...`: the launcher's command line (labsrc.launch.cli)."""
import sys

from labsrc.launch.cli import main

sys.exit(main())
