"""`python -m veil ...`: the `veil` command line, as a fleet starts its processes."""

import sys

from veil.cli import main

sys.exit(main())
