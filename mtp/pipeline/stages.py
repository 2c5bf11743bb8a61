"""Pipeline-parallel decoding on torch.distributed: each process ("stage") holds a contiguous slice
of the layers and the matching slice of the KV cache.

Why: a model too large for one machine is split across servers, and every forward pass then pays
the link latency once per stage boundary. A multi-token pass saves whole passes, hence round trips,
so MTP's value grows with the latency. `--link-delay-ms` dials that latency in.

One forward pass through P stages (any batch the decoding loop builds):
  stage 0    embeddings + its layers    --[header, positions/slots/out rows, hidden ⊕ gate (, layout)]-->  stage 1
  stage i    its layers                 --[same message, new hidden]----------------------->  stage i+1
  stage P-1  its layers + norm + lm_head --[header, logits (⊕ hidden)]--------------------->  stage 0
so a pass crosses P links. Stage 0 runs the one decoding loop (`mtp.core.decoding.decode.decode_step`) unchanged,
with `PipelineModel` standing in for the Transformer; proposing, accepting and committing happen on
stage 0 only. The other stages need no rollback message: every block carries its positions, and a
query at position p reads cache slots 0..p only, so the KV entries of rejected drafts and of masks
are overwritten by the next block that reaches those positions, on every stage, before anything
reads them (tests/test_pipeline.py checks every stage's cache against a fresh prefill). A `verify`
block with branched mask groups or a token tree (mtp.core.decoding.decode) also carries its layout: the cache slot
of each row and the [B, T, S] attention mask (a few KB), since its RoPE positions are not its slots.
A tree's accepted path is moved into contiguous slots on stage 0 at once (`StageZeroCache.compact`)
and on every other stage just before its next pass: the moves ride along with that pass's message
(or the shutdown), [row, start, n, src_0..src_n-1] per move, so a tree costs no extra round trip.

Faults: every wait is bounded (`timeout_s`); a watchdog thread per stage beats a heartbeat into the
rendezvous store and watches the others'; the first stage to notice a failure posts one line naming
the stage at fault there, and every stage exits non-zero with it.

Run: `mtp pipeline --stages P PROMPT ...` (P local processes), or across machines
`torchrun --nnodes P --nproc-per-node 1 --node-rank R --master-addr HOST --master-port PORT \\
 -m mtp.pipeline.stages PROMPT --strategy conf_adapt:0.9 ...` (same options as `mtp generate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtp.core.runtime.artifacts import base_hash
from mtp.core.runtime.cache import KVCache
from mtp.core.runtime.model import Transformer
from mtp.pipeline.transport import (
    F_CACHE,
    F_GATE,
    F_HIDDEN,
    F_LAYOUT,
    F_MOVES,
    F_OUT,
    F_SLOTS,
    HEADER,
    OP_FORWARD,
    OP_RESULT,
    OP_SHUTDOWN,
    Link,
    PipelineConfig,
    PipelineError,
    init_group,
    message_header,
    store_address,
)
from mtp.pipeline.watchdog import Watchdog


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


class StageZeroCache(KVCache):
    """Stage 0's cache (its own layers' KV): a tree's compaction happens here and is queued in
    `moves` for the other stages, which apply it before their next pass."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.moves: list[int] = []  # [row, start, n, src...] per move not yet sent

    def compact(self, row: int, start: int, src: list[int]) -> None:
        super().compact(row, start, src)
        if src and src != list(range(len(src))):
            self.moves += [row, start, len(src), *src]


def apply_moves(cache: KVCache, moves: list[int]) -> None:
    """Replay stage 0's compactions ([row, start, n, src_0..src_n-1] each) on this stage's cache."""
    i = 0
    while i < len(moves):
        row, start, n = moves[i : i + 3]
        cache.compact(row, start, moves[i + 3 : i + 3 + n])
        i += 3 + n


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
        return StageZeroCache(len(self.model.layers), rows, cfg.n_kv_heads, capacity, cfg.head_dim, w.dtype, w.device)

    def __call__(
        self,
        tokens,
        positions=None,
        cache=None,
        slots=None,
        attn_mask=None,
        out_index=None,
        return_hidden=False,
        cache_positions=None,
    ):
        # tokens, positions: [B, T]; slots: [B]; out_index: [B, N]; with a branched layout (mtp.core.decoding.decode)
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
            if hasattr(cache, "moves"):
                cache.moves.clear()  # moves on a cache the other stages never held are moot
        x = m.forward_layers(x, positions, cache, slots, attn_mask, gate, cache_positions)
        if self.world == 1:
            return m.forward_head(x, out_index, return_hidden)
        N = out_index.shape[1] if out_index is not None else T
        flags = (
            (F_CACHE if cache is not None else 0)
            | (F_SLOTS if slots is not None else 0)
            | (F_OUT if out_index is not None else 0)
            | (F_GATE if gate is not None else 0)
            | (F_HIDDEN if return_hidden else 0)
            | (F_LAYOUT if attn_mask is not None else 0)
        )
        rows, cap = (cache.rows, cache.capacity) if cache is not None else (0, 0)
        S = attn_mask.shape[-1] if attn_mask is not None else 0
        moves = self._take_moves(cache)
        flags |= F_MOVES if moves else 0
        hdr = message_header(
            OP_FORWARD, B, T, N, flags, self._epoch, rows, cap, round(self.link.delay_s * 1e6), S, len(moves)
        )
        ints = (
            [positions.reshape(-1)]
            + [t.reshape(-1) for t in (slots, out_index, cache_positions) if t is not None]
            + ([torch.tensor(moves)] if moves else [])
        )
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

    def _take_moves(self, cache) -> list[int]:
        """The compactions of the cache the other stages hold, not yet sent to them (then cleared)."""
        if cache is None or cache is not self._cache or not getattr(cache, "moves", None):
            return []
        moves, cache.moves = cache.moves, []
        return moves

    def close(self) -> None:
        """Shut the other stages down (the message goes round the ring and comes back as the ack);
        the last pass's moves go with it, so every stage's cache ends as stage 0's."""
        if self.world == 1 or self.link.broken:
            return
        moves = self._take_moves(self._cache)
        hdr = message_header(OP_SHUTDOWN, 0, 0, 0, F_MOVES if moves else 0, self._epoch, 0, 0, 0, 0, len(moves))
        self.link.send(1, [hdr] + ([torch.tensor(moves, dtype=torch.long)] if moves else []))
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
        op, B, T, N, flags, ep, rows, cap, delay_us, S, n_moves = hdr[:11].tolist()
        if op == OP_SHUTDOWN:
            moves = link.recv(prev, (n_moves,), torch.long) if flags & F_MOVES else None
            if moves is not None and cache is not None and ep == epoch:
                apply_moves(cache, moves.tolist())
            if watchdog is not None:
                watchdog.stop()
            link.send(0 if last else nxt, [hdr] + ([moves] if moves is not None and not last else []))
            return {"cache": cache, "passes": passes}
        link.delay_s = delay_us / 1e6  # stage 0 sets the delay of the whole ring
        msg = _receive(link, prev, hdr, cfg.dim, dtype, dev)
        if flags & F_CACHE and ep != epoch:
            cache = KVCache(len(model.layers), rows, cfg.n_kv_heads, cap, cfg.head_dim, dtype, dev)
            epoch = ep
        if flags & F_MOVES:  # stage 0's tree compactions since the last pass, before this pass reads them
            apply_moves(cache, msg.rest.tolist())
        _forward(model, link, hdr, msg, cache if flags & F_CACHE else None, nxt if not last else None)
        passes += 1


@dataclass
class _Pass:
    """One pass's message to a stage after the first, received and unpacked (on the stage's device)."""

    flags: int
    ints: torch.Tensor  # every integer as received (passed on to the next stage)
    mask_u8: torch.Tensor | None  # the attention layout as received, [B, T, S] (with F_LAYOUT)
    x: torch.Tensor  # [B, T, dim]
    gate: torch.Tensor | None  # [B, T, 1]
    positions: torch.Tensor  # [B, T]
    slots: torch.Tensor | None
    out_index: torch.Tensor | None  # [B, N]
    cache_positions: torch.Tensor | None  # [B, T]
    attn_mask: torch.Tensor | None  # [B, T, S], bool
    rest: torch.Tensor  # the integers after those: stage 0's cache moves (with F_MOVES)


def _receive(link: Link, prev: int, hdr: torch.Tensor, dim: int, dtype, dev) -> _Pass:
    """The rest of the pass whose header is `hdr`: its integers, its activations (and gate), its layout."""
    _, B, T, N, flags, _, _, _, _, S, n_moves = hdr[:11].tolist()
    layout = bool(flags & F_LAYOUT)
    n_ints = (
        B * T
        + (B if flags & F_SLOTS else 0)
        + (B * N if flags & F_OUT else 0)
        + (B * T if layout else 0)
        + (n_moves if flags & F_MOVES else 0)
    )
    ints = link.recv(prev, (n_ints,), torch.long)
    has_gate = bool(flags & F_GATE)
    floats = link.recv(prev, (B, T, dim + has_gate), dtype).to(dev)
    mask_u8 = link.recv(prev, (B, T, S), torch.uint8) if layout else None
    positions = ints[: B * T].view(B, T).to(dev)
    rest = ints[B * T :]
    slots = out_index = cache_positions = attn_mask = None
    if flags & F_SLOTS:
        slots, rest = rest[:B].to(dev), rest[B:]
    if flags & F_OUT:
        out_index, rest = rest[: B * N].view(B, N).to(dev), rest[B * N :]
    if layout:
        cache_positions, rest = rest[: B * T].view(B, T).to(dev), rest[B * T :]
        attn_mask = mask_u8.to(dev, torch.bool)
    x = floats[..., :dim]  # [B, T, dim]
    gate = floats[..., dim:] if has_gate else None  # [B, T, 1]
    return _Pass(flags, ints, mask_u8, x, gate, positions, slots, out_index, cache_positions, attn_mask, rest)


def _forward(model: Transformer, link: Link, hdr: torch.Tensor, msg: _Pass, cache, nxt: int | None) -> None:
    """This stage's layers on the pass; then its activations on to stage `nxt`, or for the last stage
    (`nxt` None) the logits (and hidden states when asked) back to stage 0."""
    with torch.inference_mode():
        x = model.forward_layers(msg.x, msg.positions, cache, msg.slots, msg.attn_mask, msg.gate, msg.cache_positions)
        if nxt is None:
            out = model.forward_head(x, msg.out_index, bool(msg.flags & F_HIDDEN))
            logits, hidden = out if msg.flags & F_HIDDEN else (out, None)
            payload = logits if hidden is None else torch.cat([logits, hidden.to(logits.dtype)], -1)
            link.send(
                0,
                [
                    message_header(OP_RESULT, msg.x.shape[0], logits.shape[1], logits.shape[2], hidden is not None),
                    payload,
                ],
            )
        else:
            link.send(
                nxt,
                [hdr, msg.ints, x if msg.gate is None else torch.cat([x, msg.gate], -1)]
                + ([] if msg.mask_u8 is None else [msg.mask_u8]),
            )


def run_stage(rank: int, world: int, model: Transformer, config: PipelineConfig, stage0_fn=None):
    """Join the pipeline as stage `rank` of `world`, keeping only this stage's slice of `model`
    (pruned in place). Stage 0 runs `stage0_fn(pipeline_model)` and returns its result; the other
    stages serve passes until stage 0 is done and return their final state. The whole model's
    fingerprint (`base_hash`) is taken before pruning and carried by the pipeline model, so assets
    loaded against it at stage 0 (heads, a suffix datastore) check the full weights, not the slice."""
    whole = base_hash(model)
    keep_slice(model, rank, world)
    model.base_weights_hash = whole
    dev = next(model.parameters()).device
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" and dist.is_nccl_available() else "gloo"
    try:
        init_group(rank, world, config, backend)
        watchdog = Watchdog(rank, world, config).start()
    except (RuntimeError, dist.DistError) as e:  # unreachable store, a stage that never came up
        raise PipelineError(
            f"stage {rank} could not join the pipeline at {':'.join(map(str, store_address()))}: "
            f"{str(e).strip().splitlines()[0][:300]}"
        ) from None
    link = Link(rank, world, config, watchdog, dev if backend == "nccl" else torch.device("cpu"))
    clean = False
    try:
        if rank == 0:
            pipe = PipelineModel(model, link)
            pipe.base_weights_hash = whole
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
