"""`python -m jaxserve ...`: the command line, as the installed `jaxserve` command runs it."""

import sys

from jaxserve.entrypoints.cli import main

sys.exit(main())
