"""Each version's live outcome rate in words, for ``liverl versions`` and ``liverl report``
alike: the rows come from :func:`pipeline.versions.reading.version_rows` (the Wilson interval
from ``table.wilson``), the text from here, so the two commands never say it differently."""

from __future__ import annotations

import time
from typing import Any


def rate_text(o: dict[str, Any] | None) -> str:
    """``passed/total rate [lo, hi]`` of a row's ``outcomes`` ("unknown": none verified)."""
    if o is None:
        return "unknown"
    lo, hi = o["ci95"]
    return f"{o['passed']}/{o['total']} {o['rate']:.0%} [{lo:.0%}, {hi:.0%}]"


def _utc(ms: int | None) -> str:
    return "-" if ms is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000))


def outcome_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per version: status and flags, when it served, its live outcome rate with
    the 95 % Wilson interval (a session counts once per version)."""
    out = []
    for r in rows:
        flags = ",".join(f for f in ("live", "pinned", "withdrawn") if r[f])
        served = (
            "never served"
            if r["served_since_ms"] is None
            else f"served {_utc(r['served_since_ms'])} .. "
            f"{_utc(r['served_until_ms']) if r['served_until_ms'] else 'now'}"
        )
        out.append(
            f"v{r['version']} ({r['status']}{', ' + flags if flags else ''}): {served};"
            f" live outcome {rate_text(r['outcomes'])}"
        )
    return out
