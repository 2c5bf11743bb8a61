"""The files of `mtp bench --out`: the folder checked before any work (`check_out`: new, empty, or one an
earlier bench wrote, holding MARKER), then results.jsonl (a record per row), outputs.jsonl (a line per
row and prompt), the t(q) profiles with `--profile`, and the pictures and report.html (`mtp.eval.report`)."""

from __future__ import annotations

import json
from pathlib import Path

from mtp.eval import report
from mtp.eval.bench.rows import BenchResult

MARKER = "mtp-bench.json"  # written into every output folder: what a later run may replace


def check_out(out: Path) -> None:
    """Before any work: `--out` must be a new or empty folder, or one an earlier `mtp bench` wrote
    (it holds MARKER); anything else is refused, so no user file is overwritten."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise ValueError(f"--out {out} holds files mtp bench did not write; choose a new or empty folder")


def write_outputs(res: BenchResult, out: Path, engine=None, command: str = "", chunk_examples: int = 2) -> None:
    check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(json.dumps({"format": "mtp-bench", "command": command}) + "\n")
    with open(out / "results.jsonl", "w") as f:
        for rec in res.records:
            f.write(json.dumps(rec) + "\n")
    with open(out / "outputs.jsonl", "w") as f:
        for row in res.rows:
            for j, run in sorted(row.runs.items()):
                f.write(
                    json.dumps(
                        {
                            "strategy": row.name,
                            "prompt_index": j,
                            "text": run.text,
                            "chunks": run.chunks,
                            "walls": run.walls,
                        }
                    )
                    + "\n"
                )
    if res.cost is not None:
        res.cost.save(out / "profile.json")
    if res.mask_cost is not None:  # t(q) of passes with mask rows (the adapter path)
        res.mask_cost.save(out / "profile-masks.json")
    report.pareto_png(res, out / "pareto.png")
    report.acceptance_png(res, out / "acceptance.png")
    report.write_html(res, out / "report.html", engine, command, chunk_examples)
