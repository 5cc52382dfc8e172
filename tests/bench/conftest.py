"""The bench/ modules are scripts, not a package: put bench/ (and the repo) on sys.path."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

importlib.import_module("benchutil")  # adds the repo root to sys.path too
