"""`mtp shadow-report`: summarise a `mtp serve --shadow-rate` log per strategy."""

from __future__ import annotations

import json

from mtp.serving.shadow import format_summary, read_log, summarize


def add_parser(sub) -> None:
    p = sub.add_parser("shadow-report", help="summarise a `mtp serve --shadow-rate` log")
    p.add_argument("log", help="the shadow JSONL log written by mtp serve")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    records = read_log(args.log)
    if not records:
        raise ValueError(f"shadow log {args.log} has no records yet")
    summary = summarize(records)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(format_summary(summary))
    return 0
