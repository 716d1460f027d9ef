"""Load a ``bench/`` script as a module: what a benchmark runs lives once, in the benchmark,
and its test runs a short version of it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load(script: str) -> ModuleType:
    """``bench/<script>.py``, registered as ``liverl_bench_<script>`` (dataclasses resolve
    their module by name), once per test session."""
    name = f"liverl_bench_{script}"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / "bench" / f"{script}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
