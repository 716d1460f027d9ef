"""Puts the repository root on ``sys.path`` so benchmarks share ``tests/support`` (example
events, a gateway served in a thread) with the tests: fixtures, not part of the package.
Benchmarks run as ``python bench/<name>.py``, which puts only ``bench/`` on the path."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
