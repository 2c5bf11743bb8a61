"""Pipeline-parallel decoding on torch.distributed: each process ("stage") holds a contiguous slice
of the layers and the matching slice of the KV cache.

Why: a model too large for one machine is split across servers, and every forward pass then pays
the link latency once per stage boundary. A multi-token pass saves whole passes, hence round trips,
so MTP's value grows with the latency (seed 000). `--link-delay-ms` dials that latency in.

One forward pass through P stages (any batch the decoding loop builds):
  stage 0    embeddings + its layers    --[header, positions/slots/out rows, hidden ⊕ gate (, layout)]-->  stage 1
  stage i    its layers                 --[same message, new hidden]----------------------->  stage i+1
  stage P-1  its layers + norm + lm_head --[header, logits (⊕ hidden)]--------------------->  stage 0
so a pass crosses P links. Stage 0 runs the one decoding loop (`mtp.core.decode.decode_step`) unchanged,
with `PipelineModel` standing in for the Transformer; proposing, accepting and committing happen on
stage 0 only. The other stages need no rollback message: every block carries its positions, and a
query at position p reads cache slots 0..p only, so the KV entries of rejected drafts and of masks
are overwritten by the next block that reaches those positions, on every stage, before anything
reads them (tests/test_pipeline.py checks every stage's cache against a fresh prefill). A `verify`
block with branched mask groups (mtp.core.decode) also carries its layout: the cache slot of each row and
the [B, T, S] attention mask (a few KB), since its masks' RoPE positions are not their slots.

Faults: every wait is bounded (`timeout_s`); a watchdog thread per stage beats a heartbeat into the
rendezvous store and watches the others'; the first stage to notice a failure posts one line naming
the stage at fault there, and every stage exits non-zero with it.

Run: `mtp pipeline --stages P PROMPT ...` (P local processes), or across machines
`torchrun --nnodes P --nproc-per-node 1 --node-rank R --master-addr HOST --master-port PORT \\
 -m mtp.pipeline.stages PROMPT --strategy conf_adapt:0.9 ...` (same options as `mtp generate`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mtp.core.cache import KVCache
from mtp.core.model import Transformer

# message header: [op, B, T, N, flags, cache_epoch, cache_rows, cache_capacity, delay_us, spare]
HEADER = 10
OP_SHUTDOWN, OP_FORWARD, OP_RESULT = 0, 1, 2
F_CACHE, F_SLOTS, F_OUT, F_GATE, F_HIDDEN, F_LAYOUT = 1, 2, 4, 8, 16, 32
IDLE_WAIT = timedelta(days=7)  # a stage waiting for the next pass relies on the watchdog instead


@dataclass
class PipelineConfig:
    link_delay_ms: float = 0.0  # added before every inter-stage message (P messages per pass)
    timeout_s: float = 60.0  # bound on every wait inside a pass, and on a silent heartbeat
    backend: str = "auto"  # gloo on CPU, nccl when the model is on CUDA
    heartbeat_s: float = 0.25


class PipelineError(RuntimeError):
    """A stage died, hung or failed; the message names it. `first`: this stage posted it (so it is
    the one to print it, besides stage 0)."""

    def __init__(self, msg: str, first: bool = True):
        super().__init__(msg)
        self.first = first


def layer_ranges(n_layers: int, stages: int) -> list[range]:
    """Contiguous, balanced layer slices; the first stages take one more layer when it does not divide."""
    if not 1 <= stages <= n_layers:
        raise ValueError(f"--stages must be between 1 and the model's {n_layers} layers, not {stages}")
    size, extra = divmod(n_layers, stages)
    out, start = [], 0
    for s in range(stages):
        n = size + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


def keep_slice(model: Transformer, stage: int, stages: int) -> Transformer:
    """Prune `model` in place to what stage `stage` needs: its layers; stage 0 keeps the embeddings
    (and the head, which proposers may use); the last stage the final norm and lm_head (with tied
    embeddings that is the embedding matrix too)."""
    r = layer_ranges(model.config.n_layers, stages)[stage]
    model.layers = torch.nn.ModuleList(model.layers[i] for i in r)
    if 0 < stage:
        model.embed_tokens = None
    if 0 < stage < stages - 1:
        model.norm, model.lm_head = None, None
    return model


# ---------------------------------------------------------------------------------------------
# process group, watchdog, links

def _store_address() -> tuple[str, int]:
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))


def _store_prefix() -> str:
    env = os.environ  # torchrun: one namespace per run and restart
    return f"mtp_pipeline/{env.get('TORCHELASTIC_RUN_ID', 'local')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def init_group(rank: int, world: int, config: PipelineConfig, backend: str) -> None:
    """Join the process group through the TCP store at MASTER_ADDR:MASTER_PORT. Stage 0 hosts the
    store unless torchrun's agent or the `mtp pipeline` launcher already does."""
    addr, port = _store_address()
    external = (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                or os.environ.get("MTP_PIPELINE_STORE") == "external")
    timeout = timedelta(seconds=config.timeout_s)
    store = dist.TCPStore(addr, port, world, rank == 0 and not external, timeout=timeout, wait_for_workers=False)
    dist.init_process_group(backend, store=dist.PrefixStore(_store_prefix() + "/pg", store), rank=rank,
                            world_size=world, timeout=timeout)


class Watchdog:
    """Heartbeats in the rendezvous store, and one shared place for the first failure anyone saw.

    Every `heartbeat_s` each stage bumps its counter `hb/RANK`, checks whether a failure was posted
    (then it exits: stage 0 printing the line, the others silently) and whether a peer's counter has
    stood still for `timeout_s` (then it posts "stage R stopped responding" and exits)."""

    def __init__(self, rank: int, world: int, config: PipelineConfig):
        self.rank, self.world, self.config = rank, world, config
        addr, port = self.address = _store_address()
        client = dist.TCPStore(addr, port, None, False, timeout=timedelta(seconds=max(config.timeout_s, 5)))
        self.store = dist.PrefixStore(_store_prefix() + "/watch", client)
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        now = time.monotonic()
        self.seen = {r: (-1, now) for r in range(world) if r != rank}  # rank -> (counter, when it last moved)
        self.thread = threading.Thread(target=self._run, name=f"mtp-pipeline-watchdog-{rank}", daemon=True)

    def start(self) -> "Watchdog":
        self.thread.start()
        return self

    def stop(self, done: bool = True) -> None:
        """Stop watching (before this stage leaves): peers stop expecting heartbeats from it."""
        if self.stopped.is_set():
            return
        self.stopped.set()
        self.thread.join(timeout=5)
        if done:
            try:
                with self.lock:
                    self.store.set(f"done/{self.rank}", "1")
            except Exception:
                pass

    def posted(self) -> str | None:
        with self.lock:
            if self.store.check(["abort"]):
                return self.store.get("abort").decode()
        return None

    def post(self, msg: str) -> tuple[str, bool]:
        """Record a failure unless one was recorded first; return the one that stands and whether
        it is ours."""
        try:
            with self.lock:
                if int(self.store.add("abort_n", 1)) == 1:
                    self.store.set("abort", msg)
                    return msg, True
                deadline = time.monotonic() + 2.0
                while not self.store.check(["abort"]) and time.monotonic() < deadline:
                    time.sleep(0.02)
                return self.store.get("abort").decode(), False
        except Exception:
            return msg, True

    def silent(self) -> list[tuple[int, float]]:
        """Every live peer (not yet done) with the seconds since its heartbeat last moved."""
        now, out = time.monotonic(), []
        with self.lock:
            for r, (count, since) in self.seen.items():
                if self.store.check([f"done/{r}"]):
                    continue
                c = int(self.store.add(f"hb/{r}", 0))
                if c != count:
                    self.seen[r] = (c, now)
                out.append((r, now - self.seen[r][1]))
        return out

    def diagnose(self, peer: int, err: Exception, what: str) -> PipelineError:
        """Turn a failed send/recv with `peer` into the error to report (someone else's if posted first)."""
        deadline = time.monotonic() + 4 * self.config.heartbeat_s + 0.5
        try:
            while time.monotonic() < deadline:  # a better-placed stage may be posting the cause right now
                msg = self.posted()
                if msg:
                    return PipelineError(msg, first=False)
                time.sleep(self.config.heartbeat_s / 2)
            text = str(err)
            if any(s in text for s in ("closed by peer", "Connection reset", "Broken pipe", "closed")):
                msg = f"stage {peer} closed its link to stage {self.rank} (it crashed or was killed)"
            elif "imed out" in text or "imeout" in text:
                silent = [(r, t) for r, t in self.silent() if t > 4 * self.config.heartbeat_s + 1.0]
                if silent:
                    r, s = max(silent, key=lambda x: x[1])
                    msg = f"stage {r} stopped responding (no heartbeat for {s:.1f} s: hung, stopped or killed)"
                else:
                    msg = (f"stage {self.rank} got nothing from stage {peer} within {self.config.timeout_s:g} s "
                           f"while {what} (a stage is stuck; raise --timeout-s if passes are this slow)")
            else:
                msg = f"link stage {self.rank} <-> stage {peer} failed while {what}: {text.splitlines()[0][:200]}"
        except Exception:  # the store itself is gone: its host died
            msg = self._store_lost()
        return PipelineError(*self.post(msg))

    def _store_lost(self) -> str:
        addr, port = self.address
        return (f"the rendezvous store at {addr}:{port} is unreachable (its host died: stage 0, torchrun's "
                f"agent or the `mtp pipeline` launcher)")

    def _exit(self, msg: str, speak: bool) -> None:
        if speak:
            print(f"mtp: error: pipeline: {msg}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)

    def _run(self) -> None:
        timeout = self.config.timeout_s
        while not self.stopped.wait(self.config.heartbeat_s):
            try:
                with self.lock:
                    self.store.add(f"hb/{self.rank}", 1)
                msg = self.posted()
                if msg:
                    self._exit(msg, speak=self.rank == 0)
                for r, t in self.silent():
                    if t > timeout:
                        msg, first = self.post(f"stage {r} stopped responding (no heartbeat for {t:.1f} s: "
                                               "hung, stopped or killed)")
                        self._exit(msg, speak=first or self.rank == 0)
            except Exception:
                if self.stopped.is_set():
                    return
                self._exit(self._store_lost(), speak=True)


class Link:
    """Point-to-point messages between stages: bounded waits, and the dialled-in delay before each
    message (a message = its header and payload tensors, sent back to back)."""

    def __init__(self, rank: int, world: int, config: PipelineConfig, watchdog: Watchdog, device):
        self.rank, self.world, self.config, self.watchdog = rank, world, config, watchdog
        self.device = device  # where transported tensors live (CPU for gloo)
        self.delay_s = config.link_delay_ms / 1000.0
        self.broken = False

    def send(self, dst: int, tensors: list[torch.Tensor]) -> None:
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        tensors = [t.to(self.device).contiguous() for t in tensors]  # kept alive until sent
        timeout = timedelta(seconds=self.config.timeout_s)
        with self._failures(dst, f"sending to stage {dst}"):
            works = [dist.isend(t, dst) for t in tensors]
            for w in works:
                w.wait(timeout)

    def recv(self, src: int, shape, dtype, idle: bool = False) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        with self._failures(src, f"waiting for stage {src}"):
            dist.irecv(t, src).wait(IDLE_WAIT if idle else timedelta(seconds=self.config.timeout_s))
        return t

    @contextlib.contextmanager
    def _failures(self, peer: int, what: str):
        """A failed or timed-out transfer becomes a PipelineError naming the stage at fault."""
        try:
            yield
        except RuntimeError as e:
            self.broken = True
            raise self.watchdog.diagnose(peer, e, what) from None


def _header(op: int, *values: int) -> torch.Tensor:
    h = torch.zeros(HEADER, dtype=torch.long)
    h[0] = op
    h[1:1 + len(values)] = torch.tensor(values, dtype=torch.long)
    return h


# ---------------------------------------------------------------------------------------------
# stage 0: the stand-in model

class PipelineModel:
    """Stage 0's stand-in for `Transformer`: the same call (tokens, positions, cache, slots, out_index,
    return_hidden) and `.config`/`.device`, so `decode_step` runs unchanged. Its layers run here, the
    rest on stages 1..P-1; the logits come back from the last stage."""

    def __init__(self, model: Transformer, link: Link):
        self.model, self.link = model, link  # model: stage 0's slice (see keep_slice)
        self.config = model.config
        self.world = link.world
        self._cache, self._epoch = None, 0

    @property
    def device(self):
        return self.model.device

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        """Stage 0's cache (its own layers); the other stages allocate theirs on the first pass."""
        cfg, w = self.config, self.model.embed_tokens.weight
        return KVCache(len(self.model.layers), rows, cfg.n_kv_heads, capacity, cfg.head_dim, w.dtype, w.device)

    def __call__(self, tokens, positions=None, cache=None, slots=None, attn_mask=None, out_index=None,
                 return_hidden=False, cache_positions=None):
        # tokens, positions: [B, T]; slots: [B]; out_index: [B, N]; with a branched layout (mtp.core.decode)
        # cache_positions [B, T] and attn_mask [B, T, S] travel along
        if (attn_mask is None) != (cache_positions is None) or (attn_mask is not None and cache is None):
            raise ValueError("pipeline stages decode with a KV cache; an attn_mask needs cache_positions")
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        m = self.model
        x = m.embed_tokens(tokens)  # [B, T, dim]
        gate = m.adapter_gate(tokens)  # [B, T] or None: 1 at mask positions
        if gate is not None:
            gate = gate.unsqueeze(-1)  # [B, T, 1]
        if cache is not None and cache is not self._cache:
            self._cache, self._epoch = cache, self._epoch + 1  # the other stages start a fresh cache too
        x = m.forward_layers(x, positions, cache, slots, attn_mask, gate, cache_positions)
        if self.world == 1:
            return m.forward_head(x, out_index, return_hidden)
        N = out_index.shape[1] if out_index is not None else T
        flags = ((F_CACHE if cache is not None else 0) | (F_SLOTS if slots is not None else 0)
                 | (F_OUT if out_index is not None else 0) | (F_GATE if gate is not None else 0)
                 | (F_HIDDEN if return_hidden else 0) | (F_LAYOUT if attn_mask is not None else 0))
        rows, cap = (cache.rows, cache.capacity) if cache is not None else (0, 0)
        S = attn_mask.shape[-1] if attn_mask is not None else 0
        hdr = _header(OP_FORWARD, B, T, N, flags, self._epoch, rows, cap, round(self.link.delay_s * 1e6), S)
        ints = [positions.reshape(-1)] + [t.reshape(-1) for t in (slots, out_index, cache_positions)
                                          if t is not None]
        floats = x if gate is None else torch.cat([x, gate.to(x.dtype)], -1)  # [B, T, dim (+1)]
        extra = [] if attn_mask is None else [attn_mask.to(torch.uint8)]  # [B, T, S]
        self.link.send(1, [hdr, torch.cat([t.to(torch.long).cpu() for t in ints]), floats] + extra)
        # the logits (and hidden states) come back from the last stage
        last = self.world - 1
        rh = self.link.recv(last, (HEADER,), torch.long)
        _, rB, rN, V, has_hidden = rh[:5].tolist()
        dim = self.config.dim
        out = self.link.recv(last, (rB, rN, V + (dim if has_hidden else 0)), x.dtype).to(self.device)
        logits = out[..., :V].contiguous()  # [B, N, V]
        return (logits, out[..., V:].contiguous()) if return_hidden else logits

    forward = __call__

    def close(self) -> None:
        """Shut the other stages down (the message goes round the ring and comes back as the ack)."""
        if self.world == 1 or self.link.broken:
            return
        self.link.send(1, [_header(OP_SHUTDOWN)])
        self.link.recv(self.world - 1, (HEADER,), torch.long)


# ---------------------------------------------------------------------------------------------
# stages 1..P-1

def serve(model: Transformer, link: Link, watchdog: Watchdog | None = None) -> dict:
    """Run this stage's layers on every pass stage 0 starts, until it shuts the pipeline down.
    Returns the stage's final state (its cache), for tests."""
    rank, world = link.rank, link.world
    prev, nxt, last = rank - 1, rank + 1, rank == world - 1
    cfg = model.config
    dtype = next(model.layers.parameters()).dtype
    dev = next(model.layers.parameters()).device
    cache, epoch = None, None
    passes = 0
    while True:
        hdr = link.recv(prev, (HEADER,), torch.long, idle=True)
        op, B, T, N, flags, ep, rows, cap, delay_us, S = hdr[:10].tolist()
        if op == OP_SHUTDOWN:
            if watchdog is not None:
                watchdog.stop()
            link.send(0 if last else nxt, [hdr])
            return {"cache": cache, "passes": passes}
        link.delay_s = delay_us / 1e6  # stage 0 sets the delay of the whole ring
        layout = bool(flags & F_LAYOUT)
        n_ints = B * T + (B if flags & F_SLOTS else 0) + (B * N if flags & F_OUT else 0) + (B * T if layout else 0)
        ints = link.recv(prev, (n_ints,), torch.long)
        has_gate = bool(flags & F_GATE)
        floats = link.recv(prev, (B, T, cfg.dim + has_gate), dtype).to(dev)
        mask_u8 = link.recv(prev, (B, T, S), torch.uint8) if layout else None
        positions = ints[: B * T].view(B, T).to(dev)
        rest = ints[B * T:]
        slots = out_index = cache_positions = attn_mask = None
        if flags & F_SLOTS:
            slots, rest = rest[:B].to(dev), rest[B:]
        if flags & F_OUT:
            out_index, rest = rest[:B * N].view(B, N).to(dev), rest[B * N:]
        if layout:
            cache_positions, attn_mask = rest.view(B, T).to(dev), mask_u8.to(dev, torch.bool)
        x = floats[..., : cfg.dim]  # [B, T, dim]
        gate = floats[..., cfg.dim:] if has_gate else None  # [B, T, 1]
        if flags & F_CACHE and ep != epoch:
            cache = KVCache(len(model.layers), rows, cfg.n_kv_heads, cap, cfg.head_dim, dtype, dev)
            epoch = ep
        with torch.inference_mode():
            x = model.forward_layers(x, positions, cache if flags & F_CACHE else None, slots, attn_mask, gate,
                                     cache_positions)
            if last:
                out = model.forward_head(x, out_index, bool(flags & F_HIDDEN))
                logits, hidden = out if flags & F_HIDDEN else (out, None)
                payload = logits if hidden is None else torch.cat([logits, hidden.to(logits.dtype)], -1)
                link.send(0, [_header(OP_RESULT, B, logits.shape[1], logits.shape[2], hidden is not None),
                              payload])
            else:
                link.send(nxt, [hdr, ints, x if gate is None else torch.cat([x, gate], -1)]
                          + ([] if mask_u8 is None else [mask_u8]))
        passes += 1


def run_stage(rank: int, world: int, model: Transformer, config: PipelineConfig, stage0_fn=None):
    """Join the pipeline as stage `rank` of `world`, keeping only this stage's slice of `model`
    (pruned in place). Stage 0 runs `stage0_fn(pipeline_model)` and returns its result; the other
    stages serve passes until stage 0 is done and return their final state."""
    keep_slice(model, rank, world)
    dev = next(model.parameters()).device
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" and dist.is_nccl_available() else "gloo"
    try:
        init_group(rank, world, config, backend)
        watchdog = Watchdog(rank, world, config).start()
    except (RuntimeError, dist.DistError) as e:  # unreachable store, a stage that never came up
        raise PipelineError(f"stage {rank} could not join the pipeline at {':'.join(map(str, _store_address()))}: "
                            f"{str(e).strip().splitlines()[0][:300]}") from None
    link = Link(rank, world, config, watchdog, dev if backend == "nccl" else torch.device("cpu"))
    clean = False
    try:
        if rank == 0:
            pipe = PipelineModel(model, link)
            try:
                result = stage0_fn(pipe)
            finally:
                pipe.close()
        else:
            result = serve(model, link, watchdog)
        clean = True
        return result
    finally:
        watchdog.stop(done=clean)
        if clean:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# launching P local processes

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MTP_PIPELINE_STORE="external",
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        code = fn(rank, world, *args)
    except PipelineError as e:
        if e.first or rank == 0:
            print(f"mtp: error: pipeline: {e}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


def launch_local(stages: int, fn, args: tuple = (), grace_s: float = 3.0) -> int:
    """Run `fn(rank, stages, *args)` in `stages` fresh processes on this machine; this process hosts
    the rendezvous store (so it outlives any stage). Returns stage 0's exit status, or the first
    failure's. Once a stage exits non-zero the others have `grace_s` to follow (their watchdogs see
    the posted failure within a heartbeat); then the stragglers (e.g. a stopped process) are killed."""
    import torch.multiprocessing as mp
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_local_entry, args=(r, stages, store.port, fn, args)) for r in range(stages)]
    for p in procs:
        p.start()
    deadline, killed = None, set()
    try:
        while any(p.exitcode is None for p in procs):
            codes = [p.exitcode for p in procs]
            if deadline is None and any(c not in (None, 0) for c in codes):
                deadline = time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                for r, p in enumerate(procs):
                    if p.exitcode is None:
                        p.kill()
                        killed.add(r)
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            p.kill()
        return 130
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if codes[0] is not None and codes[0] < 0:
        if 0 not in killed:  # stage 0 killed by a signal from outside: nobody printed why
            print(f"mtp: error: pipeline: stage 0 was killed by signal {-codes[0]}", file=sys.stderr)
        return 1
    if codes[0]:
        return codes[0]
    return next((c for c in codes if c and c > 0), 1 if any(codes) else 0)


# ---------------------------------------------------------------------------------------------
# the command: `mtp pipeline` (launches local stages) and `python -m mtp.pipeline.stages` (under torchrun)

def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--link-delay-ms", type=float, default=0.0,
                   help="delay every inter-stage message by this many ms (P messages per pass)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="a stage silent this long (dead, hung) fails the run with an error naming it")
    p.add_argument("--backend", default="auto", help="torch.distributed backend: auto (gloo on CPU, nccl on CUDA)")


def _add_common(p: argparse.ArgumentParser) -> None:
    from mtp.cli.generate import add_model_args, add_sampling_args
    p.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    add_model_args(p)
    add_sampling_args(p)
    add_pipeline_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--show-chunks", action="store_true", help="colour each forward pass's tokens")


def add_cli(sub) -> None:
    p = sub.add_parser("pipeline", help="decode across P pipeline stages (local processes) on torch.distributed",
                       description="Split the model's layers over P local processes linked by torch.distributed "
                                   "and decode one prompt; across machines run `torchrun ... -m mtp.pipeline.stages` "
                                   "with the same options.")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages = local processes (default 2)")
    _add_common(p)
    p.add_argument("--predict", metavar="SPEC",
                   help="print the cost model's prediction for a cluster instead of running, e.g. "
                        "stages=8,latency_ms=0.5,pass_ms=40,tokens_per_pass=3[,block_cost=1.1,"
                        "bandwidth_gbps=10,dim=4096,vocab=128256,dtype_bytes=2]")
    p.set_defaults(func=run)


def config_from_args(args) -> PipelineConfig:
    if args.link_delay_ms < 0:
        raise ValueError("--link-delay-ms must be >= 0")
    if args.timeout_s <= 0:
        raise ValueError("--timeout-s must be > 0")
    return PipelineConfig(link_delay_ms=args.link_delay_ms, timeout_s=args.timeout_s, backend=args.backend)


def run(args) -> int:
    """`mtp pipeline`: validate here, then launch the stages (stage 0 prints the result)."""
    if args.predict:
        print_prediction(args.predict)
        return 0
    from mtp.cli.generate import read_prompt
    from mtp.core.strategy import Strategy
    Strategy.parse(args.strategy)
    config_from_args(args)
    if args.stages < 1:
        raise ValueError("--stages must be >= 1")
    args.prompt = read_prompt(args)
    return launch_local(args.stages, _cli_stage, (args,))


def _cli_stage(rank: int, world: int, args) -> int:
    from mtp.cli import UserError
    from mtp.core.engine import Engine
    from mtp.cli.generate import engine_config
    if not args.threads:  # stages on one machine share its cores; oversubscribed OpenMP threads crawl
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        args.threads = max(1, (os.cpu_count() or 1) // local)
    try:
        engine = Engine.load(engine_config(args))  # every stage loads the model and keeps its slice
        run_stage(rank, world, engine.model, config_from_args(args),
                  lambda pipe: _cli_generate(engine, pipe, args, world))
    except (UserError, ValueError, FileNotFoundError, KeyError) as e:
        if rank == 0:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"mtp: error: {msg}", file=sys.stderr, flush=True)
        return 2
    return 0


def _cli_generate(engine, pipe: PipelineModel, args, world: int) -> None:
    engine.model = pipe  # Engine.generate -> decode.stream -> decode_step(pipe, ...)
    result = engine.generate(args.prompt, args.strategy, engine.sampling(args), chat=args.chat)
    s = result.summary
    if args.json:
        print(json.dumps({**result.to_json(), "stages": world, "link_delay_ms": args.link_delay_ms}), flush=True)
        return
    print(engine.render_chunks(result) if args.show_chunks else result.text, flush=True)
    print(f"[{result.strategy}] {len(result.token_ids)} tokens, {s['forward_passes']} passes, "
          f"{s['tokens_per_forward']:.2f} tokens/forward, {s['tokens_per_s']:.1f} tokens/s, "
          f"{world} stages, link delay {args.link_delay_ms:g} ms, finish={result.finish_reason}",
          file=sys.stderr, flush=True)


def print_prediction(spec: str) -> None:
    from mtp.core.costmodel import parse_cluster, predict_cluster
    cluster = parse_cluster(spec)
    print(predict_cluster(**cluster)["text"])


def main(argv: list[str] | None = None) -> int:
    """`python -m mtp.pipeline.stages` under torchrun: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the env."""
    p = argparse.ArgumentParser(prog="python -m mtp.pipeline.stages",
                                description="One pipeline stage; start one per node with torchrun.")
    _add_common(p)
    args = p.parse_args(argv)
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError:
        print("mtp: error: run under torchrun (RANK and WORLD_SIZE unset), or use `mtp pipeline --stages P`",
              file=sys.stderr)
        return 2
    try:
        from mtp.core.strategy import Strategy
        Strategy.parse(args.strategy)
        config_from_args(args)
        if rank == 0:
            from mtp.cli.generate import read_prompt
            args.prompt = read_prompt(args)
    except ValueError as e:
        print(f"mtp: error: {e}", file=sys.stderr)
        return 2
    try:
        return _cli_stage(rank, world, args)
    except PipelineError as e:
        if e.first or rank == 0:
            print(f"mtp: error: pipeline: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
