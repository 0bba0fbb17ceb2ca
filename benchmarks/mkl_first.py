"""Imported before torch by the scripts that call a model directly: MKL's Intel code paths on
an AMD CPU, as the server's launcher sets them (batchserve/models/mkl_paths.py), so that the
model called directly runs the same kernels as the server it is compared with."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batchserve.models import mkl_paths

SAID = mkl_paths.apply()
