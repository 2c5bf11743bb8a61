"""The one error wrapper of every command: user errors become one line and exit status 2 (defined in
`mtp.core.options`, shared with the pipeline's own entry point, `python -m mtp.pipeline`)."""
from mtp.core.options import USER_ERRORS, UserError, report  # noqa: F401
