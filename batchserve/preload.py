"""The launcher's preloads: tcmalloc and Intel OpenMP, as vLLM recommends for its CPU build.

A library in LD_PRELOAD must be there when the process starts, so `batchserve` (with
`--preload on`) starts itself again once with it set: `preload_env` decides, from the
environment, the libraries found and those already loaded, and is pure so that tests drive
it on fake paths. `BATCHSERVE_PRELOADED` in the new environment keeps the second start from
doing it again, whatever it finds.

Where they come from: tcmalloc from Debian's libtcmalloc-minimal4 (or gperftools'
libtcmalloc), Intel OpenMP from the `intel-openmp` pip package, which puts libiomp5.so in the
environment's lib/.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

GUARD = "BATCHSERVE_PRELOADED"
"""Set in the environment of the process started with the preloads: what was preloaded."""

LIBRARIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tcmalloc", ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")),
    ("Intel OpenMP", ("libiomp5.so",)),
)
"""Each library by its name in the log line and the file names it may have, best first."""


def library_dirs(prefix: str = sys.prefix) -> list[str]:
    """Where to look: the environment's lib/ (pip's intel-openmp), then the system's."""
    return [
        f"{prefix}/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/lib",
    ]


def preload_env(
    env: Mapping[str, str],
    *,
    dirs: Sequence[str],
    exists: Callable[[str], bool],
    loaded: str,
) -> dict[str, str] | None:
    """The environment to start again with, or None: already started with the preloads,
    or nothing found that is not loaded already. `loaded` is /proc/self/maps' text."""
    if GUARD in env:
        return None
    current = [part for part in env.get("LD_PRELOAD", "").split(":") if part]
    found: list[str] = []
    for _, names in LIBRARIES:
        if any(name in loaded or any(p.endswith(name) for p in current) for name in names):
            continue
        path = next((f"{d}/{n}" for n in names for d in dirs if exists(f"{d}/{n}")), None)
        if path is not None:
            found.append(path)
    if not found:
        return None
    preload = ":".join(found + current)
    return {**env, "LD_PRELOAD": preload, GUARD: ":".join(found)}


def preloaded(env: Mapping[str, str]) -> str | None:
    """What a start with the preloads says it preloaded, in words; None: not such a start."""
    paths = env.get(GUARD)
    if paths is None:
        return None
    return ", ".join(f"{_name(path)} ({path})" for path in paths.split(":") if path)


def current_maps() -> str:
    try:
        return Path("/proc/self/maps").read_text()
    except OSError:
        return ""


def _name(path: str) -> str:
    base = path.rsplit("/", 1)[-1]
    return next((label for label, names in LIBRARIES if base in names), base)
