"""Engine: a loaded model with its tokenizer, adapter and proposer, ready to decode text.

The glue every front end shares (CLI, server, benchmarks, pipeline): prompt encoding with the chat
template, context-window checks, proposer construction, and turning a finished `decode.Sequence`
into a result with the metrics of `mtp.core.decoding.metrics`. The decoding itself is `mtp.core.decoding.decode`.
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtp.core.decoding.decode import Sequence, stream
from mtp.core.decoding.metrics import DecodeStats, accepted_by_proposer
from mtp.core.decoding.proposers import MergedProposer, Proposer, check_proposer
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy
from mtp.core.policy.calibration import CalibratedProposer, Calibration
from mtp.core.policy.costmodel import cached, measure
from mtp.core.runtime import kernels, loading
from mtp.core.runtime.adapter import load_adapter
from mtp.core.runtime.artifacts import ASSETS, base_hash
from mtp.core.runtime.machine import cpu_info
from mtp.core.runtime.weights import attach, attach_proposer, check_quantize

SHIPPED = {"smollm2-135m": ASSETS / "smollm2-135m"}  # shipped adapter / heads per embedded model
TREE_SUFFIX = "/tree"  # EngineConfig.calibration key of a proposer's tree-node calibration ("heads/tree")


@dataclass
class EngineConfig:
    model: str = loading.DEFAULT_MODEL
    adapter: str | None = "auto"  # directory, 'auto' (shipped, if any) or 'none'
    proposer: str = "mask"  # a name of mtp.core.decoding.proposers.REGISTRY
    heads: str | None = "auto"
    eagle3: str | None = "auto"  # EAGLE-3 drafter directory (for --proposer eagle3)
    datastore: str | None = "auto"  # suffix datastore directory (for --proposer suffix; `mtp datastore build`)
    threads: int = 0
    device: str = "cpu"
    pack: bool = True  # prepare the weights for inference (False: training, which takes the torch path)
    weights: str = "native"  # native | float32 | torch: which arithmetic runs the model (mtp.core.runtime.weights)
    quantize: str | None = None  # q8_0 | q4_0 | q4_1: quantise a float32 checkpoint's linears at load (weights.attach)
    calibration: dict = field(default_factory=dict)  # proposer name (chains) or name + '/tree' -> per-depth maps


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str
    strategy: str
    summary: dict
    chunks: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    stats: DecodeStats | None = None

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "strategy": self.strategy,
            **self.summary,
            "chunks": self.chunks,
        }


class Engine:
    def __init__(self, loaded: loading.Loaded, config: EngineConfig):
        self.loaded, self.config = loaded, config
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.adapter_dir: Path | None = None
        self.asset_dirs: dict[str, Path] = {}  # asset kind ("heads") -> the directory loaded
        self._loaded_proposers: dict[str, Proposer] = {}  # proposers built from an asset, once
        self.cost_model = None  # mtp.core.policy.costmodel.CostModel, measured on first need (tree:auto)
        self.weights_line = "torch (not prepared for inference)"  # what runs the model (core.runtime.weights.attach)

    @classmethod
    def load(cls, config: EngineConfig) -> "Engine":
        if config.threads:
            torch.set_num_threads(config.threads)
        spec = check_proposer(config.proposer)
        check_quantize(config.quantize)
        if config.quantize is not None and not config.pack:
            raise ValueError(f"--quantize {config.quantize} prepares the weights for inference: drop --no-pack")
        engine = cls(loading.load(config.model, device=config.device), config)
        check_quantize(config.quantize, engine.loaded.gguf)  # before any other work on the model
        adapter = engine._resolve_asset(config.adapter, "adapter")
        if adapter is not None:
            load_adapter(engine.model, adapter, n_tokenizer=len(engine.tokenizer))
            engine.adapter_dir = adapter
        if config.pack:  # after every weight is final (asset proposers never change the model's)
            engine.weights_line = attach(engine.model, config.weights, engine.loaded.gguf, config.quantize)
        for part in spec.parts or (config.proposer,):
            if check_proposer(part).asset is not None:
                engine._load_asset_proposer(part)
        return engine

    @property
    def heads_dir(self) -> Path | None:
        return self.asset_dirs.get("heads")

    def _resolve_asset(self, value: str | None, kind: str) -> Path | None:
        if value in (None, "none", ""):
            return None
        if value == "auto":
            shipped = SHIPPED.get(self.config.model)
            path = shipped / kind if shipped else None
            return path if path is not None and (path / "config.json").exists() else None
        path = Path(value)
        if not path.is_dir():
            raise ValueError(f"{kind} directory not found: {value}")
        return path

    @property
    def mask_id(self) -> int | None:
        return self.model.config.mask_token_id

    @property
    def context_window(self) -> int:
        return self.model.config.max_seq_len

    def _load_asset_proposer(self, name: str) -> Proposer:
        """Build proposer `name` from its asset directory (--heads / --eagle3, 'auto' = shipped), once.
        Asset proposers are modules beside the model; they never change its weights."""
        spec = check_proposer(name)
        path = self._resolve_asset(getattr(self.config, spec.asset), spec.asset)
        if path is None:
            raise ValueError(f"--proposer {name} needs --{spec.asset} DIR (no shipped {spec.asset} for this model)")
        self._loaded_proposers[name] = spec.make(self.model, path)
        self.asset_dirs[spec.asset] = path
        if self.config.pack:  # its modules on the kernels as the model's (--weights)
            attach_proposer(self._loaded_proposers[name], self.model, self.config.weights)
        return self._loaded_proposers[name]

    def proposer(self, name: str | None = None, wrap=None) -> Proposer:
        """A proposer: `name`, default the engine's `--proposer`; one built from an asset (heads,
        eagle3) is loaded on first use and then shared by every sequence of the engine.
        `wrap(name, proposer) -> Proposer`, if given, wraps every single (not merged) proposer before
        its calibration is applied (`mtp tune`'s replays keep the heads' answers that way)."""
        name = name or self.config.proposer
        spec = check_proposer(name)
        if spec.parts:
            proposer = MergedProposer([self.proposer(p, wrap) for p in spec.parts])
        elif spec.asset is None:
            proposer = spec.make()
        elif name not in self._loaded_proposers:
            proposer = self._load_asset_proposer(name)
        else:
            proposer = self._loaded_proposers[name]
        if wrap is not None and not spec.parts:
            proposer = wrap(name, proposer)
        chain, tree = (self._calibration(key) for key in (name, name + TREE_SUFFIX))
        if chain is not None or tree is not None:  # `mtp tune`'s fits: conf_adapt and merges read them
            proposer = CalibratedProposer(proposer, chain, tree)
        return proposer

    def _calibration(self, key: str) -> Calibration | None:
        c = self.config.calibration.get(key)
        return c if c is None or isinstance(c, Calibration) else Calibration.from_json(c)

    def can_propose(self, name: str | None = None) -> bool:
        """Whether proposer `name` (default the engine's) can run: the mask proposers need an adapter."""
        return not check_proposer(name or self.config.proposer).needs_mask_token or self.mask_id is not None

    def encode(self, prompt: str | list[dict], chat: bool = True) -> list[int]:
        """Text (or chat messages) -> token ids, with the model's chat template when asked."""
        if isinstance(prompt, list) or (chat and getattr(self.tokenizer, "chat_template", None)):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise ValueError("empty prompt")
        return ids

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def new_sequence(
        self,
        prompt_ids: list[int],
        strategy: str | Strategy,
        params: SamplingParams,
        proposer: str | None = None,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
    ) -> Sequence:
        """A Sequence ready to decode; `logprobs` / `prompt_logprobs`: what it records (`Sequence`)."""
        strategy = Strategy.parse(strategy) if isinstance(strategy, str) else strategy
        proposer = proposer or self.config.proposer
        n = len(prompt_ids)
        if n >= self.context_window:
            raise ValueError(f"prompt of {n} tokens does not fit the context window of {self.context_window}")
        if n + params.max_new_tokens > self.context_window:
            raise ValueError(
                f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"context window of {self.context_window}"
            )
        if strategy.k > 1 and not self.can_propose(proposer):
            raise ValueError(
                f"strategy {strategy} needs an MTP adapter (the model has no <mtp_mask> token); "
                "pass --adapter DIR or use ntp / --proposer lookup"
            )
        return Sequence(
            list(prompt_ids),
            strategy,
            params,
            self.proposer(proposer),
            eos_ids=self.loaded.eos_ids,
            decode_text=self.decode_text,
            pass_time=self.pass_time() if strategy.auto else None,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def pass_time(self):
        """t(q) of this machine (`mtp.core.policy.costmodel`): set by the owner (`mtp serve` measures it at
        start-up), else, for `tree:auto`, read from the cache where this machine, thread count, weights,
        model and kernel build measured it before (`costmodel.cached`), or measured once (~2 s) and kept."""
        if self.cost_model is None:
            cache_len = max(0, min(256, self.context_window - 33))
            key = {"t(q)": "one row, q = 1..32, median of 3", "cache_len": cache_len, **self.timing_key()}
            self.cost_model = cached(key, lambda: measure(self.model, range(1, 33), cache_len, 1, 3))
        return self.cost_model.pass_time

    def timing_key(self) -> dict:
        """What a pass's time depends on here: the CPU, threads, the arithmetic (`weights_line`, the kernel
        build, `MTP_KERNEL_ISA`), the model and adapter (their weights' fingerprint), torch, the device."""
        return {
            "cpu": cpu_info(),
            "threads": torch.get_num_threads(),
            "weights": self.weights_line,
            "kernels": kernels.library(),
            "isa": os.environ.get("MTP_KERNEL_ISA", ""),
            "model": base_hash(self.model),
            "torch": torch.__version__,
            "device": str(self.model.device),
        }

    def stream(self, seq: Sequence, cache=None):
        return stream(self.model, seq, self.mask_id, cache)

    def result(self, seq: Sequence) -> Result:
        text = seq.text if seq.text is not None else self.decode_text(seq.output)
        return Result(
            text=text,
            token_ids=list(seq.output),
            finish_reason=seq.finish_reason or "length",
            strategy=str(seq.strategy),
            summary=seq.stats.summary(seq.strategy.k),
            chunks=list(seq.stats.chunks),
            confidences=list(seq.stats.confidences),
            prompt_tokens=len(seq.prompt_ids),
            stats=seq.stats,
        )

    def generate(
        self, prompt, strategy: str | Strategy = "ntp", params: SamplingParams | None = None, chat: bool = True
    ) -> Result:
        ids = (
            prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else self.encode(prompt, chat)
        )
        seq = self.new_sequence(ids, strategy, params or SamplingParams())
        for _ in self.stream(seq):
            pass
        return self.result(seq)

    def render_chunks(self, result: Result, as_html: bool = False) -> str:
        """The text with each forward pass's tokens on one background colour (terminal or HTML).

        In HTML, a pass that accepted drafts also names the branch it accepted: class `from-NAME` for
        each proposer that drafted the accepted path's deepest node (so the whole path; a merge's parts,
        else the proposer), and its title counts the accepted drafts per proposer."""
        colours = ["44", "42", "45", "46", "43", "41"]
        accepted_from = result.stats.accepted_from if result.stats is not None else []
        pieces, i = [], 0
        for j, n in enumerate(result.chunks):
            ids = result.token_ids[i : i + n]
            i += n
            if not ids:
                continue
            # decode with the preceding text so multi-token characters come out whole
            text = self.decode_text(result.token_ids[:i])[len(self.decode_text(result.token_ids[: i - n])) :]
            if as_html:
                drafted = accepted_from[j] if j < len(accepted_from) else []
                cls, title = f"c{j % 6}", f"pass {j}: {n} tokens"
                if drafted:
                    counts = accepted_by_proposer([drafted])
                    cls += "".join(f" from-{name}" for name in drafted[-1])
                    title += f"; {len(drafted)} drafts accepted, drafted by " + ", ".join(
                        f"{name} ({c})" for name, c in counts.items()
                    )
                pieces.append(
                    f'<span class="{html.escape(cls)}" title="{html.escape(title)}">{html.escape(text)}</span>'
                )
            else:
                pieces.append(f"\x1b[{colours[j % 6]}m{text}\x1b[0m")
        return "".join(pieces)
