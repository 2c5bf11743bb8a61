"""Load test of `mtp serve`: aggregate tokens/s and latency under concurrent clients, ntp against
MTP strategies in one run, interleaved.

Starts `mtp serve` on loopback (SmolLM2-135M and the shipped adapter by default), drives it with the
official `openai` client over the first GSM8K test prompts at each concurrency (default 1, 4, 16),
every strategy at a concurrency before the next concurrency, the strategy order rotated each round
so machine drift spreads evenly. Each cell sends a bounded number of requests (and stops issuing
after --cell-timeout seconds). Afterwards (server stopped, so timings are not disturbed) it decodes
the first --check prompts alone with `Engine.generate` and counts the server outputs that are
identical (temperature 0), in every cell and for those prompts sent once more with `mtp.adaptive:
false` (a capped pass changes what a lossy strategy emits; an uncapped request must match exactly).

    python benchmarks/serve_load.py --data $MTP_DATA_DIR/gsm8k --out results/serve_load

Writes OUT/serve_load.json and OUT/serve_load.md (the table) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mtp.core.decoding import metrics as M
from mtp.eval import gsm8k


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int, log_path: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "mtp.cli",
        "serve",
        "--model",
        args.model,
        "--adapter",
        args.adapter,
        "--proposer",
        args.proposer,
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--max-batch",
        str(max(args.concurrency)),
        "--max-model-len",
        str(args.max_model_len),
        "--max-new-tokens",
        str(args.max_tokens),
        "--log-level",
        "warning",
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if not args.adaptive:
        cmd.append("--no-adaptive")
    elif args.cost_model:
        cmd += ["--cost-model", args.cost_model]
    print("$ " + " ".join(cmd), file=sys.stderr)
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server not ready after {timeout:.0f} s")


def ask(client, prompt: str, strategy: str, max_tokens: int, adaptive: bool = True):
    return client.chat.completions.create(
        model="bench",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"mtp": {"strategy": strategy, "adaptive": adaptive}},
    )


def run_cell(
    client, prompts: list[str], strategy: str, concurrency: int, n_requests: int, max_tokens: int, timeout: float
) -> dict:
    """n_requests requests over `concurrency` client threads; aggregate tokens/s over the cell's wall."""
    deadline = time.perf_counter() + timeout
    results = []

    def one(i: int):
        if time.perf_counter() > deadline:
            return None
        t0 = time.perf_counter()
        r = ask(client, prompts[i % len(prompts)], strategy, max_tokens)
        return {
            "i": i % len(prompts),
            "latency_s": time.perf_counter() - t0,
            "text": r.choices[0].message.content,
            "tokens": r.usage.completion_tokens,
            "mtp": r.model_extra.get("mtp", {}),
        }

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for res in pool.map(one, range(n_requests)):
            if res is not None:
                results.append(res)
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    passes = sum(r["mtp"].get("forward_passes", 0) for r in results)
    return {
        "strategy": strategy,
        "concurrency": concurrency,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": M.tokens_per_s(tokens, wall),
        "latencies": [r["latency_s"] for r in results],
        "tokens_per_forward": tokens / passes if passes else None,
        "capped_passes": sum(r["mtp"].get("capped_passes", 0) for r in results),
        "row_passes": passes,
        "outputs": {r["i"]: r["text"] for r in results},
    }


def merge_cells(cells: list[dict]) -> dict:
    tokens, wall = sum(c["tokens"] for c in cells), sum(c["wall_s"] for c in cells)
    lat = [x for c in cells for x in c["latencies"]]
    passes = sum(c["row_passes"] for c in cells)
    outputs = {}
    for c in cells:
        outputs.update(c["outputs"])
    return {
        "requests": sum(c["requests"] for c in cells),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": M.tokens_per_s(tokens, wall),
        "p50_latency_s": M.percentile(lat, 50),
        "p95_latency_s": M.percentile(lat, 95),
        "tokens_per_forward": tokens / passes if passes else None,
        "capped_passes": sum(c["capped_passes"] for c in cells),
        "row_passes": passes,
        "outputs": outputs,
    }


def uncapped_outputs(client, args, prompts: list[str], strategies: list[str]) -> dict:
    """The first --check prompts per strategy, sent together with `mtp.adaptive: false` (never capped)."""
    n = min(args.check, len(prompts))
    out = {}
    with ThreadPoolExecutor(max(1, n)) as pool:
        for s in strategies:
            rs = pool.map(lambda i, s=s: ask(client, prompts[i], s, args.max_tokens, adaptive=False), range(n))
            out[("uncapped", s)] = {"outputs": {i: r.choices[0].message.content for i, r in enumerate(rs)}}
    return out


def check_identical(args, prompts: list[str], strategies: list[str], table: dict) -> dict:
    """Decode the first --check prompts alone per strategy; count identical server outputs (every cell
    of the table, and the "uncapped" cells of `uncapped_outputs`)."""
    from mtp.core.decoding.sampling import SamplingParams
    from mtp.core.engine import Engine, EngineConfig

    engine = Engine.load(
        EngineConfig(model=args.model, adapter=args.adapter, proposer=args.proposer, threads=args.threads)
    )
    out = {}
    for s in strategies:
        refs = {
            i: engine.generate(prompts[i], s, SamplingParams(max_new_tokens=args.max_tokens)).text
            for i in range(min(args.check, len(prompts)))
        }
        for c in [*args.concurrency, "uncapped"]:
            if (c, s) not in table:
                continue
            got = table[(c, s)]["outputs"]
            same = [got[i] == refs[i] for i in refs if i in got]
            out[(c, s)] = (sum(same), len(same))
    return out


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def parse_args(argv) -> tuple[argparse.Namespace, list[str], str]:
    """(the flags, the strategies with ntp first, the GSM8K data)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--adapter", default="auto")
    p.add_argument("--proposer", default="mask")
    p.add_argument("--data", default=None, help="GSM8K folder or test.jsonl (default $MTP_DATA_DIR/gsm8k)")
    p.add_argument("--strategies", default="ntp,conf_adapt:0.9,verify:4", help="comma list; ntp is the baseline")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", type=int, default=0, help="requests per cell (default: max(4, concurrency))")
    p.add_argument("--rounds", type=int, default=1, help="cells per (concurrency, strategy), order rotated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--cell-timeout", type=float, default=300.0, help="stop issuing requests in a cell after this")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--cost-model", default=None, help="cost-model JSON for the server (default: it measures)")
    p.add_argument("--check", type=int, default=2, help="prompts per strategy compared with Engine.generate alone")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--out", default="results/serve_load")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if "ntp" not in strategies:
        strategies.insert(0, "ntp")
    data = args.data or (os.path.join(os.environ["MTP_DATA_DIR"], "gsm8k") if os.environ.get("MTP_DATA_DIR") else None)
    if not data:
        p.error("give --data GSM8K_DIR or set MTP_DATA_DIR")
    return args, strategies, data


def measure(client, args, prompts: list[str], strategies: list[str]) -> dict[tuple[int, str], list[dict]]:
    """One warm-up request per strategy (not counted), then `--rounds` cells per (concurrency, strategy),
    the strategies' order rotated each round."""
    for s in strategies:  # warm-up, excluded
        client.chat.completions.create(
            model="bench",
            messages=[{"role": "user", "content": prompts[0]}],
            max_tokens=4,
            temperature=0,
            extra_body={"mtp": {"strategy": s}},
        )
    cells: dict[tuple[int, str], list[dict]] = {}
    for c in args.concurrency:
        n = args.requests or max(4, c)
        for r in range(args.rounds):
            order = strategies[r % len(strategies) :] + strategies[: r % len(strategies)]
            for s in order:
                cell = run_cell(client, prompts, s, c, n, args.max_tokens, args.cell_timeout)
                cells.setdefault((c, s), []).append(cell)
                print(
                    f"c={c:<3} {s:<18} {cell['requests']} req {cell['tokens']} tok {cell['wall_s']:.1f} s "
                    f"{cell['tokens_per_s']:.1f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
    return cells


def report(args, strategies: list[str], table: dict, same: dict, uncapped: dict) -> tuple[list[dict], str]:
    """(a row per cell, the Markdown table): tokens/s and its ratio to ntp's at the same concurrency,
    latencies, tokens per pass, capped passes, and how many outputs equal `Engine.generate`'s."""
    rows, lines = (
        [],
        [
            "| concurrency | strategy | requests | tokens/s | vs ntp | p50 s | p95 s | tokens/pass | "
            "capped passes | identical to generate |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ],
    )
    for c in args.concurrency:
        base = table[(c, "ntp")]["tokens_per_s"]
        for s in strategies:
            t = table[(c, s)]
            ratio = M.speedup(t["tokens_per_s"], base)
            ok = same.get((c, s))
            row = {
                "concurrency": c,
                "strategy": s,
                **{k: v for k, v in t.items() if k != "outputs"},
                "vs_ntp": ratio,
                "identical": ok,
            }
            rows.append(row)
            lines.append(
                f"| {c} | {s} | {t['requests']} | {t['tokens_per_s']:.1f} | {fmt(ratio, '.2f')}x | "
                f"{fmt(t['p50_latency_s'], '.1f')} | {fmt(t['p95_latency_s'], '.1f')} | "
                f"{fmt(t['tokens_per_forward'], '.2f')} | {t['capped_passes']}/{t['row_passes']} | "
                f"{f'{ok[0]}/{ok[1]}' if ok else '-'} |"
            )
    if uncapped:
        lines += [
            "",
            f"Sent with `mtp.adaptive: false` (never capped), the first {args.check} prompts together, "
            "identical to `Engine.generate`: "
            + ", ".join(f"{s} {same[('uncapped', s)][0]}/{same[('uncapped', s)][1]}" for s in strategies),
        ]
    return rows, "\n".join(lines)


def main(argv=None) -> int:
    args, strategies, data = parse_args(argv)
    n_prompts = max(max(args.requests, 4), max(args.concurrency))
    prompts = [item["prompt"] for item in gsm8k.load(data, limit=n_prompts)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import openai

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port, out / "server.log")
    try:
        wait_ready(url, proc, args.startup_timeout)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
        cells = measure(client, args, prompts, strategies)
        uncapped = uncapped_outputs(client, args, prompts, strategies) if args.check else {}
        import httpx

        metrics_text = httpx.get(url + "/metrics", timeout=30).text
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    (out / "metrics.prom").write_text(metrics_text)
    table = {key: merge_cells(v) for key, v in cells.items()}
    same = check_identical(args, prompts, strategies, {**table, **uncapped}) if args.check else {}
    rows, text = report(args, strategies, table, same, uncapped)
    (out / "serve_load.md").write_text(text + "\n")
    (out / "serve_load.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
