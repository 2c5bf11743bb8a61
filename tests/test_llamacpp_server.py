"""The llama.cpp export inside llama.cpp (the `make llamacpp` build in .llamacpp/; skipped without it).

Round trip: `mtp export --format llamacpp` of the shipped drafter, its GGUF metadata read back with the
`gguf` package (the drafter's trunk layers, its d2t as absolute token ids, the vocabulary, the tokenizer's
pre-type), and a drafter fusing non-default layers keeps them. Then `llama-server` with the exported
drafter: the same greedy tokens as plain `llama-server` on the same target, and drafts accepted.
The export converts the 135M target once per outtype (~20 s); each server start takes a few seconds."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader
from helpers import require_smollm2

from mtp.cli import main
from mtp.core.decoding.proposers.eagle3 import Eagle3Config, drafter_files
from mtp.core.engine import SHIPPED
from mtp.core.runtime.artifacts import load_safetensors, write_dir_atomic
from mtp.interop import llamacpp_env
from mtp.interop.llamacpp_server import LlamaServer
from mtp.training.eagle3_train import init_drafter

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.slow,
    pytest.mark.skipif(
        llamacpp_env.missing() is not None or llamacpp_env.converter_python() is None,
        reason="llama.cpp is not built here (make llamacpp)",
    ),
]

SHIPPED_DRAFTER = SHIPPED["smollm2-135m"] / "eagle3"
PROMPTS = ["What is 12 times 7?", "Name three colours.", "Tom has 5 apples and eats 2. How many are left?"]


def field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


@pytest.fixture(scope="module")
def export_f32(tmp_path_factory):
    require_smollm2()
    out = tmp_path_factory.mktemp("llamacpp") / "f32"
    assert main(["export", "--format", "llamacpp", "--drafter", "shipped", "--out", str(out)]) == 0
    return out


def test_round_trip_metadata(export_f32):
    target = GGUFReader(export_f32 / "target-f32.gguf")
    assert field(target, "general.architecture") == "llama"
    assert field(target, "tokenizer.ggml.pre") == "smollm"
    assert len(target.fields["tokenizer.ggml.tokens"].data) == 49152
    assert "<|im_start|>" in field(target, "tokenizer.chat_template")  # /v1/chat/completions formats as mtp
    drafter = GGUFReader(export_f32 / "drafter-f32.gguf")
    assert field(drafter, "general.architecture") == "eagle3"
    assert list(field(drafter, "eagle3.target_layers")) == [2, 15, 27]
    assert field(drafter, "eagle3.target_hidden_size") == 576
    tensors = {t.name: t for t in drafter.tensors}
    state = load_safetensors(SHIPPED_DRAFTER / "model.safetensors")
    absolute = (torch.arange(len(state["d2t"])) + state["d2t"]).tolist()
    assert [int(v) for v in tensors["d2t"].data.reshape(-1)] == absolute  # draft row i -> token id
    assert len(drafter.fields["tokenizer.ggml.tokens"].data) == 49152  # the target's vocabulary
    readme = (export_f32 / "README.md").read_text()
    assert "llama-server -m target-f32.gguf -md drafter-f32.gguf --spec-type draft-eagle3" in readme


def test_non_default_trunk_layers_survive(smollm2, tmp_path):
    # [3, 10, 20] is not llama.cpp's default [2, 15, 27]: read from the top-level key, not guessed
    model = smollm2.model
    vocab = torch.arange(512)
    d = init_drafter(model, Eagle3Config.for_model(model.config, len(vocab), (3, 10, 20)), vocab, seed=0)
    write_dir_atomic(tmp_path / "d", drafter_files(d, model))
    out = tmp_path / "f16"
    assert (
        main(
            ["export", "--format", "llamacpp", "--drafter", str(tmp_path / "d"), "--outtype", "f16", "--out", str(out)]
        )
        == 0
    )
    assert list(field(GGUFReader(out / "drafter-f16.gguf"), "eagle3.target_layers")) == [3, 10, 20]


def test_llama_server_with_the_exported_drafter_keeps_greedy_output(smollm2, export_f32):
    ids = [smollm2.encode(p) for p in PROMPTS]
    target, drafter = export_f32 / "target-f32.gguf", export_f32 / "drafter-f32.gguf"
    with LlamaServer(target, threads=1) as plain:
        want = [plain.complete(p, 48) for p in ids]
    with LlamaServer(target, spec="eagle3", drafter=drafter, threads=1) as spec:
        got = [spec.complete(p, 48) for p in ids]
    assert [g["ids"] for g in got] == [w["ids"] for w in want]
    assert all(len(w["ids"]) > 0 for w in want)
    assert sum(g["timings"].get("draft_n", 0) for g in got) > 0
    assert sum(g["timings"].get("draft_n_accepted", 0) for g in got) > 0


def test_llama_bench_gives_t_of_q(export_f32):
    from mtp.interop import llamacpp_profile

    t = llamacpp_profile.measure(export_f32 / "target-f32.gguf", qs=(1, 4), depth=16, repeats=1)
    assert set(t) == {1, 4} and all(0 < v < 10 for v in t.values())
