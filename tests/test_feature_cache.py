"""The trunk-feature cache in blocks: joined blocks equal one extraction over the whole list (heads and
EAGLE-3), an extraction killed mid-way keeps its finished blocks, a grown list recomputes only its new
examples, and a missing block is one error naming it."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

from mtp.core.runtime.artifacts import ArtifactError
from mtp.training import eagle3_train as E
from mtp.training import feature_cache
from mtp.training import heads_train as H
from mtp.training.data import Example


def examples(n=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        Example(
            torch.randint(0, 97, (int(p),), generator=g).tolist(), torch.randint(0, 97, (int(r),), generator=g).tolist()
        )
        for p, r in torch.randint(2, 15, (n, 2), generator=g).tolist()
    ]


class Counting:
    """Wraps an extractor: counts the examples it was asked for; fails on call number `fail_on`."""

    def __init__(self, fn, fail_on=None):
        self.fn, self.fail_on, self.calls, self.seen = fn, fail_on, 0, 0

    def __call__(self, part, progress=None):
        self.calls += 1
        if self.calls == self.fail_on:
            raise KeyboardInterrupt  # as if killed while computing this block
        self.seen += len(part)
        return self.fn(part, progress=progress)


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    a = {k: v[0 : len(v)] if isinstance(v, feature_cache.BlockRows) else v for k, v in a.items()}
    b = {k: v[0 : len(v)] if isinstance(v, feature_cache.BlockRows) else v for k, v in b.items()}
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-4), k  # batches pad differently


def test_heads_blocks_join_to_one_extraction(tmp_path):
    model, exs = tiny_model(), examples()
    whole = H.extract_features(model, exs, batch_size=4)
    extract = Counting(lambda part, progress: H.extract_features(model, part, 4, progress))
    index = feature_cache.cached_blocks(tmp_path, "heads", exs, extract, block=4)
    joined = feature_cache.join_blocks(index, example_fields=("example",), dtypes={"agree": torch.bool})
    assert extract.calls == 3 and extract.seen == 11  # blocks of 4, 4, 3
    assert_same(joined, whole)
    assert joined["example"].tolist() == whole["example"].tolist()


def test_eagle3_blocks_join_to_one_extraction(tmp_path):
    model, exs = tiny_model(), examples()
    whole = E.extract_features(model, exs, (0, 1, 2), max_len=20, dtype=torch.float32)
    extract = lambda part, progress: E.extract_features(model, part, (0, 1, 2), 20, torch.float32, progress=progress)
    index = feature_cache.cached_blocks(tmp_path, "eagle3", exs, extract, block=3)
    joined = feature_cache.join_blocks(index, offset_fields=("offsets",))
    assert_same(joined, whole)
    assert joined["offsets"].tolist() == whole["offsets"].tolist()
    e = 7  # example 7 (third block) reads its own rows back
    a, b = int(joined["offsets"][e]), int(joined["offsets"][e + 1])
    seq = (exs[e].prompt_ids + exs[e].response_ids)[:20]
    assert joined["tokens"][a:b].tolist() == seq


def test_rows_left_on_disk_read_back_like_the_joined_tensor(tmp_path):
    model, exs = tiny_model(), examples()
    extract = lambda part, progress: E.extract_features(model, part, (0, 1, 2), 20, torch.bfloat16, progress=progress)
    index = feature_cache.cached_blocks(tmp_path, "eagle3", exs, extract, block=3)
    loaded = feature_cache.join_blocks(index, offset_fields=("offsets",))
    lazy = feature_cache.join_blocks(index, offset_fields=("offsets",), on_disk=("aux",))
    rows = lazy["aux"]
    assert isinstance(rows, feature_cache.BlockRows) and not isinstance(loaded["aux"], feature_cache.BlockRows)
    assert rows.shape == loaded["aux"].shape and rows.dtype == torch.bfloat16 and len(rows) == len(loaded["aux"])
    assert torch.equal(lazy["tokens"], loaded["tokens"]) and torch.equal(lazy["offsets"], loaded["offsets"])
    off = loaded["offsets"].tolist()
    for e in range(len(exs)):  # every example's rows, from whichever block holds them
        assert torch.equal(rows[off[e] : off[e + 1]], loaded["aux"][off[e] : off[e + 1]]), e
    a, b = off[2] - 3, off[8] + 2  # a range across four blocks, and the edges
    assert torch.equal(rows[a:b], loaded["aux"][a:b])
    assert torch.equal(rows[0 : len(rows)], loaded["aux"]) and rows[5:5].shape == (0, rows.shape[1])
    with pytest.raises(TypeError, match="contiguous"):
        rows[0:10:2]
    with pytest.raises(ArtifactError, match="no field"):
        feature_cache.join_blocks(index, offset_fields=("offsets",), on_disk=("hidden",))


def test_killed_extraction_keeps_finished_blocks_and_growth_reuses_them(tmp_path):
    model, exs = tiny_model(), examples(n=10)
    fn = lambda part, progress: H.extract_features(model, part, 4, progress)
    killed = Counting(fn, fail_on=2)
    with pytest.raises(KeyboardInterrupt):
        feature_cache.cached_blocks(tmp_path, "h", exs, killed, block=4)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1 and not list(tmp_path.glob(".*tmp*"))
    again = Counting(fn)
    feature_cache.cached_blocks(tmp_path, "h", exs, again, block=4)
    assert again.seen == 6  # blocks 2 and 3 only
    grown = Counting(fn)
    more = exs + examples(n=5, seed=1)
    index = feature_cache.cached_blocks(tmp_path, "h", more, grown, block=4)
    assert grown.seen == 7  # the old partial block (2 examples) again, then the 5 new ones
    joined = feature_cache.join_blocks(index, example_fields=("example",), dtypes={"agree": torch.bool})
    assert_same(joined, H.extract_features(model, more, 4))
    other = Counting(fn)  # what the features depend on is part of every key
    feature_cache.cached_blocks(tmp_path, "h2", exs, other, block=4)
    assert other.seen == 10


def test_cached_features_round_trip_without_the_trunk(tmp_path):
    model, exs = tiny_model(), examples(n=6)
    feats, index = E.cached_features(model, exs, (0, 1, 2), tmp_path, max_len=16, dtype="float32")

    class NoTrunk:  # a second call must read the cache, never run the trunk
        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, *a, **k):
            raise AssertionError("trunk ran although the features were cached")

    again, index2 = E.cached_features(NoTrunk(), exs, (0, 1, 2), tmp_path, max_len=16, dtype="float32")
    assert index2 == index
    assert_same(again, feats)
    _, index3 = E.cached_features(model, exs, (0, 2), tmp_path, max_len=16, dtype="float32")
    assert index3 != index


def test_missing_block_is_one_error(tmp_path):
    model, exs = tiny_model(), examples(n=6)
    index = feature_cache.cached_blocks(
        tmp_path, "h", exs, lambda part, progress: H.extract_features(model, part), block=4
    )
    next(tmp_path.glob("*.safetensors")).unlink()
    with pytest.raises(ArtifactError, match="missing; rerun"):
        feature_cache.join_blocks(index, example_fields=("example",))
