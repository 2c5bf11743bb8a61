"""`torchrun ... -m mtp.pipeline PROMPT ...`: one pipeline stage per process."""
import sys

from mtp.pipeline.stages import main

sys.exit(main())
