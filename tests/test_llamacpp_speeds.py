"""llama-server's speeds as `mtp bench` and `benchmarks/serve_load.py` read them, on the real build (`make
llamacpp`; skipped without it): the decode-only figure taken from a request's `timings` is exactly the
server's own `predicted_per_second`, and the server serve_load starts for concurrency C has C slots, each
with the context mtp serve gives a request, and answers C chat requests at once with their timings."""

from __future__ import annotations

import importlib.util
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import require_smollm2

from mtp.eval.peers import gguf_model, llamacpp_decode_timing
from mtp.interop import llamacpp_env
from mtp.interop.llamacpp_server import LlamaServer, free_port

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(llamacpp_env.missing() is not None, reason="llama.cpp is not built here (make llamacpp)"),
]

SERVE_LOAD = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"


@pytest.fixture
def gguf():
    require_smollm2()
    return gguf_model("smollm2-135m")


def test_decode_only_timing_is_llama_servers_predicted_per_second(gguf):
    import httpx

    with LlamaServer(gguf, threads=1, ctx=512) as server:
        ids = httpx.post(server.url + "/tokenize", json={"content": "Once upon a time, there"}, timeout=30).json()
        rec = server.complete(ids["tokens"], 24)
    t = rec["timings"]
    n, secs = llamacpp_decode_timing(t)
    assert n == t["predicted_n"] - 1 and n > 0
    assert n / secs == pytest.approx(t["predicted_per_second"], rel=1e-6)


def test_serve_load_starts_llama_server_with_c_slots(gguf, tmp_path, monkeypatch):
    import httpx
    import openai

    monkeypatch.syspath_prepend(str(SERVE_LOAD.parent))
    spec = importlib.util.spec_from_file_location("benchmark_serve_load", SERVE_LOAD)
    serve_load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_load)

    port = free_port()
    cmd = serve_load.llama_server_cmd(
        llamacpp_env.binary("llama-server"), gguf, 3, 1, 256, port, llamacpp_env.run_flags()
    )
    log = open(tmp_path / "llama-server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        serve_load.wait_ready(url, proc, 180, "llama-server")
        props = httpx.get(url + "/props", timeout=30).json()
        assert props["total_slots"] == 3
        assert props["default_generation_settings"]["n_ctx"] == 256  # -c 768 over 3 slots
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        with ThreadPoolExecutor(3) as pool:
            prompts = ["Name three colours.", "What is 12 times 7?", "Say hello."]
            outs = list(pool.map(lambda p: serve_load.ask(client, p, 8, serve_load.LLAMA_BODY), prompts))
        for r in outs:
            assert 0 < r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
            n, secs = llamacpp_decode_timing(r.model_extra["timings"])
            assert n == r.model_extra["timings"]["predicted_n"] - 1
    finally:
        serve_load.stop(proc)
        log.close()
    assert proc.poll() is not None  # the server is gone
