"""MKL's own fast kernels on AMD CPUs.

torch's CPU wheels link Intel's MKL as their BLAS. MKL asks one exported function,
`mkl_serv_intel_cpu_true`, whether the CPU is Intel's before it looks at the CPU's features:
on any other vendor it takes its generic AVX2 code, even on an AMD EPYC with AVX-512 (Zen 4
and 5). There its Intel path runs float32 products 2.2x as fast (sgemm 111 -> 247 GFLOP/s on
one Zen 5 core) and torch's attention 2-2.8x (the flash kernel's blocks are MKL products). A
library that defines that function to say yes, loaded into the process's global scope before
torch is, answers in its place (torch calls it through its symbol table); MKL then chooses
among its kernels by the CPU's features as it does on Intel's (seen: its AVX-512 path on a
Zen 5 whose flags have avx512f).

The library is one line of C, compiled at each start with the system's C compiler (the one
`torch.compile` needs too; about 30 ms) in a private temporary folder, loaded, and the
folder removed: a copy kept in a shared cache could be stale, half written by another
server or planted by another user. `apply` decides, builds and loads it, and keeps what it
did in words; a CPU device's model logs that as it loads (`report`), not the launcher,
whose start-up errors are one line. The launcher calls it before anything imports torch; a
process that imported torch already is left as it is.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from .cpu import cpu_vendor

log = logging.getLogger(__name__)

SOURCE = b"int mkl_serv_intel_cpu_true(void) { return 1; }\n"
"""The whole library: MKL's vendor question, answered yes."""
NAME = "mkl-intel-paths.so"
COMPILE_TIMEOUT_S = 60.0


class _Record:
    """What `apply` did in this process, in words, and whether `report` has logged it: the
    library is loaded into the process, so its record is the process's too."""

    said: str | None = None
    reported = False


_record = _Record()


def reason_not(
    *, vendor: str, machine: str, modules: Mapping[str, object], torch_installed: bool
) -> str | None:
    """Why the library is not wanted here, or None: wanted."""
    if vendor != "AuthenticAMD" or machine != "x86_64":
        return f"not an AMD x86-64 CPU ({vendor or 'vendor unknown'}, {machine})"
    if "torch" in modules:
        return "torch was imported before the launcher could load it"
    if not torch_installed:
        return "torch is not installed"
    return None


def build(folder: Path, compiler: str, run: Callable[..., object] = subprocess.run) -> Path:
    """The library compiled into `folder`."""
    target = folder / NAME
    run(
        [compiler, "-shared", "-fPIC", "-O2", "-x", "c", "-", "-o", str(target)],
        input=SOURCE, check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S,
    )  # fmt: skip
    return target


def c_compiler() -> str | None:
    """$CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def load(library: Path) -> None:
    """Into the global scope, where torch's libraries find the function first."""
    ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL | os.RTLD_NOW)


def built_and_loaded(
    compiler: str,
    run: Callable[..., object] = subprocess.run,
    loader: Callable[[Path], None] = load,
) -> None:
    """The library built in a private temporary folder, loaded, and the folder removed (a
    loaded library needs no file)."""
    with tempfile.TemporaryDirectory(prefix="batchserve-mkl-") as folder:
        loader(build(Path(folder), compiler, run))


def apply() -> str:
    """MKL's Intel paths for this process where they are wanted and can be had. Returns what
    it did, in words, and keeps that for `report`."""
    _record.said, _record.reported = _apply(), False
    return _record.said


def outcome() -> str | None:
    """What `apply` did in this process, in words; None: it was not called."""
    return _record.said


def report() -> None:
    """Logs what `apply` did in this process, once: each CPU model's load calls it."""
    if _record.said is not None and not _record.reported:
        log.info("%s", _record.said)
        _record.reported = True


def _apply() -> str:
    why = reason_not(
        vendor=cpu_vendor(), machine=platform.machine(), modules=sys.modules,
        torch_installed="torch" in sys.modules or importlib.util.find_spec("torch") is not None,
    )  # fmt: skip
    if why is not None:
        return f"MKL keeps its own code choice: {why}"
    compiler = c_compiler()
    if compiler is None:
        return "MKL keeps its generic AVX2 code on this AMD CPU: no C compiler (cc) to build" \
            " the library that lets it run its Intel paths"  # fmt: skip
    try:
        built_and_loaded(compiler)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"MKL keeps its generic AVX2 code on this AMD CPU: the library failed ({exc})"
    return "MKL runs its Intel code paths on this AMD CPU, chosen by the CPU's features"
