"""GGUF files (llama.cpp's format), read once and without trusting them: one walk of the header
(`read_tensors`) bounds every count and checks that each tensor's data lies inside the file before
anything is hashed or allocated, and gives the metadata and every tensor as stored (its GGML type and
a read-only view of its bytes in the file's memory map). From that one walk `read_gguf` dequantises
to float32 under mtp's parameter names, with a Hugging Face config built from the metadata and checked
like any config.json (`mtp.core.runtime.hf_config`), and `mtp.core.runtime.kernels.qlinear.gguf_weights` keeps the
blocks as stored for the kernels. llama.cpp's rotary row order (`unpermuted_heads`) and the tied
output head (`tied_head`) are decided here, once, for both."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from mtp.core.runtime.hf_config import ModelLoadError, check_hf_config, check_sizes, first_line


def unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp stores Q/K rows interleaved per rotary pair; put them back in HF's half-split order."""
    rows = w.shape[0]
    return w.view(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
GGUF_MAX_FIELDS, GGUF_MAX_TENSORS, GGUF_MAX_ITEMS = 1 << 16, 1 << 20, 1 << 23
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file as stored. `shape` in GGUF order (fastest dimension first); `data` a
    read-only view of its bytes in the file's memory map, typed as `gguf.GGUFReader` types it: F32 /
    F16 / F64 and the integer types as their numbers, [rows, columns]; a block format as uint8
    [rows, bytes per row] (what `gguf.quants.dequantize` takes)."""

    name: str
    tensor_type: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]
    data: np.ndarray


def gguf_header(path: Path) -> tuple[dict, dict[str, list[int]]]:
    """(metadata, tensors) of a GGUF file, read from its header alone: metadata values for scalars
    and strings, the length for arrays; tensor name -> shape (GGUF order, fastest dimension first).

    Milliseconds whatever the file's size (nothing is hashed or dequantised). Raises one
    ModelLoadError naming the file unless the header is complete, its counts plausible, and every
    tensor's data lies inside the file."""
    meta, infos = _read_header(path)
    return meta, {name: dims for name, dims, _, _ in infos}


def _read_header(path: Path) -> tuple[dict, list[tuple[str, list[int], int, int]]]:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _walk_gguf(buf)
    except (ValueError, struct.error, UnicodeDecodeError, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({first_line(e)})") from None


_TYPED = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16}
_TYPED.update(I32=np.int32, I64=np.int64)


def read_tensors(path: Path) -> tuple[dict, list[GGUFTensor]]:
    """(metadata, every tensor as stored) of a GGUF file, from one walk of its header (`gguf_header`'s
    checks, the same one-line ModelLoadError). The tensors' bytes stay in the file's memory map (read
    only, as long as a tensor is referenced): nothing is copied or dequantised here."""
    meta, infos = _read_header(path)
    if not infos:
        return meta, []
    try:
        file = np.memmap(path, dtype=np.uint8, mode="r")
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({first_line(e)})") from None
    out = []
    for name, dims, kind, start in infos:
        qtype = gguf.GGMLQuantizationType(kind)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows = math.prod(dims[1:])
        raw = file[start : start + rows * (dims[0] // block) * size].reshape(rows, -1)
        typed = _TYPED.get(qtype.name)
        data = raw.view(typed) if typed is not None else raw
        out.append(GGUFTensor(name, kind, tuple(dims), data.reshape(*reversed(dims[1:]), -1)))
    return meta, out


def unpermuted_heads(arch: str, ours: str, n_heads: int, n_kv: int) -> int | None:
    """How many heads llama.cpp interleaved the rows of tensor `ours` by (its rotary pairs; `unpermute`
    undoes it), or None when its rows are in Hugging Face's order: Q/K projections of llama and mistral
    files only."""
    if arch in ("llama", "mistral") and (".self_attn.q_proj." in ours or ".self_attn.k_proj." in ours):
        return n_heads if ".q_proj." in ours else n_kv
    return None


def tied_head(tensor_names) -> bool:
    """Whether the output head is the token embedding (a file without `output.weight`)."""
    return "output.weight" not in set(tensor_names)


def _walk_gguf(buf) -> tuple[dict, list[tuple[str, list[int], int, int]]]:
    """(metadata, [(name, dims, GGML type, absolute offset of its data)]) of a GGUF in `buf`, checked."""
    if buf[:4] != b"GGUF":
        raise ValueError("no GGUF magic at its start")
    order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"  # a big-endian file reads 0 here
    r = _HeaderReader(buf, order)
    version, n_tensors, n_fields = r.take("I"), r.take("Q"), r.take("Q")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (supported: 2, 3)")
    if n_tensors > GGUF_MAX_TENSORS or n_fields > GGUF_MAX_FIELDS:
        raise ValueError(f"implausible header: {n_tensors} tensors, {n_fields} metadata fields")
    meta = {}
    for _ in range(n_fields):
        key = r.string()
        meta[key] = r.value(r.take("I"))
    infos = []
    for _ in range(n_tensors):
        name, n_dims = r.string(), r.take("I")
        if not 1 <= n_dims <= 4:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = [r.take("Q") for _ in range(n_dims)]
        infos.append((name, dims, r.take("I"), r.take("Q")))
    align = meta.get("general.alignment", 32)
    if type(align) is not int or align < 1 or align & (align - 1):
        raise ValueError(f"general.alignment {align!r} is not a power of two")
    start = -(-r.pos // align) * align
    _check_extents(infos, start, len(buf))
    return meta, [(name, dims, kind, start + offset) for name, dims, kind, offset in infos]


class _HeaderReader:
    """A GGUF header read front to back from `buf` in byte `order`: each read moves `pos` past the value;
    a string or array that would run past the end is refused, and the array items walked one by one (those
    of string arrays and nested arrays) count against one budget over the whole header (GGUF_MAX_ITEMS)."""

    def __init__(self, buf, order: str):
        self.buf, self.order, self.pos = buf, order, 4
        self.budget = GGUF_MAX_ITEMS

    def take(self, fmt: str):
        values = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(self.order + fmt)
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        n = self.take("Q")
        if n > len(self.buf) - self.pos:
            raise ValueError(f"a string of {n} bytes runs past the end of the file (truncated?)")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8")

    def value(self, kind: int):
        """A metadata value of GGUF type `kind`: a scalar or string as read, an array as its length."""
        if kind in _GGUF_SCALARS:
            return self.take(_GGUF_SCALARS[kind])
        if kind == _GGUF_STRING:
            return self.string()
        if kind != _GGUF_ARRAY:
            raise ValueError(f"unknown metadata type {kind}")
        item, n = self.take("I"), self.take("Q")
        if item in _GGUF_SCALARS:
            size = n * struct.calcsize(self.order + _GGUF_SCALARS[item])
            if size > len(self.buf) - self.pos:
                raise ValueError(f"an array of {n} items runs past the end of the file (truncated?)")
            self.pos += size
            return n
        self.budget -= n
        if self.budget < 0:
            raise ValueError("implausibly many array items")
        if item == _GGUF_STRING:  # e.g. a vocabulary: skip each string (the hot loop of the walk)
            length, pos = struct.Struct(self.order + "Q"), self.pos
            for _ in range(n):
                pos += 8 + length.unpack_from(self.buf, pos)[0]
            self.pos = pos
            if pos > len(self.buf):
                raise ValueError("a string array runs past the end of the file (truncated?)")
        else:
            for _ in range(n):
                self.value(item)
        return n


def _check_extents(infos: list[tuple[str, list[int], int, int]], start: int, size: int) -> None:
    """Every tensor of a known GGML type, its rows filling whole blocks, and its data (at `start` + its
    offset) inside the `size`-byte file."""
    for name, dims, kind, offset in infos:
        try:
            block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown type {kind}") from None
        if dims[0] % block:
            raise ValueError(f"tensor {name!r}: {dims[0]} columns do not fill {block}-wide blocks")
        end = start + offset + math.prod(dims) // block * nbytes
        if end > size:
            raise ValueError(f"tensor {name!r} ends at byte {end}, past the end of the {size}-byte file (truncated?)")


def read_gguf(gguf_path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Dequantised float32 weights under our names, and an HF-style config dict, both checked
    (`check_hf_config`, `check_sizes` against the tensor shapes) before any tensor is dequantised;
    errors name the file."""
    meta, stored = read_tensors(gguf_path)
    tensors = {t.name: list(t.shape) for t in stored}
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"{gguf_path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHS)}")

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

    names = {name: our_name(name) for name in tensors}
    shapes = {ours: tuple(reversed(tensors[name])) for name, ours in names.items() if ours}
    if "embed_tokens.weight" not in shapes:
        raise ModelLoadError(f"{gguf_path}: no token_embd.weight tensor")
    n_heads, dim = count("attention.head_count"), count("embedding_length")
    n_kv = count("attention.head_count_kv", n_heads)
    hf = {
        "architectures": [
            {
                "llama": "LlamaForCausalLM",
                "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM",
            }[arch]
        ],
        "model_type": arch,
        "vocab_size": shapes["embed_tokens.weight"][0],
        "hidden_size": dim,
        "num_hidden_layers": count("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "intermediate_size": count("feed_forward_length"),
        "head_dim": count("attention.key_length", dim // n_heads or 1),
        "rope_theta": number(f"{arch}.rope.freq_base", 10000.0),
        "rms_norm_eps": number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "tie_word_embeddings": tied_head(tensors),
        "attention_bias": arch == "qwen2",
        "max_position_embeddings": count("context_length", 2048),
        "eos_token_id": token("tokenizer.ggml.eos_token_id"),
        "bos_token_id": token("tokenizer.ggml.bos_token_id"),
    }
    check_hf_config(hf, gguf_path)
    check_sizes(hf, shapes, gguf_path)
    state = {}
    for t in stored:
        ours = names.get(t.name)
        if not ours:
            continue
        try:
            arr = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.tensor_type))
            w = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(shapes[ours])
        except (ValueError, NotImplementedError, RuntimeError, TypeError) as e:
            raise ModelLoadError(f"{gguf_path}: tensor {t.name}: cannot dequantise ({first_line(e)})") from None
        if heads := unpermuted_heads(arch, ours, n_heads, n_kv):
            w = unpermute(w, heads)  # llama.cpp's rotary row order
        state[ours] = w
    return state, hf


def our_name(gguf_name: str) -> str | None:
    """Our parameter name for a GGUF tensor name (None: a tensor we do not use, e.g. rope_freqs)."""
    top = {
        "token_embd.weight": "embed_tokens.weight",
        "output_norm.weight": "norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".", 3)
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_NAMES:
        return f"layers.{parts[1]}.{GGUF_NAMES[parts[2]]}.{parts[3]}"
    return None
