"""`torchrun ... -m mtp.pipeline PROMPT ...`: one pipeline stage per process (the entry point only;
its options are `mtp pipeline`'s, defined in `mtp.cli.pipeline`)."""

import sys

from mtp.cli.pipeline import stage_main

sys.exit(stage_main())
