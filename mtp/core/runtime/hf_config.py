"""A model directory's `config.json`, checked before anything is allocated: every field mtp uses is
present, typed and in range, and every size field agrees with the tensor shapes the weight files'
headers declare (`check_sizes`). Errors are one `ModelLoadError` line naming the file and field."""

from __future__ import annotations

import math
from pathlib import Path

from mtp.core.runtime.artifacts import read_json
from mtp.core.runtime.model import ModelConfig, UnsupportedModelError


class ModelLoadError(ValueError):
    """A model that cannot load, in one line naming the file (and field) at fault."""


def first_line(e: BaseException) -> str:
    """`Type: first line of the message` of an exception, for one-line errors naming a library's failure."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_OPTIONAL_INT_FIELDS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
_OPTIONAL_FLOAT_FIELDS = ("rope_theta", "rms_norm_eps")
_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias")
_ROPE_NUMBERS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
MAX_POSITIONS = 1 << 20  # max_position_embeddings at most: the RoPE table is built that long


def read_hf_config(cfg_path: Path) -> dict:
    """A model's config.json, every field we use present and sane (`check_hf_config`); errors name
    the file and field."""
    if not cfg_path.exists():
        raise ModelLoadError(f"no config.json in {cfg_path.parent}")
    return check_hf_config(read_json(cfg_path, "model config"), cfg_path)


def check_hf_config(hf: dict, where) -> dict:
    """`hf` (a config.json dict) if every field we use has the right type and range: sizes positive
    integers, head_dim even, the context at most MAX_POSITIONS, flags booleans, token ids inside the
    vocabulary, rope settings numbers. Errors are one line naming `where` and the field. Sizes are
    checked against the weights separately (`check_sizes`)."""
    try:
        ModelConfig.arch_of(hf)
    except UnsupportedModelError as e:
        raise ModelLoadError(str(e)) from None
    _check_types(hf, where)
    if (hf.get("max_position_embeddings") or 0) > MAX_POSITIONS:
        _fail(hf, where, "max_position_embeddings", f"at most {MAX_POSITIONS}")
    if hf.get("head_dim") and hf["head_dim"] % 2:
        _fail(hf, where, "head_dim", "even (rotary embeddings rotate pairs)")
    vocab = hf["vocab_size"]
    eos = hf.get("eos_token_id")
    for name, ids in (
        ("eos_token_id", eos if isinstance(eos, list) else [eos]),
        ("mtp_mask_token_id", [hf.get("mtp_mask_token_id")]),
    ):
        if ids != [None] and not all(type(i) is int and 0 <= i < vocab for i in ids):
            _fail(hf, where, name, f"a token id (or, for eos, a list of them) below vocab_size {vocab}")
    for name in ("rope_scaling", "rope_parameters"):
        if hf.get(name) is not None:
            _check_rope(hf, where, name)
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if heads % kv:
        raise ModelLoadError(f"{where}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv})")
    if not hf.get("head_dim") and (hf["hidden_size"] % heads or hf["hidden_size"] // heads % 2):
        raise ModelLoadError(
            f"{where}: hidden_size ({hf['hidden_size']}) does not split into {heads} attention heads of an even size"
        )
    return hf


def _fail(hf: dict, where, name: str, what: str):
    raise ModelLoadError(f"{where}: field {name!r} must be {what}, got {hf.get(name)!r}")


def _positive_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _check_types(hf: dict, where) -> None:
    """The required size fields present; every size field a positive integer, every float field a positive
    number and every flag a boolean when given."""
    for name in _INT_FIELDS:
        if name not in hf:
            raise ModelLoadError(f"{where}: missing field {name!r}")
    for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
        v = hf.get(name)
        if (v is not None or name in _INT_FIELDS) and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            _fail(hf, where, name, "a positive integer")
    for name in _OPTIONAL_FLOAT_FIELDS:
        if hf.get(name) is not None and not _positive_number(hf[name]):
            _fail(hf, where, name, "a positive number")
    for name in _BOOL_FIELDS:
        if hf.get(name) is not None and not isinstance(hf[name], bool):
            _fail(hf, where, name, "true or false")


def _check_rope(hf: dict, where, name: str) -> None:
    """Field `name` (rope_scaling or rope_parameters): an object whose numbers for its rope type (and its
    rope_theta, when given) are positive; llama3's two frequency factors differ."""
    rope = hf[name]
    if not isinstance(rope, dict):
        _fail(hf, where, name, "an object")
    kind = rope.get("rope_type", rope.get("type"))
    for key in _ROPE_NUMBERS.get(kind, ()) + (("rope_theta",) if "rope_theta" in rope else ()):
        if not _positive_number(rope.get(key)):
            raise ModelLoadError(f"{where}: field {name!r}: {key!r} must be a positive number, got {rope.get(key)!r}")
    if kind == "llama3" and rope["low_freq_factor"] == rope["high_freq_factor"]:
        raise ModelLoadError(f"{where}: field {name!r}: low_freq_factor and high_freq_factor must differ")


def check_sizes(hf: dict, shapes: dict[str, tuple[int, ...]], where) -> None:
    """Every size field of a checked config (`check_hf_config`) against the weights actually present
    (`shapes`: our parameter name -> shape, read from file headers), before anything is allocated:
    no field can make the model larger than its weights. Errors name the field and the tensor."""
    n = hf["num_hidden_layers"]
    present = {k.split(".")[1] for k in shapes if k.startswith("layers.")}
    if len(present) != n or present != {str(i) for i in range(n)}:  # the length first: n may be huge
        raise ModelLoadError(f"{where}: field 'num_hidden_layers' is {n} but the weights hold {len(present)} layers")
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    for field_name, value, tensor, dim in (
        ("'vocab_size'", hf["vocab_size"], "embed_tokens.weight", 0),
        ("'hidden_size'", hf["hidden_size"], "embed_tokens.weight", 1),
        (
            f"'num_attention_heads' x 'head_dim' ({heads} x {head_dim})",
            heads * head_dim,
            "layers.0.self_attn.q_proj.weight",
            0,
        ),
        (
            f"'num_key_value_heads' x 'head_dim' ({kv} x {head_dim})",
            kv * head_dim,
            "layers.0.self_attn.k_proj.weight",
            0,
        ),
        ("'intermediate_size'", hf["intermediate_size"], "layers.0.mlp.gate_proj.weight", 0),
    ):
        shape = shapes.get(tensor)
        if shape is None:
            raise ModelLoadError(f"{where}: the weights have no {tensor}")
        if len(shape) <= dim or shape[dim] != value:
            raise ModelLoadError(
                f"{where}: field {field_name} is {value} but the weights' {tensor} has shape {list(shape)}"
            )
