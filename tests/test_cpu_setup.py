"""A CPU device's setup (#44): its compute threads pinned on its own thread, the loop kept off
them where cores are left over, bf16 only where the CPU has it, and the launcher's preloads
decided by a pure function on fake paths."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from batchserve import preload
from batchserve.cli import config_from_args
from batchserve.config import Config
from batchserve.errors import StartupError
from batchserve.models.cpu import (
    KERNEL_CACHE_ENTRIES,
    KERNEL_CACHES,
    MALLOC_SETTINGS,
    CorePlan,
    bound_kernel_caches,
    cpu_flags,
    cpu_model,
    cpu_vendor,
    keep_freed_memory,
    plan_cores,
)

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse sse2 avx avx2 fma avx512f {extra}

processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse sse2 avx avx2 fma avx512f {extra}
"""


def cpuinfo(extra: str = "") -> Callable[[], str]:
    return lambda: CPUINFO.format(extra=extra)


def test_the_thread_setting_parses_and_rejects_negatives() -> None:
    config, _ = config_from_args(["--cpu-threads", "2"])
    assert config.cpu_threads == 2
    assert Config().cpu_threads == 0
    with pytest.raises(StartupError, match="cpu_threads"):
        Config(cpu_threads=-1)


def test_the_default_leaves_the_loop_a_core_only_where_three_or_more() -> None:
    assert plan_cores(0, {0, 1, 2, 3}) == CorePlan(frozenset({1, 2, 3}), frozenset({0}))
    assert plan_cores(0, {0, 1}) == CorePlan(frozenset({0, 1}), frozenset())
    assert plan_cores(0, {5}) == CorePlan(frozenset({5}), frozenset())
    assert plan_cores(1, {0, 1}) == CorePlan(frozenset({1}), frozenset({0}))
    assert plan_cores(2, {2, 4, 6}) == CorePlan(frozenset({4, 6}), frozenset({2}))
    with pytest.raises(StartupError, match="may run on 2 cores"):
        plan_cores(3, {0, 1})


def on_thread(call: Callable[[], Any]) -> Any:
    """`call()` on a fresh thread, as a device's thread runs its factory."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()))
    thread.start()
    thread.join()
    return out[0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_load_pins_its_threads_and_keeps_the_loop_off_them(tmp_path, monkeypatch) -> None:
    """causal_lm.load, on the device's thread: torch's threads and that thread on the compute
    cores, before the model loads; the loop's thread (here a stand-in) on the core left."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from batchserve.models import causal_lm
    from batchserve.models.generators import GeneratorSettings

    from . import tiny_llama

    tok = tiny_llama.tokenizer()
    tiny_llama.model(len(tok), tok.eos_token_id).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cores = sorted(os.sched_getaffinity(0))
    loop_waits = threading.Event()
    loop = threading.Thread(target=loop_waits.wait)
    loop.start()
    before = torch.get_num_threads()
    seen: dict[str, Any] = {}
    original = causal_lm.pin_compute

    def pin(torch: Any, threads: int, *, loop_thread: int | None = None) -> Any:
        plan = original(torch, threads, loop_thread=loop.native_id)
        seen["loop"] = os.sched_getaffinity(loop.native_id or 0)
        return plan

    monkeypatch.setattr(causal_lm, "pin_compute", pin)
    for name in KERNEL_CACHES:
        monkeypatch.delenv(name, raising=False)
    try:
        settings = GeneratorSettings(
            model_path=str(tmp_path), dtype="float32", cpu_threads=1, compile_layers=False
        )  # the pinning is what is tested; test_layer_loop compiles

        def load() -> tuple[int, set[int], Any]:
            generator = causal_lm.load("cpu", settings)
            return torch.get_num_threads(), os.sched_getaffinity(0), generator

        threads, affinity, generator = on_thread(load)
    finally:
        loop_waits.set()
        loop.join()
        torch.set_num_threads(before)
    assert threads == 1
    assert affinity == {cores[-1]}
    assert seen["loop"] == set(cores[:-1])
    assert generator.model.dtype == torch.float32
    assert all(os.environ[name] == str(KERNEL_CACHE_ENTRIES) for name in KERNEL_CACHES)


def test_the_shape_keyed_kernel_caches_are_bounded_unless_the_operator_says() -> None:
    """#39.12: each step size compiles kernels that oneDNN and ideep cache by shape, 1,024
    of each by default: memory grew with every new mix of prompt lengths."""
    env: dict[str, str] = {}
    bound_kernel_caches(env)
    assert env == {name: str(KERNEL_CACHE_ENTRIES) for name in KERNEL_CACHES}
    chosen = {"LRU_CACHE_CAPACITY": "8"}
    bound_kernel_caches(chosen)
    assert chosen["LRU_CACHE_CAPACITY"] == "8"


def test_a_steps_freed_temporaries_stay_in_the_heap_unless_the_operator_tuned_malloc() -> None:
    """glibc gave a step's freed logits back to the kernel and faulted them in again at the
    next step (3,000 minor faults a 32-row step): the thresholds are fixed once, on glibc,
    and left alone where the operator set them."""
    calls: list[tuple[int, int]] = []

    def mallopt(option: int, value: int) -> int:
        calls.append((option, value))
        return 1

    assert keep_freed_memory({}, mallopt)
    assert calls == list(MALLOC_SETTINGS)
    for name in ("MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        calls.clear()
        assert not keep_freed_memory({name: "1"}, mallopt)
        assert calls == []
    assert not keep_freed_memory({}, lambda option, value: 0)  # refused: said so
    if os.confstr("CS_GNU_LIBC_VERSION"):  # the real glibc takes both values
        assert keep_freed_memory({})


def test_dtype_auto_is_bf16_only_where_the_cpu_has_it() -> None:
    torch = pytest.importorskip("torch")
    from batchserve.models.causal_lm import resolve_dtype

    for extra in ("avx512_bf16", "amx_bf16 amx_tile"):
        assert resolve_dtype(torch, "auto", "cpu", cpu_flags(cpuinfo(extra))) == "bfloat16"
    for extra in ("", "avx512_fp16 avx_vnni"):
        assert resolve_dtype(torch, "auto", "cpu", cpu_flags(cpuinfo(extra))) == "float32"
    # An explicit choice is honoured either way.
    with_bf16 = cpu_flags(cpuinfo("avx512_bf16"))
    assert resolve_dtype(torch, "float32", "cpu", with_bf16) == "float32"
    assert resolve_dtype(torch, "bfloat16", "cpu", frozenset()) == "bfloat16"


def test_cpuinfo_without_flags_or_a_file_reads_as_none() -> None:
    def missing() -> str:
        raise FileNotFoundError("/proc/cpuinfo")

    assert cpu_flags(missing) == frozenset()
    assert cpu_flags(lambda: "processor\t: 0\n") == frozenset()
    assert cpu_model(cpuinfo()) == "Intel(R) Xeon(R) Processor"
    assert cpu_model(missing) == "unknown"
    assert cpu_vendor(cpuinfo()) == "GenuineIntel"
    assert cpu_vendor(missing) == ""


TC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
IOMP = "/venv/lib/libiomp5.so"
DIRS = preload.library_dirs("/venv")


def decide(env: dict[str, str], files: set[str], loaded: str = "") -> dict[str, str] | None:
    return preload.preload_env(env, dirs=DIRS, exists=files.__contains__, loaded=loaded)


def test_the_launcher_preloads_what_is_installed_once() -> None:
    env = decide({"PATH": "/bin"}, {TC, IOMP})
    assert env is not None
    assert env["LD_PRELOAD"] == f"{TC}:{IOMP}"
    assert env["PATH"] == "/bin"
    # The process started so never starts again, and says what it got.
    assert decide(env, {TC, IOMP}) is None
    assert preload.preloaded(env) == f"tcmalloc ({TC}), Intel OpenMP ({IOMP})"
    assert preload.preloaded({}) is None


def test_the_launcher_skips_what_is_missing_or_loaded_and_keeps_a_users_preload() -> None:
    assert decide({}, set()) is None
    only = decide({"LD_PRELOAD": "/opt/mine.so"}, {IOMP})
    assert only is not None
    assert only["LD_PRELOAD"] == f"{IOMP}:/opt/mine.so"
    assert only[preload.GUARD] == IOMP
    maps = "7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10\n"
    assert decide({}, {TC}, loaded=maps) is None
    assert decide({"LD_PRELOAD": TC}, {TC}) is None
    gperf = "/usr/lib64/libtcmalloc.so.4"
    found = decide({}, {gperf})
    assert found is not None
    assert found["LD_PRELOAD"] == gperf
