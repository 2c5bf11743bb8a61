"""Exports of what mtp trains into the formats other serving engines load.

`vllm-eagle3`: an EAGLE-3 drafter directory that vLLM loads unmodified as
`LLM(model=BASE, speculative_config={"method": "eagle3", "model": OUT, "num_speculative_tokens": K})`:
config.json with vLLM's `LlamaForCausalLMEagle3` fields, model.safetensors under vLLM's names
(`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`; `t2d` is skipped there; the embedding is the target's).
Our own drafter directory already uses these names, so the export checks it, keeps the base-weights
hash (our engine loads the export back, `--proposer eagle3 --eagle3 OUT`) and drops the training
checkpoint.

DeepSeek-style heads (`mtp train-heads`) have no vLLM format, for three reasons found on vLLM 0.32:
every `*_mtp` method builds its MTP module from the *target's* config and accepts no Llama
(`model_type: llama`) target; the one Llama-loadable MTP layout (MiMo) needs the target's own
config.json edited (`num_nextn_predict_layers`), q/k/v biases and a qwen2 model type, so the target
would not load unmodified; and vLLM's `eagle` (EAGLE-1) drafter is a full attention layer over its
own KV cache on cat(embed, hidden) (embedding first), whereas a head depth attends to its own
position only and chains D separate modules, so no weight mapping reproduces its drafts.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mtp.core.decoding.proposers.eagle3 import CONFIG, FORMAT, WEIGHTS, Eagle3Config, Eagle3Drafter, read_drafter_config
from mtp.core.runtime.artifacts import ArtifactError, check_finite, load_safetensors, read_json, write_dir_atomic

FORMATS = ("vllm-eagle3",)
VLLM_FC_LAYERS = 3  # vLLM's EAGLE-3 Llama drafter sizes fc for three aux layers


def is_export_dir(path: Path) -> bool:
    """An export this module wrote (it may be replaced by a new one)."""
    names = {p.name for p in Path(path).iterdir()}
    if not names <= {CONFIG, WEIGHTS}:
        return False
    try:
        cfg = read_json(Path(path) / CONFIG)
    except ArtifactError:
        return False
    return cfg.get("format") == FORMAT and bool(cfg.get("exported"))


def refuse_heads(src) -> None:
    """Refuse a directory of DeepSeek-style heads given as the drafter to export (one line, citing the
    docs section that says why they have no export)."""
    if (Path(src) / "heads.safetensors").exists():
        raise ArtifactError(
            f"{src} holds DeepSeek-style heads (`mtp train-heads`): `mtp export` writes EAGLE-3 drafters only, "
            "since vLLM has no format that loads heads unmodified on a Llama target (docs/export.md, "
            "'Why the heads do not export'); train an EAGLE-3 drafter with `mtp train-eagle3`"
        )


def export_vllm_eagle3(src, out) -> dict:
    """Check drafter directory `src` and write its vLLM EAGLE-3 directory to `out`; return its config."""
    src, out = Path(src), Path(out)
    refuse_heads(src)
    cfg = read_drafter_config(src)
    try:
        ecfg = Eagle3Config.from_hf(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"{src / CONFIG}: bad EAGLE-3 config ({str(e).splitlines()[0]})") from None
    if len(ecfg.aux_layers) != VLLM_FC_LAYERS:
        raise ArtifactError(
            f"{src} fuses {len(ecfg.aux_layers)} trunk layers; vLLM's EAGLE-3 drafter reads exactly {VLLM_FC_LAYERS}"
        )
    top = ecfg.target_layers or max(ecfg.aux_layers) + 1
    if (
        any(a >= b for a, b in zip(ecfg.aux_layers, ecfg.aux_layers[1:]))
        or min(ecfg.aux_layers) < 0
        or max(ecfg.aux_layers) >= top
    ):
        raise ArtifactError(
            f"{src} fuses trunk layers {ecfg.aux_layers}; vLLM collects distinct layers below the "
            "last in ascending order (e.g. 2,15,27 of 30)"
        )
    state = load_safetensors(src / WEIGHTS)
    check_finite(state, src / WEIGHTS, "export")
    want = Eagle3Drafter(ecfg).state_dict()
    for name, t in want.items():
        if (
            name not in state
            or tuple(state[name].shape) != tuple(t.shape)
            or state[name].dtype.is_floating_point != t.dtype.is_floating_point
        ):
            raise ArtifactError(
                f"{src / WEIGHTS}: tensor {name} missing or of the wrong shape (expected {tuple(t.shape)})"
            )
    extra = sorted(set(state) - set(want))
    if extra:
        raise ArtifactError(f"{src / WEIGHTS}: unexpected tensors {extra[:3]}")
    ids = torch.arange(ecfg.draft_vocab) + state["d2t"]
    if int(ids.min()) < 0 or int(ids.max()) >= ecfg.vocab_size:
        raise ArtifactError(f"{src / WEIGHTS}: d2t maps outside the vocabulary of {ecfg.vocab_size}")
    tensors = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
    out_cfg = {
        **ecfg.to_hf(),
        "format": FORMAT,
        "version": cfg.get("version", 1),
        "base_hash": cfg["base_hash"],
        "exported": "vllm-eagle3",
        "n_params": cfg.get("n_params"),
        "metrics": (cfg.get("meta") or {}).get("metrics", {}),
    }
    write_dir_atomic(out, {WEIGHTS: tensors, CONFIG: out_cfg}, kind=is_export_dir)
    return out_cfg
