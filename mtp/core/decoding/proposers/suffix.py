"""Suffix proposer: continue the context the way the model's own earlier answers continued it.

A datastore is the flat token stream of many answers (an `mtp data` folder's responses, each ended by a
separator) with, for every n-gram length n in 1..MAX_NGRAM, the sorted 64-bit hashes of every n-gram
and where each occurs. Proposing (SuffixDecoding's and REST's idea): find the longest suffix of the
context (up to MAX_NGRAM tokens) that occurs in the datastore or earlier in the context itself, gather
what followed up to MAX_MATCHES of its occurrences, and return the most frequent continuations as a
token tree (a node's confidence is the share of occurrences that pass through it). A lookup is a few
binary searches and a small trie: well under a millisecond per pass.

Saved as a directory (`datastore.safetensors`: the token stream; `config.json`: format, the base
weights' hash and vocabulary size it was made for, the shards it came from); the index is rebuilt at
load (a sort, ~1 s for 4 M tokens). A datastore of another model is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mtp.core.decoding.proposers.base import DraftRequest, Guesses, Proposer
from mtp.core.runtime.artifacts import base_hash, has_format, load_safetensors, read_config, read_json, write_dir_atomic

FORMAT = "mtp-datastore"
WEIGHTS, CONFIG = "datastore.safetensors", "config.json"
MAX_NGRAM = 4
MAX_MATCHES = 16
SEP = -1  # between answers: no n-gram or continuation crosses it
_MUL = np.uint64(0x9E3779B97F4A7C15)
is_datastore = has_format(FORMAT, {WEIGHTS, CONFIG})  # a folder `save` may replace (nothing else in it)


def _hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """[len - n + 1] hash of the n-gram starting at each position (wrapping uint64 arithmetic)."""
    h = np.zeros(len(tokens) - n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * _MUL + tokens[j : len(tokens) - n + 1 + j].astype(np.uint64) + np.uint64(1)
    return h


class Datastore:
    """The token stream of many answers with an n-gram index; `continuations` is the query."""

    def __init__(self, tokens: np.ndarray, meta: dict | None = None):
        self.tokens = np.asarray(tokens, dtype=np.int64)  # [L], SEP between answers
        self.meta = meta or {}
        self.index = []  # per n: (sorted hashes, start positions in that order)
        for n in range(1, MAX_NGRAM + 1):
            if len(self.tokens) < n:
                self.index.append((np.zeros(0, np.uint64), np.zeros(0, np.int64)))
                continue
            h = _hashes(self.tokens, n)
            starts = np.arange(len(h))
            windows = np.lib.stride_tricks.sliding_window_view(self.tokens, n)
            ok = (windows != SEP).all(-1)  # no n-gram spans a separator
            h, starts = h[ok], starts[ok]
            order = np.argsort(h, kind="stable")
            self.index.append((h[order], starts[order]))

    @classmethod
    def from_answers(cls, answers: list[list[int]], meta: dict | None = None) -> "Datastore":
        flat: list[int] = []
        for a in answers:
            flat.extend(a)
            flat.append(SEP)
        return cls(np.array(flat, dtype=np.int64), meta)

    def __len__(self) -> int:
        return int((self.tokens != SEP).sum())

    def continuations(self, suffix: list[int], depth: int) -> tuple[int, list[list[int]]]:
        """(the longest n <= MAX_NGRAM such that suffix[-n:] occurs, up to MAX_MATCHES continuations of
        it, each at most `depth` tokens, latest occurrences first); (0, []) when nothing matches."""
        for n in range(min(MAX_NGRAM, len(suffix)), 0, -1):
            key = _hashes(np.array(suffix[-n:], dtype=np.int64), n)[0]
            hs, starts = self.index[n - 1]
            lo, hi = np.searchsorted(hs, key, "left"), np.searchsorted(hs, key, "right")
            if hi == lo:
                continue
            out = []
            for s in starts[max(lo, hi - 4 * MAX_MATCHES) : hi][::-1]:
                if self.tokens[s : s + n].tolist() != suffix[-n:]:
                    continue  # a hash collision
                cont = self.tokens[s + n : s + n + depth].tolist()
                if SEP in cont:
                    cont = cont[: cont.index(SEP)]
                if cont:
                    out.append(cont)
                if len(out) >= MAX_MATCHES:
                    break
            if out:
                return n, out
        return 0, []

    def save(self, path, model=None, meta: dict | None = None) -> None:
        cfg = {"format": FORMAT, "version": 1, "tokens": len(self), "max_ngram": MAX_NGRAM, **(meta or self.meta)}
        if model is not None:
            cfg.update(base_hash=base_hash(model), vocab_size=model.config.vocab_size)
        write_dir_atomic(
            Path(path),
            {WEIGHTS: {"tokens": torch.from_numpy(self.tokens.astype(np.int32))}, CONFIG: cfg},
            kind=is_datastore,
        )  # an earlier datastore is rebuilt

    @classmethod
    def load(cls, path, model=None) -> "Datastore":
        path = Path(path)
        if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
            raise ValueError(
                f"{path}: not a datastore (needs {CONFIG} and {WEIGHTS}); build one with `mtp datastore build`"
            )
        cfg = read_config(path, FORMAT, "datastore")
        if model is not None and cfg.get("base_hash") not in (None, base_hash(model)):
            raise ValueError(f"{path}: this datastore was made for another model (base weights hash differs)")
        tokens = load_safetensors(path / WEIGHTS).get("tokens")
        if tokens is None or tokens.dim() != 1:
            raise ValueError(f"{path / WEIGHTS}: no 1-D 'tokens' tensor")
        if tokens.dtype not in (torch.int32, torch.int64):  # bf16 has no numpy form; floats are no ids
            raise ValueError(f"{path / WEIGHTS}: 'tokens' must hold int32 token ids, not {tokens.dtype}")
        tokens = tokens.numpy().astype(np.int64)
        ids = tokens[tokens != SEP]
        if not len(ids):
            raise ValueError(f"{path}: the datastore is empty")
        vocab = model.config.vocab_size if model is not None else cfg.get("vocab_size")
        if isinstance(vocab, int) and (ids.max() >= vocab or ids.min() < 0):
            raise ValueError(f"{path}: token ids outside the model's vocabulary (another tokenizer?)")
        return cls(tokens, cfg)


def context_continuations(ctx: list[int], depth: int) -> tuple[int, list[list[int]]]:
    """What followed earlier occurrences of the context's longest repeated suffix (n <= MAX_NGRAM) in
    the context itself, latest first: (n, continuations)."""
    arr = np.asarray(ctx, dtype=np.int64)
    ends = np.flatnonzero(arr[:-1] == arr[-1])  # earlier positions holding the last token
    best, n = ends, 1
    for j in range(1, MAX_NGRAM):  # extend the match backwards while some occurrence still agrees
        ends_j = best[best >= j]
        ends_j = ends_j[arr[ends_j - j] == arr[-1 - j]] if len(arr) > j else ends_j[:0]
        if not len(ends_j):
            break
        best, n = ends_j, j + 1
    out = [ctx[e + 1 : e + 1 + depth] for e in best[::-1][:MAX_MATCHES].tolist()]
    out = [c for c in out if c]
    return (n, out) if out else (0, [])


def frequent_tree(cands: list[list[int]], budget: int) -> tuple[list[int], list[int], list[float]]:
    """The `budget` trie nodes through which most candidates pass (a parent always before its
    children: a node never passes more candidates than its parent): (tokens, parents, shares)."""
    nodes: list[list] = []  # [token, parent, count, depth]
    child: dict[tuple[int, int], int] = {}
    for c in cands:
        at = -1
        for t in c:
            j = child.get((at, t))
            if j is None:
                j = child[(at, t)] = len(nodes)
                nodes.append([t, at, 0, 1 if at < 0 else nodes[at][3] + 1])
            nodes[j][2] += 1
            at = j
    keep = sorted(range(len(nodes)), key=lambda j: (-nodes[j][2], nodes[j][3], j))[:budget]
    keep.sort(key=lambda j: (nodes[j][3], j))  # parents first
    index: dict[int, int] = {}
    tokens, parents, shares = [], [], []
    for j in keep:
        t, par, count, _ = nodes[j]
        if par >= 0 and par not in index:
            continue  # its parent fell outside the budget
        index[j] = len(tokens)
        tokens.append(t)
        parents.append(index[par] if par >= 0 else -1)
        shares.append(count / len(cands))
    return tokens, parents, shares


class SuffixProposer(Proposer):
    """Drafts from the longest suffix match in the datastore and in the context so far."""

    name = "suffix"
    has_confidence = True

    def __init__(self, store: Datastore | None, depth: int = 8):
        self.store, self.depth = store, depth

    def _candidates(self, ctx: list[int], depth: int) -> list[list[int]]:
        n_store, cands = self.store.continuations(ctx, depth) if self.store is not None else (0, [])
        n_ctx, from_ctx = context_continuations(ctx, depth)
        # the context's own repeats first when they match at least as long a suffix
        return (from_ctx + cands) if n_ctx >= n_store else (cands + from_ctx)

    def propose(self, request: DraftRequest) -> Guesses:
        """A tree: the n trie nodes most candidates pass through; a chain: the most frequent root path."""
        ctx, n = request.view.context, request.n
        if request.tree:
            t, p, c = frequent_tree(self._candidates(ctx, min(n, self.depth)), n)
            return Guesses(t, c, None, p)
        cands = self._candidates(ctx, n)
        t, p, c = frequent_tree(cands, len(cands) * n)  # the whole trie
        chain: list[int] = []
        while len(chain) < n:  # the most frequent root path: at each depth the most travelled child
            kids = [j for j in range(len(t)) if p[j] == (chain[-1] if chain else -1)]
            if not kids:
                break
            chain.append(max(kids, key=lambda j: (c[j], -j)))
        return Guesses([t[j] for j in chain], [c[j] for j in chain], None)


def build_datastore(answers: list[list[int]], model=None, meta: dict | None = None, out=None) -> Datastore:
    store = Datastore.from_answers(answers, meta)
    if len(store) == 0:
        raise ValueError("no answers to build a datastore from")
    if model is not None:  # another tokenizer's answers would make a datastore no load accepts
        vocab = model.config.vocab_size
        bad = next((t for a in answers for t in a if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"token id {bad} of the answers is outside the model's vocabulary (0..{vocab - 1}): "
                "answers of another tokenizer?"
            )
    if out is not None:
        store.save(out, model, meta)
    return store


def load_suffix_proposer(model, path) -> SuffixProposer:
    return SuffixProposer(Datastore.load(path, model))


def describe(path) -> str:
    cfg = read_json(Path(path) / CONFIG, "datastore config")
    return f"{cfg.get('tokens', 0):,} tokens from {', '.join(cfg.get('shards', [])) or 'answers'}"
