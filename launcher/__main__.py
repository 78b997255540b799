"""`python -m splitrun.launcher ...` is the `splitrun` command."""

import sys

from .cli import main

sys.exit(main())
