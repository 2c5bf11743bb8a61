"""`torchrun ... -m mtp.pipeline PROMPT ...`: one pipeline stage per process (the entry point only)."""
import sys

from mtp.cli.pipeline import main

sys.exit(main())
