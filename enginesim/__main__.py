"""`python -m enginesim` is the `enginesim` command."""

import sys

from enginesim.cli import main

sys.exit(main())
