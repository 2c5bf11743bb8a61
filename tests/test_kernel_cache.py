"""The kernel cache is never a crash nor a silent downgrade (issue 64, K1 K2 U2): a truncated, empty,
random or unverified (no checksum) `mtp_kernels.so` in the cache is found before the dynamic loader sees
it (a truncated one kills the process there with SIGBUS), said in one line, rebuilt and loaded; a
compiler that fails says why, even when it prints nothing.

Each case runs the loader in a subprocess (a SIGBUS must not take pytest with it) on a temporary cache
holding a copy of a real build. The rebuild goes through a stand-in compiler: it reports the real
compiler's identity (so the cache folder is the same) and "compiles" by copying that real build, so the
rebuild path runs in full without minutes of C++ per case; it logs each call, so a rebuild is counted."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys

import pytest

from mtp.core.runtime import kernels

PROBE = (
    "import torch\n"
    "from mtp.core.runtime import kernels\n"
    "ok = kernels.load()\n"
    "print('loaded' if ok else 'fallback', int(torch.ops.mtp.cpu_isa()) if ok else -1)\n"
)


@pytest.fixture(scope="module")
def real_build(tmp_path_factory):
    """(compiler, cache folder name, a copy of a whole library) from the cache this session uses, built
    there first if needed; skipped where the kernels do not build."""
    if not kernels.load():
        pytest.skip(f"the C++ kernels do not build here ({kernels.why_unavailable()})")
    cxx = kernels._compiler()
    folder = kernels.build_dir(cxx)
    lib = folder / kernels.LIBRARY
    assert kernels.damage(lib) is None, kernels.damage(lib)
    keep = tmp_path_factory.mktemp("real-build") / kernels.LIBRARY
    shutil.copyfile(lib, keep)
    return cxx, folder.name, keep


def stand_in_compiler(tmp_path, cxx: str, library) -> tuple[str, object]:
    """A compiler whose `--version` is `cxx`'s and whose build copies `library` to its `-o` target."""
    log = tmp_path / "builds.log"
    script = tmp_path / "cxx"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "--version" ]; then exec "{cxx}" --version; fi\n'
        "while [ $# -gt 0 ]; do\n"
        f'  if [ "$1" = "-o" ]; then cp "{library}" "$2" && echo "$2" >> "{log}"; exit $?; fi\n'
        "  shift\n"
        "done\n"
        "exit 1\n"
    )
    script.chmod(0o755)
    return str(script), log


def probe_env(cache, cxx) -> dict:
    env = {**os.environ, "MTP_CACHE_DIR": str(cache), "CXX": cxx, "OMP_NUM_THREADS": "1"}
    env.pop("MTP_KERNELS", None)
    return env


def run_probe(cache, cxx):
    return subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=probe_env(cache, cxx), timeout=600
    )


def damage(lib, how: str) -> None:
    data = lib.read_bytes()
    if how == "truncated":
        lib.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        lib.write_bytes(b"")
    elif how == "random":
        lib.write_bytes(os.urandom(len(data)))


@pytest.mark.parametrize("how", ["truncated", "empty", "random", "unverified"])
def test_a_damaged_cached_library_is_said_rebuilt_and_loaded(real_build, tmp_path, how):
    cxx, name, library = real_build
    cache = tmp_path / "cache"
    folder = cache / "kernels" / name
    folder.mkdir(parents=True)
    lib = folder / kernels.LIBRARY
    shutil.copyfile(library, lib)
    if how != "unverified":  # an older mtp wrote no checksum: the library is not trusted, whole or not
        (folder / (kernels.LIBRARY + kernels.CHECKSUM)).write_text(kernels._sha256(library) + "\n")
        damage(lib, how)
    fake, log = stand_in_compiler(tmp_path, cxx, library)

    r = run_probe(cache, fake)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])  # a SIGBUS is -7 here
    assert r.stdout.split()[0] == "loaded", r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("mtp: kernels:") and "damaged" in lines[0] and "rebuilding" in lines[0]
    assert str(lib) in lines[0]
    assert len(log.read_text().splitlines()) == 1  # rebuilt once
    assert kernels.damage(lib) is None and lib.read_bytes() == library.read_bytes()

    again = run_probe(cache, fake)  # whole now: loaded silently, not rebuilt
    assert again.returncode == 0 and again.stdout.split()[0] == "loaded" and again.stderr == "", again.stderr
    assert len(log.read_text().splitlines()) == 1


def test_a_first_build_is_said_once(real_build, tmp_path):
    cxx, name, library = real_build
    fake, log = stand_in_compiler(tmp_path, cxx, library)
    r = run_probe(tmp_path / "cache", fake)
    assert r.returncode == 0 and r.stdout.split()[0] == "loaded", r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "compiling the C++ kernels" in lines[0] and "once" in lines[0], r.stderr
    assert len(log.read_text().splitlines()) == 1


def test_a_failing_compiler_gives_a_reason(tmp_path):
    """`CXX=/bin/false` prints nothing: the line still says why (its exit status)."""
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` program")
    r = run_probe(tmp_path / "cache", false)
    assert r.returncode == 0 and r.stdout.split()[0] == "fallback", r.stderr
    failed = [ln for ln in r.stderr.splitlines() if "failed" in ln]
    assert len(failed) == 1, r.stderr
    assert "failed: exit status 1, no output (log:" in failed[0] and "pure-torch path" in failed[0]
    assert not list((tmp_path / "cache").rglob(kernels.LIBRARY))  # nothing half-written


def test_a_build_under_way_elsewhere_is_waited_for_not_repeated(real_build, tmp_path):
    """Two first starts at once compile once: the second says it waits, then loads the first's build."""
    cxx, name, library = real_build
    folder = tmp_path / "cache" / "kernels" / name
    folder.mkdir(parents=True)
    fake, log = stand_in_compiler(tmp_path, cxx, library)
    with open(folder / ".build.lock", "a") as held:  # "another process" is building
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = subprocess.Popen(
            [sys.executable, "-c", PROBE],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=probe_env(tmp_path / "cache", fake),
        )
        first = proc.stderr.readline()  # (the process's end, "", if it does not wait)
        shutil.copyfile(library, folder / kernels.LIBRARY)  # the other build finishes
        (folder / (kernels.LIBRARY + kernels.CHECKSUM)).write_text(kernels._sha256(library) + "\n")
    out, err = proc.communicate(timeout=600)
    assert "another mtp process is building the kernels" in first and "waiting" in first, first + err
    assert proc.returncode == 0 and out.split()[0] == "loaded" and err == "", err
    assert not log.exists()  # it compiled nothing itself
