"""`python -m plait`: the `plait` command."""

import sys

from plait.cli.main import script

sys.exit(script())
