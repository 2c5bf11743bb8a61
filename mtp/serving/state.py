"""What the server knows between requests: the engine, the scheduler, the metrics, and how an
OpenAI request becomes scheduled `Request`s (its checks: model name, sampling limits, strategy,
context length, prompt text and size, `n`, `logprobs`, `echo`). Everything that is tokenised counts
against --max-prompt-chars before any tokenising: a completion's prompt; a chat's roles and contents
together (the message count is bounded earlier, by `openai.parse_request`).

What a request asks beyond its text (`Asked`, checked by `asked`):
- `logprobs` (completions: N; chat: `logprobs: true` + `top_logprobs: N`, N <= MAX_TOP_LOGPROBS): each
  generated token's log-probability under the model's raw logits (temperature 1, no top-k/top-p: the
  distribution itself, whatever the request samples with) and its top N, from the pass that verified it
  (`mtp.core.decoding.decode`). Lossless strategies only: a lossy one (conf_adapt, static) emits guesses no pass
  verified, so a request with logprobs and a lossy strategy is refused (400), unless it generates at
  most one token: every strategy's first token is the model's own, so it runs as ntp.
- `echo` (completions only): the prompt before the completion, with its tokens' log-probabilities from
  the prefill pass (the first token's is null); `max_tokens: 0` only with `echo` (prompt scoring: one
  token is decoded in the prefill pass and not returned).
- `n` (at most --max-n, ServeConfig.max_n): n choices. Sampled, each is a `Request` of its own (a batch
  row, admitted like any request but at most `Scheduler.row_share` at a time; choice i seeded with seed + i
  when a seed is given: for a lossless strategy the text of a separate request seeded seed + i, as the
  decoding loop draws ntp's samples whatever the batch and caps), the choices after the first starting
  from its prefill (`Scheduler.share_prefill`). Greedy, the n choices are identical: decoded once,
  answered n times.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from dataclasses import dataclass

from mtp.core.decoding.sampling import SEED_MAX, SamplingParams
from mtp.core.decoding.strategy import Strategy
from mtp.core.engine import Engine
from mtp.core.policy import quality
from mtp.core.policy.deploy import check_within_caps
from mtp.serving.config import MAX_TOP_LOGPROBS, ServeConfig
from mtp.serving.openai import APIError, ChatRequest, CommonRequest, CompletionRequest
from mtp.serving.prometheus import ServerMetrics
from mtp.serving.rollout import TUNED, Rollout
from mtp.serving.scheduler import Request, Scheduler, SchedulerClosed
from mtp.serving.shadow import ShadowLog, compare

log = logging.getLogger("mtp.serve")


@dataclass(frozen=True)
class Asked:
    """What a request asks beyond its text (see the module docstring)."""

    n: int = 1  # choices
    logprobs: int | None = None  # alternatives per token (0..MAX_TOP_LOGPROBS); None = no log-probabilities
    echo: bool = False  # the prompt before the completion
    generate: bool = True  # False: `max_tokens: 0` (prompt scoring), the completion is empty


class ServerState:
    def __init__(self, engine: Engine, config: ServeConfig, pass_time=None):
        self.engine, self.config = engine, config
        sc = config.scheduler
        if sc.max_model_len > engine.context_window:  # never promise more than the model's window
            sc.max_model_len = engine.context_window
        self.scheduler = Scheduler(engine.model, engine.mask_id, config.scheduler, pass_time)
        self.rollout = None
        if config.deploy is not None:
            self.rollout = Rollout(
                config.deploy, config.rollout, config.rollout_step, config.rollout_window, config.shadow_seed
            )
        self.request_ids = itertools.count()  # what a rollout hashes to assign a request
        self.metrics = ServerMetrics(self.scheduler, self.rollout)
        self.shadow_log = ShadowLog(config.shadow_log) if config.shadow_rate > 0 else None
        self.rng = random.Random(config.shadow_seed)
        self.created = int(time.time())

    # -- building a Sequence from a request
    def sampling(self, body: CommonRequest) -> SamplingParams:
        stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else list(self.config.stop)
        if len(stop) > 4:
            raise APIError(400, "at most 4 stop sequences are supported", "stop")
        t = self.config.temperature if body.temperature is None else body.temperature
        top_p = self.config.top_p if body.top_p is None else body.top_p
        top_k = self.config.top_k if body.top_k is None else body.top_k
        seed = self.config.seed if body.seed is None else body.seed
        try:  # the limits every front end shares
            return SamplingParams(temperature=t, top_p=top_p, top_k=top_k, seed=seed, stop=stop)
        except ValueError as e:
            param = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), param if param in ("temperature", "top_p", "top_k", "seed") else None) from None

    def strategy(self, body: CommonRequest) -> Strategy:
        text = body.mtp.strategy if body.mtp and body.mtp.strategy is not None else self.config.strategy
        try:
            return Strategy.parse(text)  # K is capped there, for every front end
        except ValueError as e:
            raise APIError(400, str(e), "mtp.strategy") from None

    def asked(self, body: CommonRequest, max_tokens: int | None) -> Asked:
        """`n`, `logprobs` / `top_logprobs`, `echo` and `max_tokens: 0`, checked (APIError 400)."""
        chat = isinstance(body, ChatRequest)
        n = 1 if body.n is None else body.n
        if not 1 <= n <= self.config.max_n:
            raise APIError(400, f"n must be in [1, {self.config.max_n}] on this server, got {n}", "n")
        lp, param = body.logprobs, "logprobs"
        if chat:
            if (body.model_extra or {}).get("echo") not in (None, False):
                raise APIError(400, "echo is supported on /v1/completions only", "echo")
            if lp is not None and not isinstance(lp, bool):
                raise APIError(400, "logprobs must be true or false here (top_logprobs gives the count)", "logprobs")
            if body.top_logprobs is not None and not lp:
                raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            logprobs, param, echo = ((body.top_logprobs or 0) if lp else None), "top_logprobs", False
        else:
            if lp is True:
                raise APIError(400, f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] here", "logprobs")
            logprobs, echo = (None if lp is None or lp is False else lp), bool(body.echo)
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", param)
        generate = chat or max_tokens != 0
        if not generate and not echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo: prompt scoring)", "max_tokens")
        return Asked(n, logprobs, echo, generate)

    def new_request(self, body: CommonRequest, ids: list[int], max_tokens: int | None) -> Request:
        """The request's first (or only) choice; `choices` adds the others."""
        if body.model is not None and body.model != self.config.model_name:
            raise APIError(
                404,
                f"The model {body.model!r} does not exist; this server serves {self.config.model_name!r}",
                "model",
                "model_not_found",
            )
        asked = self.asked(body, max_tokens)
        params = self.sampling(body)
        arm, proposer = None, None
        if self.rollout is not None and not (body.mtp and body.mtp.strategy is not None):
            arm, chosen = self.rollout.assign(next(self.request_ids))  # once, at admission: a switch never
            strategy, proposer = chosen.strategy, chosen.proposer  # moves a request in flight
        else:
            strategy = self.strategy(body)
            self.check_caps(strategy)
        limit = self.config.scheduler.max_model_len
        n = len(ids)
        if n >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; the prompt has {n}",
                "messages" if isinstance(body, ChatRequest) else "prompt",
                "context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = min(self.config.max_tokens, limit - n)
        if not asked.generate:
            max_tokens = 1  # prompt scoring: the prefill pass decodes one token, which is not returned
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        if n + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; the prompt ({n}) + "
                f"max_tokens ({max_tokens}) exceed it",
                "max_tokens",
                "context_length_exceeded",
            )
        if asked.logprobs is not None and not strategy.lossless:
            if max_tokens > 1:
                raise APIError(
                    400,
                    f"logprobs need a lossless strategy (ntp, verify:K, tree:N), not {strategy}: it emits "
                    "guesses no pass verified, whose distribution is not the model's",
                    "logprobs",
                )
            strategy = Strategy()  # one token: every strategy's first is the model's own, as ntp decodes it
        params.max_new_tokens = max_tokens
        try:
            seq = self.engine.new_sequence(
                ids,
                strategy,
                params,
                proposer,
                logprobs=asked.logprobs,
                prompt_logprobs=asked.echo and asked.logprobs is not None,
            )
        except ValueError as e:
            raise APIError(400, str(e), "mtp.strategy") from None
        return Request(seq, adaptive=body.mtp.adaptive if body.mtp else True, arm=arm, proposer=proposer)

    def choices(self, req: Request, asked: Asked) -> list[Request]:
        """The requests decoding a request's choices: `req` alone (n = 1, or greedy: n identical choices
        decoded once), else `req` and n - 1 more that follow its prefill (`Scheduler.share_prefill`),
        choice i seeded with seed + i when a seed is given."""
        first = req.seq
        if asked.n == 1 or first.params.greedy:
            return [req]
        out = [req]
        for i in range(1, asked.n):
            p = first.params
            params = SamplingParams(
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                seed=None if p.seed is None else (p.seed + i) % (SEED_MAX + 1),
                max_new_tokens=p.max_new_tokens,
                stop=list(p.stop),
            )
            seq = self.engine.new_sequence(
                first.prompt_ids, first.strategy, params, req.proposer, logprobs=first.logprobs
            )
            out.append(Request(seq, adaptive=req.adaptive, arm=req.arm, proposer=req.proposer, follows=req, choice=i))
        return out

    def check_caps(self, strategy: Strategy) -> None:
        """Under a deploy file, a request's own lossy strategy stays within its safety caps (the check
        the deploy file's tuned arm passed, `deploy.check_within_caps`), else 400."""
        if self.config.deploy is None:
            return
        try:
            check_within_caps(strategy, self.config.deploy.caps, "this server's")
        except ValueError as e:
            raise APIError(400, str(e), "mtp.strategy") from None

    def check_chars(self, n: int, param: str) -> None:
        """`n` characters to tokenise: refused above --max-prompt-chars."""
        if n > self.config.max_prompt_chars:
            raise APIError(
                400,
                f"the prompt has {n} characters, more than this server's limit of {self.config.max_prompt_chars}",
                param,
                "context_length_exceeded",
            )

    def check_text(self, text: str, param: str) -> str:
        """Text a client sent: valid Unicode (no lone surrogates) and within the character limit,
        checked before any tokenising."""
        self.check_chars(len(text), param)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the prompt is not valid UTF-8 text (it holds a lone surrogate)", param) from None
        return text

    def completion_ids(self, body: CompletionRequest) -> list[int]:
        """Token ids of a completion request's prompt (call off the event loop: it tokenises)."""
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "one prompt per request is supported", "prompt")
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise APIError(400, "prompt must not be empty", "prompt")
            return self.engine.encode(self.check_text(p, "prompt"), chat=False)
        if not p:
            raise APIError(400, "prompt must not be empty", "prompt")
        vocab = self.engine.model.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab or t == self.engine.mask_id for t in p):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return list(p)

    def chat_ids(self, body: ChatRequest) -> list[int]:
        """Token ids of a chat request's messages with the chat template (call off the event loop)."""
        if not body.messages:
            raise APIError(400, "messages must not be empty", "messages")
        messages = []
        for m in body.messages:
            c = m.content
            if isinstance(c, list):
                try:
                    texts = [part["text"] for part in c if part.get("type") == "text"]
                except (KeyError, TypeError, AttributeError):
                    raise APIError(
                        400, "message content parts must be {'type': 'text', 'text': ...}", "messages"
                    ) from None
                if not texts or not all(isinstance(x, str) for x in texts):
                    raise APIError(
                        400, "a message's content parts hold no text (only text parts are supported)", "messages"
                    )
                c = "".join(texts)
            messages.append({"role": m.role, "content": c or ""})
        self.check_chars(sum(len(m["role"]) + len(m["content"]) for m in messages), "messages")
        for m in messages:
            self.check_text(m["content"], "messages")
        try:
            return self.engine.encode(messages, chat=True)
        except APIError:
            raise
        except Exception as e:  # details go to the log, not to the client
            log.info("chat template failed: %s", e)
            raise APIError(400, "cannot apply the model's chat template to these messages", "messages") from None

    # -- running a request
    def submit(self, reqs: list[Request], loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
        """Schedule a request's choices; their events arrive on one queue as (choice, tokens, final,
        the tokens' `TokenLogprob`s: empty without logprobs)."""
        q: asyncio.Queue = asyncio.Queue()

        def on_event(r, tokens, final):  # on the engine thread, right after the pass
            if final:
                self.metrics.finished(r)
            seq, records = r.seq, []
            if seq.logprobs is not None and tokens:  # this pass's tokens end the output (in step with it)
                records = seq.token_logprobs[len(seq.output) - len(tokens) : len(seq.output)]
            with contextlib.suppress(RuntimeError):  # loop already closed at shutdown
                loop.call_soon_threadsafe(q.put_nowait, (r.choice, tokens, final, records))

        try:
            for req in reqs:
                req.on_event = on_event
                self.scheduler.submit(req)
        except SchedulerClosed as e:
            for r in reqs:
                self.scheduler.cancel(r)
            raise APIError(503, str(e), code="server_shutting_down", type="server_error") from None
        except ValueError as e:
            for r in reqs:
                self.scheduler.cancel(r)
            raise APIError(400, str(e), "max_tokens", "context_length_exceeded") from None
        return q

    def text(self, req: Request, tokens: list[int]) -> str:
        seq = req.seq
        return seq.text if seq.text is not None else self.engine.decode_text(tokens)

    def mtp_summary(self, req: Request) -> dict:
        s = req.seq.stats.summary(req.seq.strategy.k)
        return {
            "strategy": str(req.seq.strategy),
            "forward_passes": s["forward_passes"],
            "tokens_per_forward": round(s["tokens_per_forward"], 4),
            "acceptance_by_position": [round(a, 4) for a in s["acceptance_by_position"]],
            "capped_passes": req.capped_passes,
            "queue_s": round((req.t_admitted or req.t_arrival) - req.t_arrival, 4),
            "decode_s": round((req.t_finish or 0) - (req.t_admitted or 0), 4) if req.t_finish else None,
        }

    def loss_metrics(self) -> tuple[str, ...]:
        """The losses a rollout tracks: exact and answer always, ROUGE-L when its package is there
        (or when the deploy file's metric is ROUGE-L: then `mtp serve` checked it at start-up)."""
        if self.config.deploy is not None and self.config.deploy.metric == "rougeL":
            return quality.METRICS
        try:
            import rouge_score  # noqa: F401  (optional: the [bench] extra)

            return quality.METRICS
        except ImportError:
            return ("exact", "answer")

    def maybe_shadow(self, req: Request) -> None:
        """After the answer went out: decode the same prompt with ntp in the background and log it."""
        seq = req.seq
        if (
            self.shadow_log is None
            or seq.strategy.plain
            or seq.finish_reason not in ("stop", "length")
            or (req.arm is not None and req.arm != TUNED)
            or self.rng.random() >= self.config.shadow_rate
        ):
            return  # under a rollout only the tuned configuration's requests are compared
        params = SamplingParams(
            temperature=seq.params.temperature,
            top_p=seq.params.top_p,
            top_k=seq.params.top_k,
            seed=seq.params.seed,
            max_new_tokens=seq.params.max_new_tokens,
            stop=list(seq.params.stop),
        )
        shadow = Request(self.engine.new_sequence(seq.prompt_ids, Strategy(), params), background=True)
        primary = {
            "ids": list(seq.output),
            "text": self.text(req, seq.output),
            "latency": req.t_finish - req.t_admitted,
            "strategy": str(seq.strategy),
            "tpf": seq.stats.summary()["tokens_per_forward"],
            "id": req.id,
        }

        def on_event(r, tokens, final):
            if not final or r.seq.finish_reason not in ("stop", "length"):
                return
            latency = r.t_finish - r.t_admitted
            rec = {
                "request_id": primary["id"],
                "strategy": primary["strategy"],
                "prompt_tokens": len(seq.prompt_ids),
                "temperature": seq.params.temperature,
                "tokens": len(primary["ids"]),
                "shadow_tokens": len(r.seq.output),
                **compare(primary["ids"], primary["text"], r.seq.output, self.text(r, r.seq.output)),
                "latency_s": round(primary["latency"], 4),
                "shadow_latency_s": round(latency, 4),
                "latency_ratio": round(primary["latency"] / latency, 4) if latency > 0 else None,
                "tokens_per_forward": round(primary["tpf"], 4),
            }
            if req.arm is not None:
                shadow_text = self.text(r, r.seq.output)
                rec["arm"] = req.arm
                rec["loss"] = {
                    m: quality.item_loss(m, primary["ids"], primary["text"], r.seq.output, shadow_text)
                    for m in self.loss_metrics()
                }
            self.shadow_log.write(rec)
            self.metrics.shadow_done(rec)
            if req.arm == TUNED:
                self.rollout.observe(rec["loss"])

        shadow.on_event = on_event
        with contextlib.suppress(SchedulerClosed, ValueError):
            self.scheduler.submit(shadow)
