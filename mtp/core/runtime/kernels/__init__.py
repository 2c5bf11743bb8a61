"""Small-row CPU matmul kernels, batch-invariant by construction (issue 49, first milestone).

`y = x @ W.T` for x: float32 [M, K] (M = 1..64 is what they are built for; any M works) and a weight
W [N, K] held as float32 or as GGUF blocks exactly as stored (Q8_0, Q4_0, Q4_1), as torch custom ops
`torch.ops.mtp.linear_f32 / linear_q8_0 / linear_q4_0 / linear_q4_1` (and `dequantize_*`), with the
Python face in `mtp.core.runtime.kernels.qlinear` (`KernelWeight`, `linear`).

The contract:

* **Batch-invariant**: one fixed reduction order per output element: 16 lanes, lane j takes the
  elements k = 16 i + j in increasing i, one fused multiply-add each, then one fixed tree over the 16
  lanes. A row's output bits therefore depend on that row and the weight alone: not on M, on the row's
  position, on the other rows' values, on the thread count (threads split the N output columns, never
  K), nor on the ISA path (scalar, AVX2 and AVX-512 give the same bits).
* **Exact weights**: a block dequantises to the same float32 values as the `gguf` package (what
  `mtp.core.runtime.gguf.read_gguf` uses): `q*d` (Q8_0), `(q-8)*d` (Q4_0), `q*d + m` (Q4_1), each operation
  rounded on its own (the source is compiled with `-ffp-contract=off`).
* **Dequantise once, FMA many**: each weight block is dequantised once per pass of a register tile
  over the rows (one pass for up to 8 rows on AVX-512, as 2-column halves, and 5 on AVX2), or, for more rows, once
  into a float32 panel that every row tile then reads. AVX-512 dequantises a Q4 half-block by looking
  its nibbles up in the 16 values they can stand for (`vpermps`), computed with the same operations.
* **One build serves every x86-64 CPU**: the ISA code sits in `#pragma GCC target` regions and the
  path is chosen at run time (`__builtin_cpu_supports`); `MTP_KERNEL_ISA=scalar|avx2|avx512` (or the
  `isa` argument of `qlinear.linear`) forces one, e.g. the AVX2 path on an AVX-512 machine.
* **Built once**: the C++ source compiles on first use (g++ `-O3`, no `-march`) into
  `cache_root()/kernels/<hash of source, flags, compiler, torch>/` and is loaded from there afterwards;
  one line on stderr says when it compiles (once per cache). Processes starting at once build it once
  (a lock; the others wait). The build is atomic (temporary name, then a rename) and leaves a checksum
  (`mtp_kernels.so.sha256`): the library is loaded only when its sha256 matches, so a truncated, empty,
  overwritten or older (no checksum) library, which mtp itself wrote, is never handed to the dynamic
  loader (a truncated one kills the process with SIGBUS there): one line says so and it is rebuilt.
  Without a compiler, or when the build fails, one line on stderr says so (with the compiler's reason)
  and which path runs instead: the pure-torch path (`qlinear.linear` computes each row alone with
  `F.linear` on the loader's float32 weights: still batch-invariant, slower, other bits than the kernels).
* Inference only: no autograd (a grad-requiring input is a one-line error).

The int8-activation variant (separate ops `torch.ops.mtp.linear_q8_0_i8 / _q4_0_i8 / _q4_1_i8`,
`qlinear.linear_int8`) quantises each row per 32-block to int8 (scale amax/127, float32) and uses
integer dot products (AVX-512 VNNI `vpdpbusd`, AVX2 `maddubs`) on the weights in the "i8 packing"
(`qlinear.pack_int8`: a byte permutation of the GGUF blocks, 16 columns interleaved). Integer sums are
exact in any order and the per-block float scaling follows one fixed order, so it is batch-invariant
by construction too, with the same bits on every path; its results differ from float32 math by the
activation rounding (benchmarks/kernel_text_drift.py measures how far the text moves). Order and
layout: matmul_i8.h.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch

SOURCES = [
    Path(__file__).with_name(n) for n in ("matmul.cpp", "layer_ops.cpp", "layer.cpp")
]  # compiled into one library
HEADERS = [
    Path(__file__).with_name(n) for n in ("isa.h", "ops.h", "matmul_driver.h", "matmul_i8.h", "layer_ops.h")
]  # included (hashed)
CFLAGS = [
    "-O3",
    "-std=c++20",
    "-fPIC",
    "-shared",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fopenmp",
    "-Wno-unused-function",
    "-Wno-ignored-attributes",
]
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}
ISA_NAMES = {v: k for k, v in ISAS.items()}
ENV_ISA = "MTP_KERNEL_ISA"
LIBRARY = "mtp_kernels.so"  # in build_dir(); LIBRARY + CHECKSUM beside it holds its sha256
CHECKSUM = ".sha256"

_lock = threading.Lock()
_state: dict = {}


class KernelError(RuntimeError):
    """The kernels did not build or load (the message is one line)."""


def _say(msg: str) -> None:
    print(f"mtp: kernels: {msg}", file=sys.stderr)


def _compiler() -> str | None:
    cxx = os.environ.get("CXX") or "c++"
    return shutil.which(cxx) or (shutil.which("g++") if not os.environ.get("CXX") else None)


def _torch_paths() -> tuple[list[str], str]:
    root = Path(torch.__file__).parent
    inc = root / "include"
    return [str(inc), str(inc / "torch" / "csrc" / "api" / "include")], str(root / "lib")


def _compiler_id(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout.split(
            "\n"
        )[0]
    except (OSError, subprocess.SubprocessError):
        return cxx


def build_dir(cxx: str) -> Path:
    """Where the build for this source, these flags, this compiler and this torch lives."""
    from mtp.core.runtime.artifacts import cache_root

    h = hashlib.sha256()
    for part in (
        *(p.read_bytes() for p in SOURCES),
        *(p.read_bytes() for p in HEADERS),
        " ".join(CFLAGS).encode(),
        _compiler_id(cxx).encode(),
        torch.__version__.encode(),
        str(torch._C._GLIBCXX_USE_CXX11_ABI).encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return cache_root() / "kernels" / f"matmul-{h.hexdigest()[:16]}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 20):
            h.update(b)
    return h.hexdigest()


def _checksum_file(lib: Path) -> Path:
    return lib.with_name(lib.name + CHECKSUM)


def damage(lib: Path) -> str | None:
    """Why the cached library `lib` must not be loaded (rebuilt instead), or None when it is whole:
    its sha256 equals the one its build wrote beside it. Reads the file, never loads it (a truncated
    shared library kills the process with SIGBUS inside the dynamic loader)."""
    if not lib.exists():
        return "missing"
    try:
        want = _checksum_file(lib).read_text().strip()
    except FileNotFoundError:
        return f"no {lib.name}{CHECKSUM} beside it: built by an older mtp, unverified"
    except (OSError, UnicodeDecodeError) as e:
        return f"its checksum file does not read ({e})"
    try:
        have = _sha256(lib)
    except OSError as e:
        return f"it does not read ({e.strerror or e})"
    if have != want:
        size = lib.stat().st_size
        return f"{size:,} bytes whose sha256 is not the one its build recorded: truncated or overwritten"
    return None


def _build(cxx: str, out: Path) -> None:
    """Compile the source into `out`, then write its checksum (`damage` reads it). Atomic: the library
    is compiled under a temporary name and renamed; the old checksum goes first and the new one comes
    last, so a reader never finds a checksum matching anything but a whole library. A failure is one
    KernelError line with the compiler's reason (its first error line, or its exit status)."""
    includes, libdir = _torch_paths()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = [
        cxx,
        *CFLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{p}" for p in includes),
        *(str(p) for p in SOURCES),
        "-o",
        str(tmp),
        f"-L{libdir}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{libdir}",
    ]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        tmp.unlink(missing_ok=True)
        raise KernelError(f"{cxx} did not run ({e})") from None
    names = ", ".join(p.name for p in SOURCES)
    log = out.parent / "build.log"
    if r.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        lines = [ln.strip() for ln in (r.stderr + "\n" + r.stdout).splitlines() if ln.strip()]
        err = next((ln for ln in lines if "error" in ln), lines[0] if lines else "")
        status = f"exit status {r.returncode}" if r.returncode else f"exit status 0 but no {tmp.name} written"
        err = f"{err} ({status})" if err else f"{status}, no output"
        log.write_text(" ".join(cmd) + "\n\n" + r.stderr + r.stdout)
        raise KernelError(f"compiling {names} with {cxx} failed: {err} (log: {log})")
    digest = _sha256(tmp)
    _checksum_file(out).unlink(missing_ok=True)
    os.replace(tmp, out)
    sums = _checksum_file(out)
    sums_tmp = sums.with_name(f".{sums.name}.{os.getpid()}.tmp")
    sums_tmp.write_text(digest + "\n")
    os.replace(sums_tmp, sums)


def _ensure_built(cxx: str) -> Path:
    """The path of a whole library for `cxx` (`damage` finds nothing wrong with it), compiled first
    when it is missing or damaged; one line on stderr says which, and that the cache is mtp's own."""
    folder = build_dir(cxx)
    lib = folder / LIBRARY
    if damage(lib) is None:
        return lib
    try:
        from mtp.core.runtime.artifacts import exclusive_lock

        waiting = f"kernels: another mtp process is building the kernels in {folder}; waiting for it"
        with exclusive_lock(folder / ".build.lock", waiting):
            why = damage(lib)  # another process may have built it while we waited
            if why == "missing":
                _say(f"compiling the C++ kernels with {cxx} into {folder} (once per cache; a minute or two)")
            elif why is not None:
                _say(f"the cached library {lib} is damaged ({why}); rebuilding it (mtp's own cache)")
            if why is not None:
                _build(cxx, lib)
    except OSError as e:
        raise KernelError(f"cannot write the kernel cache {folder} ({e.strerror or e})") from None
    return lib


def load(quiet: bool = False) -> bool:
    """Build (first time, or when the cached library is damaged) and load the ops; True when
    `torch.ops.mtp.*` are there. On failure one line on stderr names the reason and the fallback
    (unless `quiet`), once per process."""
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        ok, why = False, ""
        if os.environ.get("MTP_KERNELS", "").lower() in ("0", "off", "no", "false"):
            why = "MTP_KERNELS=0"
        elif missing := [p.name for p in (*SOURCES, *HEADERS) if not p.exists()]:
            why = f"the kernel sources {', '.join(missing)} are missing from the installed package"
        elif (cxx := _compiler()) is None:
            why = f"no C++ compiler ({os.environ.get('CXX') or 'c++'} not found)"
        else:
            lib = None
            try:
                lib = _ensure_built(cxx)
                torch.ops.load_library(str(lib))
                ok = True
                _state["lib"] = str(lib)
            except KernelError as e:
                why = str(e)
            except (OSError, RuntimeError) as e:
                reason = str(e).splitlines()[0] if str(e) else type(e).__name__
                if lib is None:  # the cache could not be read
                    why = f"the kernel cache is not usable ({reason})"
                else:
                    why = f"the built library {lib} does not load ({reason}; delete {lib.parent} to rebuild it)"
        if not ok and not quiet:
            _say(f"{why}; using the pure-torch path (rows one at a time through F.linear on float32 weights)")
        _state["ok"], _state["why"] = ok, why
        return ok


def library() -> str:
    """The loaded library's path (its folder names the build: sources, flags, compiler, torch), or ""."""
    return _state.get("lib", "")


def loaded() -> bool:
    """Whether the ops are loaded in this process already (never builds or loads them)."""
    return _state.get("ok", False)


def available() -> bool:
    return load() if "ok" not in _state else _state["ok"]


def why_unavailable() -> str:
    return _state.get("why", "")


def best_isa() -> int:
    """The best ISA path this CPU runs (0 scalar, 1 avx2, 2 avx512); needs the ops loaded."""
    if "best" not in _state:
        _state["best"] = int(torch.ops.mtp.cpu_isa())
    return _state["best"]


def best_isa_int8() -> int:
    """The best ISA path of the int8-activation ops (their AVX-512 path needs VNNI as well)."""
    if "best_i8" not in _state:
        _state["best_i8"] = int(torch.ops.mtp.cpu_isa_i8())
    return _state["best_i8"]


def resolve_isa(isa: str | int | None = None, int8: bool = False) -> int:
    """The ISA path to run: `isa` if given (a name or number; one this CPU lacks is a ValueError),
    else `MTP_KERNEL_ISA` (one this CPU lacks: one line on stderr, the best path runs), else the best.
    `int8`: for the int8-activation ops."""
    if isa is None:  # the hot path: one lookup per call
        env = os.environ.get(ENV_ISA, "")
        hit = _resolved.get((env, int8))
        if hit is None:
            hit = _resolved[(env, int8)] = _resolve_env(env, int8)
        return hit
    best = best_isa_int8() if int8 else best_isa()
    n = ISAS.get(isa) if isinstance(isa, str) else isa
    if n not in ISA_NAMES:
        raise ValueError(f"unknown kernel ISA {isa!r}: expected one of {', '.join(ISAS)}")
    if n > best:
        raise ValueError(
            f"kernel ISA {ISA_NAMES[n]} is not supported by this CPU{' for int8 activations' if int8 else ''} "
            f"(best: {ISA_NAMES[best]})"
        )
    return n


_resolved: dict = {}


def _resolve_env(env: str, int8: bool) -> int:
    best = best_isa_int8() if int8 else best_isa()
    env = check_isa_env(env)
    if env == "auto":
        return best
    if ISAS[env] > best:
        if not _state.get("warned_isa"):
            _say(f"{ENV_ISA}={env} but this CPU lacks it; running the {ISA_NAMES[best]} path")
            _state["warned_isa"] = True
        return best
    return ISAS[env]


def check_isa_env(env: str | None = None) -> str:
    """`MTP_KERNEL_ISA` (or `env`) as a path name, "auto" when unset; a name that is no path is a
    ValueError. Reads no ops, so a command checks it before any work."""
    raw = os.environ.get(ENV_ISA, "") if env is None else env
    name = raw.strip().lower() or "auto"
    if name != "auto" and name not in ISAS:
        raise ValueError(f"{ENV_ISA}={raw!r}: expected one of {', '.join(ISAS)}, auto")
    return name


def supported_isas() -> list[str]:
    """The ISA paths this CPU runs, e.g. ['scalar', 'avx2', 'avx512'] (empty without the ops)."""
    return [ISA_NAMES[i] for i in range(best_isa() + 1)] if available() else []
