"""MKL's own fast kernels on AMD CPUs.

torch's CPU wheels link Intel's MKL as their BLAS. MKL asks one exported function,
`mkl_serv_intel_cpu_true`, whether the CPU is Intel's before it looks at the CPU's features:
on any other vendor it takes its generic AVX2 code, even on an AMD EPYC with AVX-512 (Zen 4
and 5). There its Intel path runs float32 products 2.2x as fast (sgemm 111 -> 247 GFLOP/s on
one Zen 5 core) and torch's float32 attention 2x (the flash kernel's blocks are MKL
products). A library that defines that function to say yes, loaded into the process's global
scope before torch is, answers in its place (torch calls it through its symbol table); MKL
then chooses among its kernels by the CPU's features as it does on Intel's, so it never
runs an instruction the CPU lacks.

The library is one line of C, compiled once with the system's C compiler (the one
`torch.compile` needs too) into batchserve's cache; `apply` decides, builds and loads it,
and keeps what it did in words: a CPU device's model logs that as it loads (`outcome`), not
the launcher, whose start-up errors are one line. The launcher calls it before anything
imports torch; a process that imported torch already is left as it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from .cpu import cpu_vendor

SOURCE = b"int mkl_serv_intel_cpu_true(void) { return 1; }\n"
"""The whole library: MKL's vendor question, answered yes."""
NAME = f"mkl-intel-paths-{hashlib.sha256(SOURCE).hexdigest()[:12]}.so"
COMPILE_TIMEOUT_S = 60.0

_outcome: list[str] = []
"""What `apply` did in this process, in words (at most one entry): the library is loaded
once into a process, so its record is the process's too."""


def reason_not(
    *, vendor: str, machine: str, modules: Mapping[str, object], torch_installed: bool
) -> str | None:
    """Why the library is not wanted here, or None: wanted."""
    if vendor != "AuthenticAMD" or machine != "x86_64":
        return f"not an AMD x86-64 CPU ({vendor or 'vendor unknown'}, {machine})"
    if not torch_installed:
        return "torch is not installed"
    if "torch" in modules:
        return "torch was imported before the launcher could load it"
    return None


def build(folder: Path, compiler: str, run: Callable[..., object] = subprocess.run) -> Path:
    """The library in `folder`, compiled unless it is there already; written under a name of
    its own and renamed into place, so that servers starting at once never load half a file."""
    target = folder / NAME
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{NAME}.{os.getpid()}"
    try:
        run(
            [compiler, "-shared", "-fPIC", "-O2", "-x", "c", "-", "-o", str(partial)],
            input=SOURCE, check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S,
        )  # fmt: skip
        partial.replace(target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    return target


def c_compiler() -> str | None:
    """$CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def load(library: Path) -> None:
    """Into the global scope, where torch's libraries find the function first."""
    ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL | os.RTLD_NOW)


def outcome() -> str | None:
    """What `apply` did in this process, in words; None: it was not called."""
    return _outcome[0] if _outcome else None


def apply(cache: Path | None) -> str:
    """MKL's Intel paths for this process where they are wanted and can be had: the library
    kept in `cache` (None: built in a temporary folder, removed once loaded). Returns what
    it did, in words, and keeps that for `outcome`."""
    said = _apply(cache)
    _outcome[:] = [said]
    return said


def _apply(cache: Path | None) -> str:
    why = reason_not(
        vendor=cpu_vendor(), machine=platform.machine(), modules=sys.modules,
        torch_installed=importlib.util.find_spec("torch") is not None,
    )  # fmt: skip
    if why is not None:
        return f"MKL keeps its own code choice: {why}"
    compiler = c_compiler()
    if compiler is None:
        return "MKL keeps its generic AVX2 code on this AMD CPU: no C compiler (cc) to build" \
            " the library that lets it run its Intel paths"  # fmt: skip
    try:
        where = built_and_loaded(cache, compiler)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"MKL keeps its generic AVX2 code on this AMD CPU: the library failed ({exc})"
    return f"MKL runs its Intel code paths on this AMD CPU, chosen by the CPU's features ({where})"


def built_and_loaded(
    cache: Path | None,
    compiler: str,
    run: Callable[..., object] = subprocess.run,
    loader: Callable[[Path], None] = load,
) -> str:
    """The library built and loaded: kept in `cache`, or, where that is None or cannot be
    written (a read-only home in a container), built in a temporary folder removed once it
    is loaded. Returns where it came from, in words."""
    if cache is not None:
        try:
            library = build(cache, compiler, run)
        except OSError:
            pass  # the cache cannot be written: a temporary folder will do
        else:
            loader(library)
            return str(library)
    with tempfile.TemporaryDirectory() as folder:
        loader(build(Path(folder), compiler, run))
    return "built in a temporary folder"
