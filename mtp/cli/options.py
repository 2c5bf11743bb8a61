"""The options every decoding command shares and their checks: defined in `mtp.core.options`
(shared with the pipeline's own entry point, `python -m mtp.pipeline`), named here for the CLI."""
from mtp.core.options import (MAX_BATCH, THREADS_PER_CPU, add_model_args, add_sampling_args,  # noqa: F401
                              check_batch_size, check_decoding_args, check_device, check_threads,
                              engine_config, read_prompt, sampling_params, valid_text)
