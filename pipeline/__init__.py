"""liverl: every agent interaction is an event; rewards, samples and weights follow on Kafka."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["Settings", "__version__", "load_settings"]


def __getattr__(name: str) -> Any:
    """``pipeline.Settings`` on first use: importing any module of the package must not load
    the composed settings and every component's section (they sit on top of the layers)."""
    if name in ("Settings", "load_settings"):
        from pipeline import settings

        return getattr(settings, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
