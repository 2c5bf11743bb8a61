"""`torchrun ... -m mtp.pipeline PROMPT ...`: one pipeline stage per process (the entry point only)."""
import sys

from mtp.pipeline.launch import stage_main

sys.exit(stage_main())
