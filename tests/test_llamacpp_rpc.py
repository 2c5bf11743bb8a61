"""llama.cpp's RPC backend as a cluster on one machine (mtp.interop.llamacpp_rpc, benchmarks/llamacpp_rpc.py).

Without the llama.cpp build: the relay adds the asked delay per direction (round trips timed on loopback
against an echo server; the window cannot be met without the delay), delays each chunk as it flows and keeps
bytes and order; bad delays are one line; and the cluster's process handling against a stand-in
`ggml-rpc-server` (a small Python TCP server in a fake prefix): a port in use, a worker that dies, is stopped or
leaves data unanswered is named, and no worker outlives `close()`, an error, or the death of its parent.
With the build (marker `llamacpp`): a real cluster starts and stops leaving no process, a 2-node greedy run
equals the 1-node output, and a worker killed or stopped mid-request is named within 30 s.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import require_smollm2, tiny_model

from mtp.core.runtime.artifacts import base_hash
from mtp.interop import llamacpp_env
from mtp.interop.llamacpp_rpc import Cluster, ClusterError, ClusterServer, DelayRelay, parse_delay, parse_delays
from mtp.interop.llamacpp_server import LlamaServer

ROOT = Path(__file__).resolve().parents[1]


def one_line(e: BaseException, needle: str) -> None:
    text = str(e)
    assert "\n" not in text and needle in text, text


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# ---- the build: `make llamacpp` makes ggml-rpc-server too ---------------------------------------------------
def test_an_older_build_without_rpc_is_built_again_in_place(tmp_path, monkeypatch):
    """A finished prefix from before GGML_RPC (stamp, build.json without the flag, no ggml-rpc-server): its
    worker counts as missing with the hint, and `build()` configures and builds again from the unpacked
    tree, without a download, with the flag and the target."""
    root = tmp_path / "prefix"
    (root / "build" / "bin").mkdir(parents=True)
    (root / "src").mkdir()
    (root / "src" / "CMakeLists.txt").write_text("")
    for t in ("llama-server", "llama-bench"):
        (root / "build" / "bin" / t).write_text("")
    (root / f".built-{llamacpp_env.VERSION}").touch()
    old = [f for f in llamacpp_env.CMAKE_FLAGS if f != "-DGGML_RPC=ON"] + ["-DGGML_NATIVE=ON"]
    (root / "build.json").write_text(json.dumps({"version": llamacpp_env.VERSION, "cmake": old}))
    monkeypatch.setenv("MTP_LLAMACPP_DIR", str(root))
    assert llamacpp_env.missing() is None
    assert "has no ggml-rpc-server" in llamacpp_env.missing(llamacpp_env.RPC_SERVER)
    assert llamacpp_env.stale() == [llamacpp_env.RPC_SERVER, "-DGGML_RPC=ON"]
    calls = []

    def fake_run(cmd, check=False, **kw):
        calls.append(cmd)
        if "--build" in cmd:
            for t in llamacpp_env.TARGETS:
                (root / "build" / "bin" / t).write_text("")

    monkeypatch.setattr(llamacpp_env.subprocess, "run", fake_run)
    monkeypatch.setattr(llamacpp_env, "make_converter_venv", lambda out=None: None)
    monkeypatch.setattr(llamacpp_env, "_fetch", lambda dest: pytest.fail("no download for an in-place rebuild"))
    llamacpp_env.build()
    configure, make = calls
    assert "-DGGML_RPC=ON" in configure and llamacpp_env.RPC_SERVER in make
    assert llamacpp_env.stale() == [] and llamacpp_env.stamp().exists()
    assert llamacpp_env.missing(llamacpp_env.RPC_SERVER) is None
    llamacpp_env.build()  # up to date: nothing runs
    assert len(calls) == 2


# ---- the relay ---------------------------------------------------------------------------------------------
@pytest.fixture
def echo_port():
    """An echo server on loopback (every connection served in a thread)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve(c):
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with c:
            while data := c.recv(1 << 16):
                c.sendall(data)

    def accept():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(c,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()[1]
    srv.close()


def connect(port: int) -> socket.socket:
    c = socket.create_connection(("127.0.0.1", port), timeout=10)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return c


def recv_exactly(c: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        got += c.recv(n - len(got))
    return got


def round_trips_ms(c: socket.socket, count: int = 7) -> list[float]:
    out = []
    for i in range(count):
        t0 = time.perf_counter()
        c.sendall(bytes([i]) * 64)
        assert recv_exactly(c, 64) == bytes([i]) * 64
        out.append(1e3 * (time.perf_counter() - t0))
    return sorted(out)


def test_relay_adds_the_asked_delay_per_direction(echo_port):
    relay = DelayRelay(echo_port, 25)
    try:
        with connect(relay.port) as c:
            rtt = round_trips_ms(c)
            assert 50 <= rtt[0] and rtt[len(rtt) // 2] < 50 + 15, rtt  # 2 x 25 ms; loopback alone is ~0.1 ms
            relay.delay_ms = 5  # changed while the connection lives: the next chunks take the new delay
            rtt = round_trips_ms(c)
            assert 10 <= rtt[0] and rtt[len(rtt) // 2] < 10 + 15, rtt
            relay.delay_ms = 0
            assert round_trips_ms(c)[0] < 10
    finally:
        relay.close()


def test_relay_delays_each_chunk_as_it_flows_and_keeps_bytes_and_order(echo_port):
    relay = DelayRelay(echo_port, 60)
    try:
        with connect(relay.port) as c:
            t0 = time.perf_counter()
            c.sendall(b"a" * 10)
            time.sleep(0.03)
            c.sendall(b"b" * 10)
            first = recv_exactly(c, 10)
            t_first = time.perf_counter() - t0
            second = recv_exactly(c, 10)
            t_second = time.perf_counter() - t0
            assert (first, second) == (b"a" * 10, b"b" * 10)
            # each chunk 120 ms after it was sent, in flight together (not 120 ms after the previous answer)
            assert 0.12 <= t_first < 0.145 and 0.15 <= t_second < 0.2, (t_first, t_second)
            relay.delay_ms = 2
            data = os.urandom(3 << 20)
            got: list[bytes] = []
            reader = threading.Thread(target=lambda: got.append(recv_exactly(c, len(data))))
            reader.start()
            for i in range(0, len(data), 7000):  # many small writes: order and bytes kept
                c.sendall(data[i : i + 7000])
            reader.join(30)
            assert got and got[0] == data
    finally:
        relay.close()


@pytest.mark.parametrize("bad", ["-1", "x", "nan", "inf", "", None, -0.5])
def test_a_delay_that_is_negative_or_not_a_number_is_one_line(bad):
    with pytest.raises(ValueError) as e:
        parse_delay(bad)
    one_line(e.value, "delay")
    with pytest.raises(ValueError):
        DelayRelay(1, bad)
    with pytest.raises(ValueError):
        Cluster(2, bad)  # refused before anything starts (and before asking for the build)


def test_delay_lists():
    assert parse_delays("0, 1,5,20") == [0.0, 1.0, 5.0, 20.0]
    for bad in ("", "1,-2", "1,,x"):
        with pytest.raises(ValueError) as e:
            parse_delays(bad)
        one_line(e.value, "delay")


# ---- the cluster against a stand-in worker ----------------------------------------------------------------
FAKE_WORKER = """
import os, signal, socket, sys, time
args = sys.argv[1:]
port = int(args[args.index("-p") + 1])
mode = os.environ.get("FAKE_RPC", "echo")
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
s = socket.socket()
try:
    s.bind(("127.0.0.1", port))
except OSError:
    print("Failed to create server socket", flush=True)
    sys.exit(0)
s.listen(1)
print("Starting RPC server (stand-in)", flush=True)
if mode == "die":
    time.sleep(0.5)
    print("error: out of memory", flush=True)
    sys.exit(3)
while True:
    c, _ = s.accept()
    while data := c.recv(65536):
        if mode != "mute":
            c.sendall(data)
"""


@pytest.fixture
def fake_prefix(tmp_path, monkeypatch):
    """A `.llamacpp/` prefix whose `ggml-rpc-server` is the stand-in; FAKE_RPC picks its behaviour."""
    root = tmp_path / "llamacpp"
    (root / "build" / "bin").mkdir(parents=True)
    (root / f".built-{llamacpp_env.VERSION}").touch()
    (root / "build.json").write_text(json.dumps({"version": llamacpp_env.VERSION, "cmake": ["-DGGML_NATIVE=ON"]}))
    worker = root / "build" / "bin" / llamacpp_env.RPC_SERVER
    worker.write_text(f"#!{sys.executable}\n" + FAKE_WORKER)
    worker.chmod(0o755)
    monkeypatch.setenv("MTP_LLAMACPP_DIR", str(root))
    return root


def test_cluster_without_the_rpc_server_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_LLAMACPP_DIR", str(tmp_path / "none"))
    with pytest.raises(ValueError) as e:
        Cluster(2)
    one_line(e.value, "make llamacpp")


def test_cluster_starts_and_stops_leaving_no_process(fake_prefix):
    with Cluster(3, 1) as cluster:
        pids = cluster.pids()
        assert len(pids) == 3 and all(alive(p) for p in pids)
        assert len(cluster.endpoints.split(",")) == 3 and all(
            e.startswith("127.0.0.1:") for e in cluster.endpoints.split(",")
        )
        args = cluster.server_args()
        assert args[args.index("--rpc") + 1] == cluster.endpoints and args[args.index("-ts") + 1] == "1,1,1"
        cluster.check()
        with connect(cluster.relays[0].port) as c:  # traffic goes through the relay to the worker
            assert round_trips_ms(c, 3)[0] >= 2
    assert not any(alive(p) for p in pids)


def test_an_error_inside_the_block_leaves_no_process(fake_prefix, monkeypatch):
    monkeypatch.setenv("FAKE_RPC", "stubborn")  # ignores SIGTERM: killed after STOP_S
    with pytest.raises(KeyboardInterrupt):
        with Cluster(2) as cluster:
            pids = cluster.pids()
            raise KeyboardInterrupt  # Ctrl-C
    assert not any(alive(p) for p in pids)


def test_no_worker_outlives_the_process_that_started_it(fake_prefix):
    code = (
        "from mtp.interop.llamacpp_rpc import Cluster\n"
        "c = Cluster(2)\nprint(' '.join(map(str, c.pids())), flush=True)\nimport time\ntime.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    proc.kill()  # no atexit, no `with`: the kernel's parent-death signal stops the workers
    proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


def test_a_port_in_use_is_one_line(fake_prefix):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ClusterError) as e:
            Cluster(2, port=port)
        one_line(e.value, f"port 127.0.0.1:{port} is in use")
        with pytest.raises(ClusterError) as e:
            Cluster(2, port=port - 1)  # the second worker's port
        one_line(e.value, f"127.0.0.1:{port} is in use")


def test_a_worker_that_dies_is_named(fake_prefix, monkeypatch):
    monkeypatch.setenv("FAKE_RPC", "die")
    with Cluster(2) as cluster:
        deadline = time.monotonic() + 10
        with pytest.raises(ClusterError) as e:
            while time.monotonic() < deadline:
                cluster.check()
                time.sleep(0.05)
        one_line(e.value, "ggml-rpc-server 1 of 2")
        assert "exited (3)" in str(e.value) and "out of memory" in str(e.value)


def test_a_stopped_worker_is_named_and_still_stopped_cleanly(fake_prefix):
    with Cluster(2) as cluster:
        pids = cluster.pids()
        os.kill(pids[1], signal.SIGSTOP)
        time.sleep(0.1)
        with pytest.raises(ClusterError) as e:
            cluster.check()
        one_line(e.value, f"ggml-rpc-server 2 of 2 (127.0.0.1:{cluster.workers[1].port}, pid {pids[1]}) is stopped")
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 3 and not any(alive(p) for p in pids)  # SIGKILL, no SIGTERM wait


def test_data_left_unanswered_during_a_request_is_a_hang(fake_prefix, monkeypatch):
    monkeypatch.setenv("FAKE_RPC", "mute")
    with Cluster(1, hang_s=0.5) as cluster, connect(cluster.relays[0].port) as c:
        c.sendall(b"graph_compute")
        time.sleep(0.8)
        cluster.check()  # no request in flight: an idle link is no hang
        cluster.busy_since = time.monotonic()
        cluster.check()
        time.sleep(0.8)
        with pytest.raises(ClusterError) as e:
            cluster.check()
        one_line(e.value, "ggml-rpc-server 1 of 1")
        assert "unanswered" in str(e.value)


def test_answered_data_is_no_hang(fake_prefix):
    with Cluster(1, hang_s=0.3) as cluster, connect(cluster.relays[0].port) as c:
        cluster.busy_since = time.monotonic()
        for _ in range(4):
            round_trips_ms(c, 1)
            time.sleep(0.2)
            cluster.check()
        assert cluster.relays[0].round_trips == 4


# ---- the benchmark's refusals ------------------------------------------------------------------------------
def bench_module():
    spec = importlib.util.spec_from_file_location("bench_llamacpp_rpc", ROOT / "benchmarks" / "llamacpp_rpc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--delays", "0,-1"], "delay '-1'"),
        (["--delays", "0,five"], "delay 'five' is not a number"),
        (["--nodes", "2,x"], "--nodes"),
        (["--modes", "plain,medusa"], "--modes"),
        (["--draft", "0"], "--draft"),
    ],
)
def test_benchmark_bad_input_is_one_line(argv, needle, tmp_path, capsys):
    assert bench_module().main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("llamacpp_rpc: error:") and needle in err, err
    assert not (tmp_path / "o").exists()


def test_benchmark_refuses_a_drafter_for_another_model(tmp_path):
    export = tmp_path / "gguf"
    export.mkdir()
    (export / "export.json").write_text(
        json.dumps({"format": "mtp-llamacpp-export", "base_hash": "0123456789abcdef", "target": "target-f32.gguf",
                    "drafter": "drafter-f32.gguf"})
    )  # fmt: skip
    (export / "target-f32.gguf").write_bytes(b"")
    (export / "drafter-f32.gguf").write_bytes(b"")

    class Loaded:
        name = "tiny"

    class Engine:
        model, loaded = tiny_model(), Loaded()

    with pytest.raises(ValueError) as e:
        bench_module().ensure_export(export, Engine())
    one_line(e.value, f"trained for base weights 0123456789abcdef, tiny has {base_hash(Engine.model)}")


def stub_benchmark_inputs(mod, monkeypatch) -> None:
    """The benchmark's inputs without llama-server or a model: the build counts as present, one prompt."""

    class Loaded:
        eos_ids = [2]

    class StubEngine:
        loaded = Loaded()

        @staticmethod
        def load(config):
            return StubEngine()

        def encode(self, text):
            return [1, 2, 3]

    monkeypatch.setattr(mod.llamacpp_env, "missing", lambda *a: None)
    monkeypatch.setattr(mod, "Engine", StubEngine)
    monkeypatch.setattr(mod, "load_prompts", lambda engine, data, limits: [{"source": "s", "index": 0, "ids": [1]}])
    monkeypatch.setattr(mod, "ensure_export", lambda path, engine: {"target": "t.gguf", "drafter": "d.gguf"})


def test_benchmark_ctrl_c_is_one_line_and_stops_the_workers(fake_prefix, tmp_path, monkeypatch, capsys):
    """Issue 64, U5: Ctrl-C while a llama-server starts on the cluster: one line, status 130, no worker left."""
    mod = bench_module()
    stub_benchmark_inputs(mod, monkeypatch)
    seen = []

    def ctrl_c(cluster, export, mode, draft):
        seen.extend(cluster.pids())
        assert all(alive(p) for p in seen)
        raise KeyboardInterrupt

    monkeypatch.setattr(mod, "server_for", ctrl_c)
    argv = ["--nodes", "2", "--delays", "0", "--modes", "plain", "--pipeline-strategies", "", "--data", "prompts:p"]
    try:
        rc = mod.main([*argv, "--out", str(tmp_path / "o")])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the benchmark as a traceback")
    err = capsys.readouterr().err.strip()
    assert rc == 130 and err.count("\n") == 0 and "interrupted" in err and "Traceback" not in err, err
    assert len(seen) == 2 and not any(alive(p) for p in seen)


def test_benchmark_ctrl_c_in_the_pipeline_is_an_interruption_not_a_failure(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the `mtp pipeline` stages run: `launch_local` stops them and returns 130, and the benchmark
    says it was interrupted (before: "mtp pipeline with 2 stages failed (exit 130)", status 1)."""
    mod = bench_module()
    stub_benchmark_inputs(mod, monkeypatch)
    monkeypatch.setattr(mod, "run_llamacpp", lambda *a: {})
    monkeypatch.setattr(mod, "launch_local", lambda *a, **k: 130)
    argv = ["--nodes", "2", "--delays", "0", "--modes", "plain", "--data", "prompts:p", "--out", str(tmp_path / "o")]
    assert mod.main(argv) == 130
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "interrupted" in err and "failed" not in err, err


# ---- the draft advice on a cluster (issue 64, A1) ---------------------------------------------------------------
def geometric_timings(t: dict, a: float, drafts: int, draft_s: float, steps: int = 10_000) -> list[dict]:
    """llama-server timings of a drafter accepting each draft with probability a, `drafts` per step."""
    from mtp.core.policy.costmodel import CostModel

    accepted = round(steps * sum(a**d for d in range(1, drafts + 1)))
    ms = 1e3 * steps * (CostModel(t).pass_time(1 + drafts) + drafts * draft_s)
    half = {"predicted_n": (steps + accepted) // 2, "predicted_ms": ms / 2, "draft_n": steps * drafts // 2}
    return [{**half, "draft_n_accepted": accepted // 2}] * 2


def test_the_cluster_advice_never_turns_drafting_off_while_promising_a_gain():
    """A cluster's t(q): flat to 6 tokens (the link delay dominates), then a step (an 8-token graph): a 6th draft
    costs far more than a token is worth, so `rate x cost` exceeds 1. Before the fix that became
    `--spec-draft-p-min 1.00` (llama.cpp then drafts nothing: 1.01x measured) beside "expected 3.3x plain"."""
    from mtp.interop.llamacpp_profile import P_MIN_MAX, advice_line, advise

    t = {1: 0.100, 2: 0.102, 3: 0.104, 4: 0.106, 5: 0.108, 6: 0.110, 8: 0.400}
    adv = advise(t, geometric_timings(t, 0.85, 3, 0.003))
    assert adv["n_max"] == 5 and adv["speedup"] > 3
    assert adv["p_min"] <= min(P_MIN_MAX, adv["acceptance"]) < 1  # the drafter's typical draft still passes
    line = advice_line("eagle3", adv)
    assert "--spec-draft-n-max 5" in line and f"--spec-draft-p-min {adv['p_min']:.2f} " in line
    assert float(line.split("--spec-draft-p-min ")[1].split()[0]) < 1
    draft = bench_module().fixed_or_advised("auto", adv)  # what the benchmark then runs
    assert draft[0] == 5 and 0 <= draft[1] < 1
    # a near-perfect drafter: the cap alone keeps p-min printable below 1
    sure = advise(t, geometric_timings(t, 0.9999, 3, 0.003))
    assert sure["n_max"] >= 1 and f"--spec-draft-p-min {P_MIN_MAX:.2f} " in advice_line("eagle3", sure)
    # a drafter that cannot pay: plain decoding at 1.00x, no draft setting
    slow = advise(t, geometric_timings(t, 0.3, 3, 0.080))
    assert slow["n_max"] == 0 and slow["speedup"] == pytest.approx(1.0)
    assert "serve it plain" in advice_line("eagle3", slow) and "--spec-draft" not in advice_line("eagle3", slow)


# ---- with the llama.cpp build --------------------------------------------------------------------------------
needs_build = pytest.mark.skipif(
    llamacpp_env.missing() is not None or llamacpp_env.missing(llamacpp_env.RPC_SERVER) is not None,
    reason="llama.cpp with ggml-rpc-server is not built here (make llamacpp)",
)
PROMPTS = ["What is 12 times 7?", "Name three colours.", "Tom has 5 apples and eats 2. How many are left?"]


@pytest.fixture(scope="module")
def target_and_prompts(smollm2):
    """The packaged GGUF (the file mtp decodes) and the prompts as chat-formatted ids."""
    from mtp.core.runtime import loading

    require_smollm2()
    return loading.resolve(loading.DEFAULT_MODEL), [smollm2.encode(p) for p in PROMPTS]


@pytest.mark.llamacpp
@pytest.mark.slow
@needs_build
def test_real_cluster_greedy_equals_one_node_and_leaves_no_process(target_and_prompts):
    target, prompts = target_and_prompts
    with LlamaServer(target, threads=1) as one:
        want = [one.complete(p, 24)["ids"] for p in prompts]
    with Cluster(2, 1) as cluster, ClusterServer(cluster, target, threads=1) as two:
        pids = [*cluster.pids(), two.proc.pid]
        got = [two.complete(p, 24)["ids"] for p in prompts]
        assert all(r.round_trips > 0 for r in cluster.relays)  # both workers served the passes
    assert got == want and all(len(w) > 0 for w in want)
    assert not any(alive(p) for p in pids)


@pytest.mark.llamacpp
@pytest.mark.slow
@needs_build
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_real_worker_that_dies_or_hangs_mid_request_is_named_within_30_s(target_and_prompts, fault):
    target, prompts = target_and_prompts
    with Cluster(2, 20, hang_s=5) as cluster:
        victim = cluster.workers[1]
        with ClusterServer(cluster, target, threads=1) as server:
            pids = [*cluster.pids(), server.proc.pid]
            sig = signal.SIGKILL if fault == "kill" else signal.SIGSTOP
            threading.Timer(1.0, os.kill, (victim.proc.pid, sig)).start()
            t0 = time.monotonic()
            with pytest.raises(ClusterError) as e:
                server.complete(prompts[0], 400)  # ~100 ms per pass at 20 ms: still running at 1 s
            assert time.monotonic() - t0 < 30
            one_line(e.value, f"ggml-rpc-server 2 of 2 (127.0.0.1:{victim.port}, pid {victim.proc.pid})")
    assert not any(alive(p) for p in pids)
