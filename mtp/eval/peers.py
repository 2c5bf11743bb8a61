"""Peers for `mtp bench`: what a user would run instead, measured in the same run on the same prompts.

- hf:              transformers `generate`, greedy, on the converted HF directory of the same weights;
- hf-lookup:       the same with prompt-lookup decoding (`prompt_lookup_num_tokens`);
- llamacpp:        llama-cpp-python on the same GGUF file, greedy;
- llamacpp-lookup: the same with its prompt-lookup draft (`LlamaPromptLookupDecoding`);
- vllm:            vLLM (CPU build, its own `.venv-vllm`: `make vllm`), greedy, fp32, on the HF directory;
- vllm-ngram:      the same with its n-gram proposer (`method: ngram`, 3 tokens);
- vllm-eagle3:DIR: the same with an EAGLE-3 drafter (`mtp export --format vllm-eagle3` output, or a
                   `mtp train-eagle3` directory, exported on the fly), 3 speculative tokens.

Each peer takes the prompt's token ids (already chat-formatted by the engine) and returns the ids it
generated, without the EOS. A missing package is reported with its install hint (`missing()`), never
silently dropped; a peer that fails is recorded by the bench and the run goes on.
"""
from __future__ import annotations

import importlib.util
import os
import tempfile

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from mtp.core import loading
from mtp.core.export import export_vllm_eagle3
from mtp.eval import vllm_env

HF_LOOKUP_TOKENS = 10  # transformers' documented example value
LLAMACPP_LOOKUP_TOKENS = 2  # llama-cpp-python's advice for CPU-only machines (10 on GPU)


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


class HFPeer(Peer):
    name = "hf"
    package = "transformers"
    hint = "pip install transformers"
    tokens_per_forward = 1.0
    lookup = 0

    def setup(self, engine) -> None:
        hf_logging.disable_progress_bar()
        src = engine.loaded.source
        if not os.path.isdir(src):
            raise ValueError(f"{self.name} needs a HF model directory, not {src!r}")
        self.model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval().to(engine.model.device)
        self.eos = list(engine.loaded.eos_ids)
        # as in mtp.core.decode, the <mtp_mask> token is never a prediction
        mid = engine.mask_id
        self.suppress = [mid] if mid is not None and mid < self.model.config.vocab_size else None

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt_ids], device=self.model.device)  # [1, T]
        kw = {"prompt_lookup_num_tokens": self.lookup} if self.lookup else {}
        if self.suppress:
            kw["suppress_tokens"] = self.suppress
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      do_sample=False, temperature=None, top_p=None, top_k=None,
                                      eos_token_id=self.eos or None, pad_token_id=(self.eos or [0])[0], **kw)
        return _cut_at_eos(out[0, len(prompt_ids):].tolist(), self.eos)

    def params(self) -> dict:
        return {"prompt_lookup_num_tokens": self.lookup} if self.lookup else {}


class HFLookupPeer(HFPeer):
    name = "hf-lookup"
    tokens_per_forward = None
    lookup = HF_LOOKUP_TOKENS


class LlamaCppPeer(Peer):
    name = "llamacpp"
    package = "llama_cpp"
    hint = "pip install llama-cpp-python (compiles llama.cpp, ~10 min on 2 cores)"
    tokens_per_forward = 1.0
    lookup = 0

    def setup(self, engine) -> None:
        from llama_cpp import Llama  # optional peer (pip install llama-cpp-python): imported when used
        path = loading.resolve(engine.loaded.name)
        if not (path.is_file() and path.suffix == ".gguf"):
            raise ValueError(f"{self.name} needs a .gguf model (the default smollm2-135m is one), not {path.name!r}")
        kw = {}
        if self.lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=self.lookup)
        threads = engine.config.threads or torch.get_num_threads()
        self.llm = Llama(model_path=str(path), n_ctx=engine.context_window, n_threads=threads,
                         n_threads_batch=threads, verbose=False, **kw)
        self.eos = set(engine.loaded.eos_ids) | {self.llm.token_eos()}

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        self.llm.reset()  # no prefix reuse between prompts or repeats: every run pays its prefill
        out: list[int] = []
        for tok in self.llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                     reset=True):
            if tok in self.eos:
                break
            out.append(int(tok))
            if len(out) >= max_new_tokens:
                break
        return out

    def params(self) -> dict:
        return {"num_pred_tokens": self.lookup} if self.lookup else {}


class LlamaCppLookupPeer(LlamaCppPeer):
    name = "llamacpp-lookup"
    tokens_per_forward = None
    lookup = LLAMACPP_LOOKUP_TOKENS


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
        self.proc = vllm_env.VllmProcess(vllm_env.target_dir(engine.loaded.name),
                                         {"name": self.name, "speculative_config": self.speculative_config()},
                                         max_model_len=engine.context_window)
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
        return {"method": "eagle3", "model": getattr(self, "dir", self.arg),
                "num_speculative_tokens": VLLM_SPEC_TOKENS}


PEERS = {p.name: p for p in (HFPeer, HFLookupPeer, LlamaCppPeer, LlamaCppLookupPeer, VllmPeer, VllmNgramPeer,
                             VllmEagle3Peer)}
PARAMETRISED = {"vllm-eagle3"}  # peers named NAME:ARG


def parse_baselines(text: str | None) -> list[str]:
    """'hf,llamacpp' -> ['hf', 'llamacpp']; an unknown name is a ValueError listing the known ones.
    A parametrised peer is written NAME:ARG (vllm-eagle3:DIR)."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    for n in names:
        base, sep, arg = n.partition(":")
        if base in PARAMETRISED and not (sep and arg):
            raise ValueError(f"baseline {base} needs its drafter folder: {base}:DIR (e.g. from mtp export)")
        if base not in PEERS or (base not in PARAMETRISED and sep):
            raise ValueError(f"unknown baseline {n!r}; choose from " + ", ".join(
                p + (":DIR" if p in PARAMETRISED else "") for p in PEERS))
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
