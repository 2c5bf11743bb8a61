"""Quality by lm-evaluation-harness: `ntp`, a lossless tree and a lossy strategy scored by `lm-eval`
(`local-completions`) against one live `mtp serve`, each strategy chosen per request (`"mtp":
{"strategy": ...}` in the generation requests' body), plus the cost of `n = 4` samples against 4
sequential requests.

Three small tasks from local files (no hub; `write_tasks`), in lm-eval's own task format:
- `mtp_gsm8k`: the first --n-gsm8k GSM8K test problems, `generate_until`, zero-shot, the last number
  of the answer against the gold one (lm-eval's flexible-extract filter);
- `mtp_mc`: MC_ITEMS as multiple choice, scored through prompt log-probabilities (`echo` + `logprobs`:
  the prefill pass alone, so the same for every strategy by construction);
- `mtp_qa`: the same items answered by generation (a lead-in ends the prompt, the first word of the
  answer must be the right choice): the lossy strategies' quality on a task this model can do.
lm-eval runs from its own environment (`make lmeval` -> .venv-lmeval) in a subprocess (`run_lmeval`),
with the model's tokenizer written from the packaged GGUF (`tokenizer_dir`).

    make lmeval
    python benchmarks/quality_lmeval.py --data $MTP_DATA_DIR/gsm8k --out results/quality_lmeval

Writes OUT/quality_lmeval.json and prints the table and the n = 4 timing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LMEVAL_PYTHON = REPO / ".venv-lmeval" / "bin" / "python"
MODEL_NAME = "smollm2-135m"

# (question, lead-in that ends the prompt, choices, index of the right one)
MC_ITEMS = [
    ("What is the capital of France?", "The capital of France is", ["Paris", "London", "Rome", "Berlin"], 0),
    ("What is the capital of Japan?", "The capital of Japan is", ["Beijing", "Tokyo", "Seoul", "Bangkok"], 1),
    ("What is the capital of Italy?", "The capital of Italy is", ["Madrid", "Athens", "Rome", "Vienna"], 2),
    ("What colour is the sky on a clear day?", "On a clear day the sky is", ["blue", "green", "red", "yellow"], 0),
    ("How many legs does a spider have?", "A spider has", ["six", "eight", "four", "ten"], 1),
    ("What is the opposite of hot?", "The opposite of hot is", ["warm", "big", "cold", "fast"], 2),
    ("What do bees make?", "Bees make", ["honey", "milk", "silk", "paper"], 0),
    (
        "Which is the largest planet?",
        "The largest planet in the solar system is",
        ["Mars", "Jupiter", "Venus", "Earth"],
        1,
    ),
    ("What is frozen water called?", "Frozen water is called", ["steam", "sand", "ice", "glass"], 2),
    ("What is two plus two?", "Two plus two equals", ["four", "five", "three", "six"], 0),
    ("Which day comes after Monday?", "The day after Monday is", ["Sunday", "Tuesday", "Friday", "Saturday"], 1),
    ("Which animal says moo?", "The animal that says moo is the", ["dog", "cat", "cow", "duck"], 2),
    ("What is the chemical formula of water?", "The chemical formula of water is", ["H2O", "CO2", "NaCl", "O2"], 0),
    ("Which is the fastest land animal?", "The fastest land animal is the", ["lion", "cheetah", "horse", "bear"], 1),
]

# run inside .venv-lmeval: argv[1] a JSON spec, argv[2] where to write results and per-item samples
DRIVER = r"""
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
spec = json.load(open(sys.argv[1]))
res = lm_eval.simple_evaluate(
    model="local-completions", model_args=spec["model_args"], tasks=spec["tasks"],
    task_manager=TaskManager(include_path=spec["include_path"]), gen_kwargs=spec.get("gen_kwargs"),
    log_samples=True, batch_size=1,
)
keep = ("doc_id", "arguments", "resps", "filtered_resps", "target", "acc", "acc_norm", "exact_match")
samples = {t: [{k: s[k] for k in keep if k in s} for s in ss] for t, ss in res["samples"].items()}
json.dump({"results": res["results"], "samples": samples}, open(sys.argv[2], "w"), default=str)
"""


def lmeval_python() -> Path | None:
    """.venv-lmeval's interpreter, when lm-eval imports there (`make lmeval`)."""
    if not LMEVAL_PYTHON.exists():
        return None
    ok = subprocess.run([str(LMEVAL_PYTHON), "-c", "import lm_eval"], capture_output=True).returncode == 0
    return LMEVAL_PYTHON if ok else None


def tokenizer_dir() -> Path:
    """The model's tokenizer as an HF folder, written from the packaged GGUF (what lm-eval counts with)."""
    from mtp.core.runtime import loading

    return loading.gguf_to_hf_dir(loading.resolve(loading.DEFAULT_MODEL))


def write_tasks(folder: Path, gsm8k_file: Path | None, n_gsm8k: int, max_gen_toks: int = 128) -> list[str]:
    """The task files (YAML, written as JSON) and their data under `folder`; returns the task names."""
    folder.mkdir(parents=True, exist_ok=True)

    def dump(name: str, rows: list[dict], config: dict) -> str:
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        base = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}}
        (folder / f"{name}.yaml").write_text(json.dumps({**base, "test_split": "test", **config}, indent=1))
        return name

    items = [{"question": q, "lead": lead, "choices": c, "answer": a} for q, lead, c, a in MC_ITEMS]
    text = "Q: {{question}}\nA: {{lead}}"
    names = [
        dump(
            "mtp_mc",
            items,
            {
                "output_type": "multiple_choice",
                "doc_to_text": text,
                "doc_to_choice": "{{choices}}",
                "doc_to_target": "{{answer}}",
                "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
            },
        ),
        dump(
            "mtp_qa",
            items,
            {
                "output_type": "generate_until",
                "doc_to_text": text,
                "doc_to_target": "{{choices[answer]}}",
                "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 8, "temperature": 0, "do_sample": False},
                "filter_list": [
                    {
                        "name": "first-word",
                        "filter": [
                            {"function": "regex", "regex_pattern": "([A-Za-z0-9]+)", "group_select": 0},
                            {"function": "take_first"},
                        ],
                    }
                ],
                "metric_list": [{"metric": "exact_match", "ignore_case": True}],
            },
        ),
    ]
    if gsm8k_file is not None:
        rows = [json.loads(line) for line in gsm8k_file.read_text().splitlines()[:n_gsm8k] if line.strip()]
        names.append(
            dump(
                "mtp_gsm8k",
                [{"question": r["question"], "answer": r["answer"]} for r in rows],
                {
                    "output_type": "generate_until",
                    "doc_to_text": "Question: {{question}}\nAnswer:",
                    "doc_to_target": "{{answer.split('####')[-1].strip()}}",
                    "generation_kwargs": {
                        "until": ["Question:", "\n\n"],
                        "max_gen_toks": max_gen_toks,
                        "temperature": 0,
                        "do_sample": False,
                    },
                    "filter_list": [
                        {
                            "name": "flexible-extract",
                            "filter": [
                                {
                                    "function": "regex",
                                    "regex_pattern": "(-?[$0-9.,]{2,})|(-?[0-9]+)",
                                    "group_select": -1,
                                },
                                {"function": "take_first"},
                            ],
                        }
                    ],
                    "metric_list": [
                        {
                            "metric": "exact_match",
                            "ignore_case": True,
                            "regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"],
                        }
                    ],
                },
            )
        )
    return names


def run_lmeval(
    python: Path, url: str, tasks: list[str], task_dir: Path, strategy: str | None = None, timeout: float = 3600
) -> dict:
    """lm-eval's `local-completions` over the tasks against the server at `url` (its generation requests
    carry `"mtp": {"strategy": strategy}` when given); returns {"results", "samples"}."""
    spec = {
        "model_args": {
            "base_url": url.rstrip("/") + "/v1/completions",
            "model": MODEL_NAME,
            "tokenizer_backend": "huggingface",
            "tokenizer": str(tokenizer_dir()),
            "max_length": 1024,
            "num_concurrent": 1,
            "max_retries": 1,
        },
        "tasks": tasks,
        "include_path": str(task_dir),
        "gen_kwargs": {"mtp": {"strategy": strategy}} if strategy else None,
    }
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path, driver = Path(tmp) / "spec.json", Path(tmp) / "out.json", Path(tmp) / "driver.py"
        spec_path.write_text(json.dumps(spec))
        driver.write_text(DRIVER)
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run(
            [str(python), str(driver), str(spec_path), str(out_path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"lm-eval failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out_path.read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, log_path: Path, *flags: str) -> subprocess.Popen:
    """`mtp serve` on loopback, waited for until /health answers."""
    import httpx

    cmd = [sys.executable, "-m", "mtp.cli", "serve", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=REPO)
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"mtp serve exited {proc.returncode}: see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"mtp serve did not start: see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def metric(results: dict, task: str) -> tuple[str, float]:
    """The task's headline metric: accuracy, or exact match after its filter."""
    r = results[task]
    for key in ("acc,none", "exact_match,flexible-extract", "exact_match,first-word"):
        if key in r:
            return key.split(",")[0], float(r[key])
    raise KeyError(f"{task}: no known metric in {sorted(r)}")


def time_n(url: str, prompt: str, n: int, max_tokens: int, temperature: float, repeats: int) -> dict:
    """Wall time of one request with n samples against n sequential requests (the same prompt and
    settings), alternated `repeats` times; the median of each."""
    import httpx

    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
    body["mtp"] = {"strategy": "ntp", "adaptive": False}

    def post(extra):
        r = httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=600)
        r.raise_for_status()
        return r.json()

    together, sequential, tokens = [], [], []
    post({"seed": 0})  # warm-up
    for rep in range(repeats):
        t0 = time.perf_counter()
        out = post({"n": n, "seed": 100 * rep})
        together.append(time.perf_counter() - t0)
        tokens.append(out["usage"]["completion_tokens"])
        t0 = time.perf_counter()
        for i in range(n):
            post({"seed": 100 * rep + i})
        sequential.append(time.perf_counter() - t0)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {
        "n": n,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "repeats": repeats,
        "n_request_s": med(together),
        "sequential_s": med(sequential),
        "ratio": med(together) / med(sequential),
        "completion_tokens": tokens,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.join(os.environ.get("MTP_DATA_DIR", ""), "gsm8k"))
    ap.add_argument("--n-gsm8k", type=int, default=20)
    ap.add_argument("--max-gen-toks", type=int, default=128)
    ap.add_argument("--strategies", default="ntp,tree:8,conf_adapt:0.9")
    ap.add_argument("--serve-flags", default="", help="extra `mtp serve` flags, e.g. '--proposer heads'")
    ap.add_argument("--timing-repeats", type=int, default=3)
    ap.add_argument("--timing-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/quality_lmeval")
    args = ap.parse_args()

    python = lmeval_python()
    if python is None:
        sys.exit("lm-eval is not installed in .venv-lmeval: run `make lmeval`")
    gsm8k = Path(args.data) / "test.jsonl"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = write_tasks(out / "tasks", gsm8k if gsm8k.is_file() else None, args.n_gsm8k, args.max_gen_toks)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(port, out / "serve.log", *args.serve_flags.split())
    rows, report = [], {"tasks": tasks, "strategies": {}}
    try:
        for strategy in args.strategies.split(","):
            t0 = time.perf_counter()
            res = run_lmeval(python, url, tasks, out / "tasks", strategy)
            seconds = time.perf_counter() - t0
            scores = {t: metric(res["results"], t) for t in tasks}
            report["strategies"][strategy] = {"scores": scores, "seconds": seconds, "samples": res["samples"]}
            rows.append((strategy, scores, seconds))
            print(strategy, {t: round(v, 4) for t, (_, v) in scores.items()}, f"{seconds:.0f} s", flush=True)
        prompt = "Write a short story about a robot who learns to paint."
        report["n_timing"] = time_n(url, prompt, 4, args.timing_tokens, 0.8, args.timing_repeats)
    finally:
        stop_server(server)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    report["cpu"] = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "")
    (out / "quality_lmeval.json").write_text(json.dumps(report, indent=1, default=str))
    print("\n| strategy | " + " | ".join(f"{t} ({rows[0][1][t][0]})" for t in tasks) + " | lm-eval wall s |")
    print("| --- |" + " --- |" * (len(tasks) + 1))
    for strategy, scores, seconds in rows:
        print(f"| {strategy} | " + " | ".join(f"{scores[t][1]:.3f}" for t in tasks) + f" | {seconds:.0f} |")
    t = report["n_timing"]
    print(
        f"\nn = {t['n']} at temperature {t['temperature']}, {t['max_tokens']} tokens: one request "
        f"{t['n_request_s']:.2f} s, {t['n']} sequential requests {t['sequential_s']:.2f} s "
        f"(ratio {t['ratio']:.2f}; median of {t['repeats']}; CPU: {report['cpu']})"
    )


if __name__ == "__main__":
    main()
