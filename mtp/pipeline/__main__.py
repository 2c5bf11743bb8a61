"""`torchrun ... -m mtp.pipeline PROMPT ...`: one pipeline stage per process (the entry point only;
its options are `mtp pipeline`'s, defined in `mtp.cli.pipeline`)."""

import os
import sys

# before torch loads: its C++ log (a vanished peer's retries, with stack frames) stays off; failures are one line
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

from mtp.cli.pipeline import stage_main  # noqa: E402

sys.exit(stage_main())
