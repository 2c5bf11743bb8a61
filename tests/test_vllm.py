"""The exported EAGLE-3 drafter inside vLLM (run from `.venv-vllm` in a subprocess; `make vllm`).

Skipped where vLLM is absent, so `make test` passes without it. Each test loads SmolLM2 in vLLM twice
(plain and with the drafter: ~1-4 min on 2 cores). The trained-drafter test uses the drafter shipped
for SmolLM2, or MTP_EAGLE3_DRAFTER (a `mtp train-eagle3` directory)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import require_smollm2

from mtp.core.decoding.proposers.eagle3 import Eagle3Config, drafter_files
from mtp.core.engine import SHIPPED
from mtp.core.runtime.artifacts import write_dir_atomic
from mtp.interop.vllm_env import run_vllm, strip_eos, target_dir, vllm_python
from mtp.interop.vllm_export import export_vllm_eagle3
from mtp.training.eagle3_train import init_drafter

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed here (make vllm)"),
]

PROMPTS = ["What is 12 times 7?", "Name three colours.", "Tom has 5 apples and eats 2. How many are left?"]
K = 3  # speculative tokens


def check_in_vllm(engine, drafter_dir, tmp_path):
    out = tmp_path / "vllm-eagle3"
    export_vllm_eagle3(drafter_dir, out)
    ids = [engine.encode(p) for p in PROMPTS]
    plain, spec = run_vllm(
        target_dir(),
        ids,
        32,
        [
            {"name": "vllm"},
            {
                "name": "vllm-eagle3",
                "speculative_config": {"method": "eagle3", "model": str(out), "num_speculative_tokens": K},
            },
        ],
    )
    eos = set(engine.loaded.eos_ids)
    assert [strip_eos(o, eos) for o in spec["outputs"]] == [strip_eos(o, eos) for o in plain["outputs"]]
    assert spec["drafts"] > 0  # the drafter ran
    return spec


def test_exported_untrained_drafter_loads_and_keeps_vllm_output(smollm2, tmp_path):
    require_smollm2()
    model = smollm2.model
    vocab = torch.arange(2048)
    d = init_drafter(model, Eagle3Config.for_model(model.config, len(vocab)), vocab, seed=0)
    write_dir_atomic(tmp_path / "d", drafter_files(d, model))
    check_in_vllm(smollm2, tmp_path / "d", tmp_path)


def test_trained_drafter_is_accepted_in_vllm(smollm2, tmp_path):
    # the drafter shipped for SmolLM2 (or MTP_EAGLE3_DRAFTER): same output as plain vLLM, drafts accepted
    drafter = Path(os.environ.get("MTP_EAGLE3_DRAFTER") or SHIPPED["smollm2-135m"] / "eagle3")
    spec = check_in_vllm(smollm2, drafter, tmp_path)
    assert spec["accepted"] > 0, spec
