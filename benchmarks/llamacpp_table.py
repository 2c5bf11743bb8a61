"""The llama.cpp table from one `mtp bench` run with llama-server peers: per target type, plain llama-server
against the same server with our EAGLE-3 drafter (and n-gram drafts), measured in the same interleaved run.

    python benchmarks/llamacpp_table.py BENCH_OUT          # prints a Markdown table

Reads BENCH_OUT/results.jsonl and outputs.jsonl. A row's target type is its export folder's name
(`export-f32`, `export-q4_1-d1`, ...; `-dN`: N drafts per step). "same as plain" compares each prompt's text
with the plain server's on the same target; "same as ntp" with mtp's own `ntp` row.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def folder(name: str) -> str:
    _, _, arg = name.partition(":")
    return Path(arg).name.removeprefix("export-") if arg else "engine's gguf"


def main(out: str) -> int:
    out = Path(out)
    recs = {r["strategy"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    texts: dict[str, dict[int, str]] = defaultdict(dict)
    for line in (out / "outputs.jsonl").read_text().splitlines():
        o = json.loads(line)
        texts[o["strategy"]][o["prompt_index"]] = o["text"]
    plain = {folder(n): n for n in recs if n.startswith("llamacpp-server:")}
    print("| target | row | drafts/step | tokens/s | × plain | tokens/pass | same as plain | same as `ntp` |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in recs.items():
        if not name.startswith("llamacpp-server"):
            continue
        kind = folder(name)
        base = plain.get(kind.split("-d")[0])
        if base is None or r.get("tokens_per_s") is None:
            continue
        ratio = r["tokens_per_s"] / recs[base]["tokens_per_s"]
        same = sum(texts[name][j] == texts[base].get(j) for j in texts[name])
        ntp = sum(texts[name][j] == texts["ntp"].get(j) for j in texts[name])
        row = name.split(":")[0].removeprefix("llamacpp-server").lstrip("-") or "plain"
        drafts = (r.get("params") or {}).get("spec_draft_n_max", "—")
        tpp = r.get("tokens_per_forward")
        print(
            f"| {kind.split('-d')[0]} | {row} | {drafts} | {r['tokens_per_s']:.1f} | {ratio:.2f} | "
            f"{'—' if tpp is None else f'{tpp:.2f}'} | {same}/{len(texts[name])} | {ntp}/{len(texts[name])} |"
        )
    ntp = recs.get("ntp")
    if ntp:
        print(f"\nmtp `ntp` (fp32, this run): {ntp['tokens_per_s']:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
