"""`mtp datastore build`: the suffix proposer's datastore from an `mtp data` folder (core.decoding.proposers.suffix)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from mtp.core.decoding.proposers.suffix import build_datastore, is_datastore
from mtp.core.runtime import loading
from mtp.core.runtime.artifacts import replaceable
from mtp.training import shards
from mtp.training.data import check_examples_for, read_examples


def add_parser(sub) -> None:
    p = sub.add_parser(
        "datastore",
        help="build the suffix proposer's datastore from the model's own answers",
        description="Indexes the answers of an `mtp data` folder (or one of its shards, or a JSONL "
        "of token ids) for `--proposer suffix --datastore DIR`.",
    )
    p.add_argument("action", choices=["build"])
    p.add_argument("--data", required=True, help="an `mtp data` folder, one of its shards, or a JSONL of token ids")
    p.add_argument(
        "--out",
        required=True,
        help="the datastore directory to write: new, empty, or an earlier datastore (replaced atomically)",
    )
    p.add_argument(
        "--model", default=loading.DEFAULT_MODEL, help="the model the answers come from (its hash is recorded)"
    )
    p.set_defaults(func=run)


def run(args) -> int:
    out = Path(args.out)
    # before anything is read or loaded: only a new or empty folder, or an earlier datastore, is replaced
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a datastore; choose a new folder")
    replaceable(out, is_datastore)
    t0 = time.perf_counter()
    examples = read_examples(args.data, args.model)  # an evaluation prompt among them: refused here
    data = Path(args.data)
    meta = {"source": data.name}
    if data.is_dir():
        meta["shards"] = [e["file"] for e in shards.shard_entries(shards.read_manifest(data), "train")]
    elif data.name.endswith(".jsonl.gz"):
        meta["shards"] = [data.name]
    model = loading.load(args.model).model
    check_examples_for(examples, model, data)  # another model's answers: refused here
    store = build_datastore([ex.response_ids for ex in examples], model, meta, out)
    print(
        f"datastore: {len(examples):,} answers, {len(store):,} tokens -> {out} ({time.perf_counter() - t0:.1f} s)",
        file=sys.stderr,
    )
    return 0
