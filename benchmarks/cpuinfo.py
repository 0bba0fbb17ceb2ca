"""The CPU that measured: its model, its cores and its vector flags, printed beside every
language-model number, since bf16, AMX or AVX-512 change those numbers several-fold."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batchserve.models import mkl_paths
from batchserve.models.cpu import cpu_flags, cpu_model, has_bf16

VECTOR = ("sse4", "avx", "fma", "f16c", "amx")
"""The flags that decide a model's speed: SIMD width, bf16, AMX tiles."""


def describe() -> str:
    """One line: model, the machine's cores, bf16 or not, the vector flags; and in a process
    that calls a model directly, which MKL kernels it runs (mkl_first.py)."""
    flags = cpu_flags()
    vector = sorted(flag for flag in flags if flag.startswith(VECTOR))
    bf16 = "native bf16" if has_bf16(flags) else "no bf16"
    line = f"CPU: {cpu_model()}, {os.cpu_count()} cores, {bf16}; flags: {' '.join(vector)}"
    mkl = mkl_paths.outcome()
    return line if mkl is None else f"{line}; {mkl}"


if __name__ == "__main__":
    print(describe())
