"""`python -m sam3`: the `sam3` command."""

import sys

from sam3.cli import main

sys.exit(main())
