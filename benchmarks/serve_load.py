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

The peer: llama-server (`make llamacpp`) on the same GGUF file (the model's own `.gguf`: the shipped
SmolLM2-135M-Instruct Q4_1 by default), one more cell per (concurrency, round) in the rotation, sent the same
chat messages by the same client code (temperature 0, the same max tokens, its prompt cache off as mtp serve
has none), so its tokens/s and latencies are measured exactly as mtp serve's. For each cell it is started
afresh with `-np C` slots for concurrency C, a context of C x --max-model-len (llama-server divides `-c`
among its slots) and --threads threads, and while it runs mtp serve is paused (SIGSTOP): one server process
works at a time. The table gains its rows and a column "vs llama-server" (tokens/s over its, at the same
concurrency). Without the build (or with --no-llamacpp, or a model that is no .gguf) one line says so and
the run goes on without it.

    python benchmarks/serve_load.py --data $MTP_DATA_DIR/gsm8k --out results/serve_load

Writes OUT/serve_load.json and OUT/serve_load.md (the table) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mtp.core.decoding import metrics as M
from mtp.eval import gsm8k
from mtp.eval.peers import gguf_model, llamacpp_decode_timing
from mtp.interop import llamacpp_env

LLAMA = "llama-server"  # the peer's label in the cells and the table
LLAMA_BODY = {"cache_prompt": False}  # mtp serve keeps no prompt cache; nor does the peer here


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
        "--weights",
        args.weights,
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if not args.adaptive:
        cmd.append("--no-adaptive")
    elif args.cost_model:
        cmd += ["--cost-model", args.cost_model]
    print("$ " + " ".join(cmd), file=sys.stderr)
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, name: str = "server") -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{name} not ready after {timeout:.0f} s")


def mtp_body(strategy: str, adaptive: bool = True) -> dict:
    """The request fields mtp serve reads beside the OpenAI ones: the strategy, capped or not."""
    return {"mtp": {"strategy": strategy, "adaptive": adaptive}}


def ask(client, prompt: str, max_tokens: int, extra: dict):
    """One chat request, greedy (temperature 0), `extra` added to its body (mtp_body, LLAMA_BODY)."""
    return client.chat.completions.create(
        model="bench",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body=extra,
    )


def run_cell(
    client,
    prompts: list[str],
    label: str,
    extra: dict,
    concurrency: int,
    n_requests: int,
    max_tokens: int,
    timeout: float,
) -> dict:
    """n_requests requests over `concurrency` client threads; aggregate tokens/s over the cell's wall (end to
    end: every request's prompt included), each request's latency; `label` a strategy or LLAMA."""
    deadline = time.perf_counter() + timeout
    results = []

    def one(i: int):
        if time.perf_counter() > deadline:
            return None
        t0 = time.perf_counter()
        r = ask(client, prompts[i % len(prompts)], max_tokens, extra)
        extras = r.model_extra or {}
        return {
            "i": i % len(prompts),
            "latency_s": time.perf_counter() - t0,
            "text": r.choices[0].message.content,
            "tokens": r.usage.completion_tokens,
            "prompt_tokens": r.usage.prompt_tokens,
            "mtp": extras.get("mtp") or {},
            "timings": extras.get("timings") or {},  # llama-server's own
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
        "strategy": label,
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
        "prompt_tokens": {r["i"]: r["prompt_tokens"] for r in results},
        "server_decode": [d for r in results if (d := llamacpp_decode_timing(r["timings"])) is not None],
    }


def llama_server_cmd(
    binary: str, gguf: str, slots: int, threads: int, max_model_len: int, port: int, flags=()
) -> list[str]:
    """llama-server for `slots` concurrent requests: `-np slots` and a context of slots x max_model_len (it
    divides -c among its slots, so each gets what mtp serve's --max-model-len gives a request), `threads`
    for generation and for the prompt's batch, on loopback; `flags` those the build needs (run_flags)."""
    if slots < 1 or threads < 1 or max_model_len < 1:
        raise ValueError(f"llama-server needs slots, threads and context >= 1, got {slots}, {threads}, {max_model_len}")
    return [
        str(binary),
        "-m",
        str(gguf),
        "-np",
        str(slots),
        "-c",
        str(slots * max_model_len),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "--no-webui",
        *flags,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def llamacpp_peer(args) -> tuple[str, str] | None:
    """(llama-server binary, GGUF file) of the peer, or None after one line saying why it does not run."""
    why = None if args.llamacpp else "--no-llamacpp"
    why = why or llamacpp_env.missing()
    gguf = None
    if why is None:
        try:
            gguf = gguf_model(args.model, LLAMA)
        except ValueError as e:
            why = str(e)
    if why is not None:
        print(f"serve_load: running without the llama-server peer: {why}", file=sys.stderr)
        return None
    return str(llamacpp_env.binary("llama-server")), gguf


def llama_cell(args, peer: tuple[str, str], prompts: list[str], c: int, n: int, paused: subprocess.Popen) -> dict:
    """One llama-server cell at concurrency c: mtp serve paused (SIGSTOP), llama-server started with c slots,
    one untimed warm-up request, the cell as run_cell measures mtp serve's, the server stopped, mtp resumed."""
    import openai

    port = free_port()
    cmd = llama_server_cmd(*peer, c, args.threads or os.cpu_count(), args.max_model_len, port, llamacpp_env.run_flags())
    print("$ " + " ".join(cmd), file=sys.stderr)
    paused.send_signal(signal.SIGSTOP)
    with open(Path(args.out) / f"llama-server-c{c}.log", "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, args.startup_timeout, f"llama-server (see {args.out}/llama-server-c{c}.log)")
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
        ask(client, prompts[0], 4, LLAMA_BODY)  # warm-up, excluded
        return run_cell(client, prompts, LLAMA, LLAMA_BODY, c, n, args.max_tokens, args.cell_timeout)
    finally:
        stop(proc)
        paused.send_signal(signal.SIGCONT)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def merge_cells(cells: list[dict]) -> dict:
    tokens, wall = sum(c["tokens"] for c in cells), sum(c["wall_s"] for c in cells)
    lat = [x for c in cells for x in c["latencies"]]
    passes = sum(c["row_passes"] for c in cells)
    decode = [d for c in cells for d in c["server_decode"]]  # llama-server's own (tokens, s) after the prompt
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
        "prompt_tokens": {i: n for c in cells for i, n in c["prompt_tokens"].items()},
        "server_decode_tokens_per_s": (
            M.tokens_per_s(sum(d[0] for d in decode), sum(d[1] for d in decode)) if decode else None
        ),
    }


def uncapped_outputs(client, args, prompts: list[str], strategies: list[str]) -> dict:
    """The first --check prompts per strategy, sent together with `mtp.adaptive: false` (never capped)."""
    n = min(args.check, len(prompts))
    out = {}
    with ThreadPoolExecutor(max(1, n)) as pool:
        for s in strategies:
            rs = pool.map(lambda i, s=s: ask(client, prompts[i], args.max_tokens, mtp_body(s, False)), range(n))
            out[("uncapped", s)] = {"outputs": {i: r.choices[0].message.content for i, r in enumerate(rs)}}
    return out


def check_identical(args, prompts: list[str], strategies: list[str], table: dict) -> dict:
    """Decode the first --check prompts alone per strategy; count identical server outputs (every cell
    of the table, and the "uncapped" cells of `uncapped_outputs`)."""
    from mtp.core.decoding.sampling import SamplingParams
    from mtp.core.engine import Engine, EngineConfig

    engine = Engine.load(
        EngineConfig(
            model=args.model, adapter=args.adapter, proposer=args.proposer, threads=args.threads, weights=args.weights
        )
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
    p.add_argument(
        "--weights",
        default="native",
        help="mtp serve's --weights (native: its default; native-int8: as llama.cpp's Q4_1 path)",
    )
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--cost-model", default=None, help="cost-model JSON for the server (default: it measures)")
    p.add_argument("--check", type=int, default=2, help="prompts per strategy compared with Engine.generate alone")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument(
        "--llamacpp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="llama-server (make llamacpp) as a peer on the model's GGUF, -np C slots at concurrency C",
    )
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


def measure(client, args, prompts: list[str], strategies: list[str], server, peer) -> dict[tuple[int, str], list[dict]]:
    """One warm-up request per strategy (not counted), then `--rounds` cells per (concurrency, strategy) and,
    with the llama-server `peer`, per (concurrency, LLAMA) (`llama_cell`, mtp serve `server` paused), the
    cells' order rotated at each (concurrency, round)."""
    for s in strategies:  # warm-up, excluded
        ask(client, prompts[0], 4, mtp_body(s))
    labels = strategies + ([LLAMA] if peer else [])
    cells: dict[tuple[int, str], list[dict]] = {}
    step = 0
    for c in args.concurrency:
        n = args.requests or max(4, c)
        for _ in range(args.rounds):
            order = labels[step % len(labels) :] + labels[: step % len(labels)]
            step += 1
            for s in order:
                if s == LLAMA:
                    cell = llama_cell(args, peer, prompts, c, n, server)
                else:
                    cell = run_cell(client, prompts, s, mtp_body(s), c, n, args.max_tokens, args.cell_timeout)
                cells.setdefault((c, s), []).append(cell)
                print(
                    f"c={c:<3} {s:<18} {cell['requests']} req {cell['tokens']} tok {cell['wall_s']:.1f} s "
                    f"{cell['tokens_per_s']:.1f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
    return cells


HEADER = (
    "| concurrency | strategy | requests | tokens/s e2e | vs ntp | vs llama-server | p50 s | p95 s | tokens/pass | "
    "capped passes | identical to generate |"
)


def report_line(c: int, s: str, t: dict, ratio, vs_llama, ok) -> str:
    """One table line: cell `t` of strategy `s` (or LLAMA) at concurrency c."""
    capped = "-" if s == LLAMA else f"{t['capped_passes']}/{t['row_passes']}"
    name = f"{LLAMA} (-np {c})" if s == LLAMA else s
    return (
        f"| {c} | {name} | {t['requests']} | {t['tokens_per_s']:.1f} | {fmt(ratio, '.2f')}x | "
        f"{fmt(vs_llama, '.2f')}x | {fmt(t['p50_latency_s'], '.1f')} | {fmt(t['p95_latency_s'], '.1f')} | "
        f"{fmt(t['tokens_per_forward'], '.2f')} | {capped} | {f'{ok[0]}/{ok[1]}' if ok else '-'} |"
    )


def peer_notes(args, table: dict) -> list[str]:
    """Below the table, per concurrency: llama-server's own decode-only tokens/s and whether it was given as
    many prompt tokens as mtp serve (the same chat messages, each server's chat template)."""
    notes = []
    for c in args.concurrency:
        if (c, LLAMA) not in table:
            continue
        mine, theirs = table[(c, "ntp")]["prompt_tokens"], table[(c, LLAMA)]["prompt_tokens"]
        same = sum(1 for i in theirs if mine.get(i) == theirs[i])
        notes.append(
            f"c={c}: llama-server's own decode-only tokens/s (timings: the prompt's pass excluded, pooled over "
            f"requests) {fmt(table[(c, LLAMA)]['server_decode_tokens_per_s'], '.1f')}; prompt token counts equal "
            f"to mtp serve's on {same}/{len(theirs)} prompts"
        )
    return notes


def report(args, strategies: list[str], table: dict, same: dict, uncapped: dict) -> tuple[list[dict], str]:
    """(a row per cell, the Markdown table): aggregate tokens/s end to end (all requests' tokens over the
    cell's wall) and its ratios to ntp's and to llama-server's at the same concurrency, latencies, tokens
    per pass, capped passes, and how many outputs equal `Engine.generate`'s; llama-server's rows among them."""
    rows, lines = [], [HEADER, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in args.concurrency:
        base = table[(c, "ntp")]["tokens_per_s"]
        peer = table.get((c, LLAMA))
        for s in strategies + ([LLAMA] if peer else []):
            t = table[(c, s)]
            ratio = M.speedup(t["tokens_per_s"], base)
            vs_llama = M.speedup(t["tokens_per_s"], peer["tokens_per_s"]) if peer else None
            ok = same.get((c, s))
            rows.append(
                {
                    "concurrency": c,
                    "strategy": s,
                    **{k: v for k, v in t.items() if k != "outputs"},
                    "vs_ntp": ratio,
                    "vs_llama_server": vs_llama,
                    "identical": ok,
                }
            )
            lines.append(report_line(c, s, t, ratio, vs_llama, ok))
    lines += [
        "",
        "tokens/s e2e: all the cell's completion tokens over its wall time (every request's prompt included), "
        "the same client code for both servers; vs: that over ntp's / llama-server's at the same concurrency.",
    ]
    lines += peer_notes(args, table)
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

    peer = llamacpp_peer(args)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port, out / "server.log")
    try:
        wait_ready(url, proc, args.startup_timeout)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
        cells = measure(client, args, prompts, strategies, proc, peer)
        uncapped = uncapped_outputs(client, args, prompts, strategies) if args.check else {}
        import httpx

        metrics_text = httpx.get(url + "/metrics", timeout=30).text
    finally:
        proc.send_signal(signal.SIGCONT)  # never left paused
        stop(proc)
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
