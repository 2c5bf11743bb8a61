"""`python -m mtp.cli ...` (as torchrun needs it): the `mtp` command."""

import sys

from mtp.cli import main

sys.exit(main())
