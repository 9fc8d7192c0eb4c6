"""`python -m tafl.cli`: the `tafl` command."""

import sys

from tafl.cli import main

sys.exit(main())
