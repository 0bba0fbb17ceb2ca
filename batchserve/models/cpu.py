"""A CPU device's setup: how many cores compute, which ones, and what its instructions allow.

torch's intra-op threads are set per process but take their cores from the thread that first
runs a parallel region: so `pin_compute` runs on the device's own thread before its model
loads, narrowing that thread to the compute cores (the OpenMP workers it starts inherit
them) and, where cores are left over, moving the event loop's thread onto those, so a step's
workers and the loop never take each other's core.

`--cpu-threads 0` (the default) computes on every core but the loop's where there are three
or more; on two, on both, the loop sharing: it mostly waits while a step runs, and on this
repository's 2-core machine two threads made 1.3-1.65x one's tokens/s when the machine was
quiet. Busy with other processes, two lost 2-8x (an OpenMP step waits at each barrier for a
thread something else preempted): a shared machine wants `--cpu-threads 1`
(benchmarks/LLM.md, section 10c).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Mapping, MutableMapping, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import StartupError

KERNEL_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
"""oneDNN's cache of compiled kernels and ideep's of the computations holding them, both keyed
by shape and 1,024 entries by default: a kernel is freed only once both have let it go."""
KERNEL_CACHE_ENTRIES = 64
"""Each cache's bound here: about a dozen step sizes of a Llama's five products."""

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""Either one: the CPU multiplies bf16 natively (oneDNN's bf16 kernels use it)."""


@dataclass(frozen=True, slots=True)
class CorePlan:
    """The cores a CPU device computes on, and those the event loop keeps (empty: it
    shares the compute cores)."""

    compute: frozenset[int]
    loop: frozenset[int]


def plan_cores(threads: int, allowed: Set[int]) -> CorePlan:
    """`threads` compute cores out of `allowed` (the process's), the lowest left to the
    loop. 0: every core but one, where there are three or more; all of them on two or one."""
    cores = sorted(allowed)
    if threads < 0:
        raise StartupError(f"--cpu-threads {threads}: give 0 (every core but the loop's) or more")
    if threads > len(cores):
        raise StartupError(
            f"--cpu-threads {threads}: this process may run on {len(cores)} cores"
            f" ({_ranges(cores)})"
        )
    if threads == 0:
        threads = len(cores) - 1 if len(cores) >= 3 else len(cores)
    compute = frozenset(cores[len(cores) - threads :])
    return CorePlan(compute, frozenset(cores) - compute)


def pin_compute(torch: Any, threads: int, *, loop_thread: int | None = None) -> CorePlan:
    """On the device's thread, before its model loads: this thread and torch's intra-op
    threads on the planned compute cores, and the loop's thread (the main thread's by
    default) on the rest, where any are left."""
    plan = plan_cores(threads, os.sched_getaffinity(0))
    os.sched_setaffinity(0, plan.compute)
    torch.set_num_threads(len(plan.compute))
    if plan.loop:
        loop = threading.main_thread().native_id if loop_thread is None else loop_thread
        if loop is not None and loop != threading.get_native_id():
            os.sched_setaffinity(loop, plan.loop)
    return plan


def bound_kernel_caches(env: MutableMapping[str, str] = os.environ) -> None:
    """Bounds the kernel caches, unless the operator set them: read at oneDNN's first use,
    so before the model loads. Every step size (its rows: decodes plus a prefill chunk) gets
    kernels of its own; at the default 1,024 entries each, SmolLM2's server grew by
    hundreds of MiB over a few thousand varied prompts before it levelled off."""
    for name in KERNEL_CACHES:
        env.setdefault(name, str(KERNEL_CACHE_ENTRIES))


MALLOC_SETTINGS = ((-3, 32 << 20), (-1, 256 << 20))
"""glibc's `mallopt` options and values: M_MMAP_THRESHOLD fixed at 32 MiB (its dynamic
ceiling), M_TRIM_THRESHOLD at 256 MiB."""
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
"""Where an operator tunes glibc's malloc themselves: then it is left as they set it."""


def keep_freed_memory(
    env: Mapping[str, str] = os.environ, mallopt: Callable[[int, int], int] | None = None
) -> bool:
    """Keeps a step's large temporaries in the heap once freed, unless the operator tuned
    malloc: answers whether glibc took the settings. A step allocates and frees its logits
    (rows x vocabulary floats: 6 MiB at 32 rows of SmolLM2) and a few like them; glibc gave
    that memory back to the kernel between steps and faulted it in again, page by page: 3,000
    minor faults and ~8 % of a 32-row step's CPU, ~90 faults with these settings (what a
    preloaded tcmalloc gives too). The cost: freed memory up to the largest step's stays
    with the process."""
    if any(name in env for name in MALLOC_ENV):
        return False
    if mallopt is None:
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
        if mallopt is None:  # not glibc
            return False
    return all([mallopt(option, value) == 1 for option, value in MALLOC_SETTINGS])


def _read_cpuinfo() -> str:
    return Path("/proc/cpuinfo").read_text()


def cpu_flags(read: Callable[[], str] = _read_cpuinfo) -> frozenset[str]:
    """The first processor's flags in /proc/cpuinfo (empty where there is none)."""
    return frozenset(_cpuinfo_field("flags", read).split())


def cpu_model(read: Callable[[], str] = _read_cpuinfo) -> str:
    """The first processor's model name in /proc/cpuinfo ("unknown" where there is none)."""
    return _cpuinfo_field("model name", read) or "unknown"


def cpu_vendor(read: Callable[[], str] = _read_cpuinfo) -> str:
    """The first processor's vendor_id in /proc/cpuinfo (GenuineIntel, AuthenticAMD), or
    empty where there is none."""
    return _cpuinfo_field("vendor_id", read)


def _cpuinfo_field(name: str, read: Callable[[], str]) -> str:
    """The first processor's `name` line's value in /proc/cpuinfo, or empty."""
    try:
        text = read()
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


def has_bf16(flags: Set[str]) -> bool:
    return not BF16_FLAGS.isdisjoint(flags)


def _ranges(cores: list[int]) -> str:
    return ",".join(map(str, cores))
