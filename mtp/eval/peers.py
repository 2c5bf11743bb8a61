"""Peers for `mtp bench`: what a user would run instead, measured in the same run on the same prompts.

- hf:              transformers `generate`, greedy, on the converted HF directory of the same weights;
- hf-lookup:       the same with prompt-lookup decoding (`prompt_lookup_num_tokens`);
- vllm:            vLLM (CPU build, its own `.venv-vllm`: `make vllm`), greedy, fp32, on the HF directory;
- vllm-ngram:      the same with its n-gram proposer (`method: ngram`, 3 tokens);
- vllm-eagle3:DIR: the same with an EAGLE-3 drafter (`mtp export --format vllm-eagle3` output, or a
                   `mtp train-eagle3` directory, exported on the fly), 3 speculative tokens;
- llamacpp-server[:TARGET]:       llama-server (`make llamacpp`), greedy, on TARGET: a `.gguf` file or a
                   `mtp export --format llamacpp` folder (its target); default the engine's own `.gguf` model;
- llamacpp-server-ngram[:TARGET]: the same with its n-gram drafts (`ngram-simple`, 3-token lookup, 3 drafts);
- llamacpp-server-eagle3:DIR:     the same on an export folder's target with its EAGLE-3 drafter, as many
                   drafts per step as the export says (`--draft-tokens`, default 3; a `mtp train-eagle3`
                   directory is exported on the fly, f32, 3 drafts).
The llama-server peers' tokens per pass come from the server's own `draft_n_accepted` (n / (n - accepted),
counting the prompt's pass as ours do); `params()` carries its own timings (generation tokens/s, drafts).
Speed is reported two ways: end to end (the bench times `generate`, prompt included: what a client waits
for) and decode-only (`decode_timing()`: the tokens and seconds after the prompt's pass, as the peer itself
reports them; for llama-server its `timings`, whose `predicted_per_second` is exactly their ratio; None for
a peer that does not report it).
Asking for one without the build is an error (`parse_baselines`), not a skipped row.

Each peer takes the prompt's token ids (already chat-formatted by the engine) and returns the ids it
generated, without the EOS. A missing package is reported with its install hint (`missing()`), never
silently dropped; a peer that fails is recorded by the bench and the run goes on.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import torch

from mtp.core.runtime import loading
from mtp.core.runtime.artifacts import read_json
from mtp.interop import llamacpp_env, vllm_env
from mtp.interop.llamacpp_export import MANIFEST, export_llamacpp, is_llamacpp_export
from mtp.interop.llamacpp_server import LlamaServer
from mtp.interop.vllm_export import export_vllm_eagle3

HF_LOOKUP_TOKENS = 10  # transformers' documented example value
REPLACED = {"llamacpp": "llamacpp-server", "llamacpp-lookup": "llamacpp-server-ngram"}  # the llama-cpp-python peers


class Peer:
    name = "peer"
    package = ""
    hint = ""
    tokens_per_forward: float | None = None  # known exactly for plain greedy peers (1.0)

    def missing(self) -> str | None:
        """None when the peer's package imports; else the reason with the install hint."""
        try:
            found = importlib.util.find_spec(self.package) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"skipped: package {self.package!r} missing ({self.hint})"

    def setup(self, engine) -> None:
        raise NotImplementedError

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        raise NotImplementedError

    def params(self) -> dict:
        return {}

    def decode_timing(self) -> tuple[int, float] | None:
        """(tokens, seconds) of the last `generate` after the prompt's pass, as the peer reports them; None
        when it does not (then the bench has no decode-only figure for it)."""
        return None


class HFPeer(Peer):
    name = "hf"
    package = "transformers"
    hint = "pip install transformers"
    tokens_per_forward = 1.0
    lookup = 0

    def setup(self, engine) -> None:
        from transformers import AutoModelForCausalLM  # here, not at import: every `mtp` start builds this parser
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        src = engine.loaded.source
        if not os.path.isdir(src):
            raise ValueError(f"{self.name} needs a HF model directory, not {src!r}")
        self.model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval().to(engine.model.device)
        self.eos = list(engine.loaded.eos_ids)
        # as in mtp.core.decoding.decode, the <mtp_mask> token is never a prediction
        mid = engine.mask_id
        self.suppress = [mid] if mid is not None and mid < self.model.config.vocab_size else None

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt_ids], device=self.model.device)  # [1, T]
        kw = {"prompt_lookup_num_tokens": self.lookup} if self.lookup else {}
        if self.suppress:
            kw["suppress_tokens"] = self.suppress
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                eos_token_id=self.eos or None,
                pad_token_id=(self.eos or [0])[0],
                **kw,
            )
        return _cut_at_eos(out[0, len(prompt_ids) :].tolist(), self.eos)

    def params(self) -> dict:
        return {"prompt_lookup_num_tokens": self.lookup} if self.lookup else {}


class HFLookupPeer(HFPeer):
    name = "hf-lookup"
    tokens_per_forward = None
    lookup = HF_LOOKUP_TOKENS


VLLM_SPEC_TOKENS = 3  # speculative tokens of the vLLM peers (verify:4 in our terms)


class VllmPeer(Peer):
    """vLLM in its own environment, one loaded configuration in a subprocess (mtp.eval.vllm)."""

    name = "vllm"
    hint = vllm_env.HINT
    tokens_per_forward = 1.0
    arg: str | None = None  # the part after ':' in the row name (vllm-eagle3:DIR)

    def missing(self) -> str | None:
        return None if vllm_env.vllm_python() is not None else f"skipped: vLLM not installed ({self.hint})"

    def speculative_config(self) -> dict | None:
        return None

    def setup(self, engine) -> None:
        self.eos = set(engine.loaded.eos_ids)
        self.proc = vllm_env.VllmProcess(
            vllm_env.target_dir(engine.loaded.name),
            {"name": self.name, "speculative_config": self.speculative_config()},
            max_model_len=engine.context_window,
        )
        self.drafts = self.accepted = 0

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        rec = self.proc.generate(prompt_ids, max_new_tokens)
        self.drafts, self.accepted = rec["drafts"], rec["accepted"]
        if self.speculative_config() is not None and self.drafts:
            self.tokens_per_forward = 1 + self.accepted / self.drafts  # vLLM's mean acceptance length
        return _cut_at_eos(rec["ids"], self.eos)

    def params(self) -> dict:
        return {"speculative_config": self.speculative_config()} if self.speculative_config() else {}


class VllmNgramPeer(VllmPeer):
    name = "vllm-ngram"
    tokens_per_forward = None

    def speculative_config(self) -> dict | None:
        return {"method": "ngram", "num_speculative_tokens": VLLM_SPEC_TOKENS, "prompt_lookup_max": 3}


class VllmEagle3Peer(VllmPeer):
    name = "vllm-eagle3"
    tokens_per_forward = None

    def setup(self, engine) -> None:
        if not self.arg:
            raise ValueError("vllm-eagle3 needs a drafter directory: vllm-eagle3:DIR")
        self._tmp = tempfile.TemporaryDirectory()
        self.dir = f"{self._tmp.name}/eagle3"
        export_vllm_eagle3(self.arg, self.dir)  # checks it; vLLM reads the export
        super().setup(engine)

    def speculative_config(self) -> dict | None:
        return {"method": "eagle3", "model": getattr(self, "dir", self.arg), "num_speculative_tokens": VLLM_SPEC_TOKENS}


LLAMACPP_DRAFTS = 3  # --spec-draft-n-max of the llama-server peers (verify:4 in our terms)


class LlamaServerPeer(Peer):
    """llama-server from `make llamacpp`, one configuration per row, started at setup (free local port)."""

    name = "llamacpp-server"
    hint = llamacpp_env.HINT
    tokens_per_forward = 1.0
    spec: str | None = None
    arg: str | None = None
    draft_max = LLAMACPP_DRAFTS  # an export folder's `draft_tokens` overrides it
    spec_extra: tuple[str, ...] = ()  # and its `draft_p_min` adds --spec-draft-p-min

    def missing(self) -> str | None:
        gone = llamacpp_env.missing()
        return f"skipped: {gone}" if gone else None

    def files(self, engine) -> tuple[str, str | None]:
        """(target GGUF, drafter GGUF or None) this row serves."""
        if self.arg:
            path = Path(self.arg)
            if path.is_dir() and (path / MANIFEST).exists():
                man = read_json(path / MANIFEST, "llama.cpp export manifest")
                return str(path / man["target"]), None
            if path.is_file() and path.suffix == ".gguf":
                return str(path), None
            raise ValueError(
                f"{self.name}: {self.arg} is neither a .gguf file nor an `mtp export --format llamacpp` folder"
            )
        return gguf_model(engine.loaded.name, self.name), None

    def setup(self, engine) -> None:
        self.eos = set(engine.loaded.eos_ids)
        target, drafter = self.files(engine)
        self.target, self.threads = target, engine.config.threads or torch.get_num_threads()
        threads = self.threads
        self.server = LlamaServer(
            target,
            self.spec,
            drafter,
            threads=threads,
            ctx=engine.context_window,
            draft_max=self.draft_max,
            extra=self.spec_extra,
        )
        self.served = {"target": os.path.basename(target), "drafter": drafter and os.path.basename(drafter)}
        self.timings: list[dict] = []

    def decode_timing(self) -> tuple[int, float] | None:
        return llamacpp_decode_timing(self.timings[-1]) if getattr(self, "timings", None) else None

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        rec = self.server.complete(prompt_ids, max_new_tokens)
        self.timings.append(rec["timings"])
        if self.spec is not None:
            self.tokens_per_forward = llamacpp_tokens_per_pass(self.timings)
        return _cut_at_eos(rec["ids"], self.eos)

    def params(self) -> dict:
        out = {"spec_type": self.spec, **getattr(self, "served", {})}
        if self.spec is not None:
            out["spec_draft_n_max"] = self.draft_max
            if self.spec_extra:
                out["spec_draft_p_min"] = float(self.spec_extra[1])
        if getattr(self, "timings", None):
            tps = sorted(t.get("predicted_per_second") or 0.0 for t in self.timings)
            out["server_timings"] = {
                "runs": len(self.timings),
                "predicted_per_second_median": tps[len(tps) // 2],
                "predicted_n": sum(t.get("predicted_n", 0) for t in self.timings),
                "draft_n": sum(t.get("draft_n", 0) for t in self.timings),
                "draft_n_accepted": sum(t.get("draft_n_accepted", 0) for t in self.timings),
            }
        return out


def gguf_model(model: str, who: str = "llamacpp-server") -> str:
    """The .gguf file behind the engine's model name (the shipped `smollm2-135m` is its Q4_1 GGUF), which
    llama-server serves as is; a model of another kind is a ValueError naming `who`."""
    path = loading.resolve(model)
    if not (path.is_file() and path.suffix == ".gguf"):
        raise ValueError(f"{who} needs a .gguf model or an export folder ({who}:DIR), not {path.name!r}")
    return str(path)


def llamacpp_decode_timing(timings: dict) -> tuple[int, float] | None:
    """(tokens, seconds) of one llama-server request after its prompt's pass, from its `timings`: the first
    token comes from the prompt's logits, so `predicted_n - 1` tokens took `predicted_ms` (llama.cpp b11434's
    `predicted_per_second` is exactly their ratio). None without timings; (0, 0.0) for a single token."""
    n, ms = timings.get("predicted_n"), timings.get("predicted_ms")
    if n is None or ms is None:
        return None
    return (int(n) - 1, float(ms) / 1e3) if n > 1 else (0, 0.0)


def llamacpp_tokens_per_pass(timings: list[dict]) -> float | None:
    """Tokens per target pass from llama-server timings: n tokens took n - accepted passes (prompt's included)."""
    n = sum(t.get("predicted_n", 0) for t in timings)
    acc = sum(t.get("draft_n_accepted", 0) for t in timings)
    return n / (n - acc) if n > acc else None


class LlamaServerNgramPeer(LlamaServerPeer):
    name = "llamacpp-server-ngram"
    tokens_per_forward = None
    spec = "ngram"


class LlamaServerEagle3Peer(LlamaServerPeer):
    name = "llamacpp-server-eagle3"
    tokens_per_forward = None
    spec = "eagle3"

    def files(self, engine) -> tuple[str, str | None]:
        if not self.arg:
            raise ValueError("llamacpp-server-eagle3 needs an export folder: llamacpp-server-eagle3:DIR")
        path = Path(self.arg)
        if not (path / MANIFEST).exists():  # a drafter directory: exported on the fly (f32)
            self._tmp = tempfile.TemporaryDirectory()
            export_llamacpp(
                engine.loaded,
                path,
                Path(self._tmp.name) / "gguf",
                "f32",
                llamacpp_env.converter(),
                llamacpp_env.converter_python(),
                llamacpp_env.VERSION,
            )
            path = Path(self._tmp.name) / "gguf"
        elif not is_llamacpp_export(path):
            raise ValueError(f"{path} holds files an `mtp export --format llamacpp` folder does not")
        man = read_json(path / MANIFEST, "llama.cpp export manifest")
        self.draft_max = int(man.get("draft_tokens", LLAMACPP_DRAFTS))
        if man.get("draft_p_min") is not None:
            self.spec_extra = ("--spec-draft-p-min", f"{float(man['draft_p_min']):g}")
        return str(path / man["target"]), str(path / man["drafter"])


PEERS = {
    p.name: p
    for p in (
        HFPeer,
        HFLookupPeer,
        VllmPeer,
        VllmNgramPeer,
        VllmEagle3Peer,
        LlamaServerPeer,
        LlamaServerNgramPeer,
        LlamaServerEagle3Peer,
    )
}
PARAMETRISED = {"vllm-eagle3", "llamacpp-server-eagle3"}  # peers named NAME:ARG
OPTIONAL_ARG = {"llamacpp-server", "llamacpp-server-ngram"}  # peers named NAME or NAME:ARG
LLAMACPP_SERVER = {"llamacpp-server", "llamacpp-server-ngram", "llamacpp-server-eagle3"}


def parse_baselines(text: str | None) -> list[str]:
    """'hf,vllm' -> ['hf', 'vllm']; an unknown name is a ValueError listing the known ones.
    A parametrised peer is written NAME:ARG (vllm-eagle3:DIR), some take it optionally (llamacpp-server:GGUF).
    A llama-server peer without the `make llamacpp` build is a ValueError with the hint: asked for by name,
    it is not quietly skipped."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    for n in names:
        base, sep, arg = n.partition(":")
        if base in REPLACED:
            raise ValueError(
                f"baseline {base} (llama-cpp-python) is replaced by {REPLACED[base]}: the same llama.cpp "
                f"build as the other llama.cpp peers (make llamacpp)"
            )
        if base in PARAMETRISED and not (sep and arg):
            raise ValueError(f"baseline {base} needs its drafter folder: {base}:DIR (e.g. from mtp export)")
        if base not in PEERS or (base not in PARAMETRISED | OPTIONAL_ARG and sep) or (sep and not arg):
            raise ValueError(
                f"unknown baseline {n!r}; choose from "
                + ", ".join(
                    p + (":DIR" if p in PARAMETRISED else "[:GGUF]" if p in OPTIONAL_ARG else "") for p in PEERS
                )
            )
        if base in LLAMACPP_SERVER and llamacpp_env.missing():
            raise ValueError(f"baseline {base}: {llamacpp_env.missing()}")
    return list(dict.fromkeys(names))


def make_peer(name: str) -> Peer:
    base, _, arg = name.partition(":")
    peer = PEERS[base]()
    if arg:
        peer.arg = arg
        peer.name = name
    return peer


def _cut_at_eos(ids: list[int], eos) -> list[int]:
    for j, t in enumerate(ids):
        if t in eos:
            return ids[:j]
    return ids
