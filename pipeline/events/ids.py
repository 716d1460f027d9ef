"""Event ids and timestamps.

Derived events get deterministic ids so that a replay of the same inputs under
the same config produces the same ids and idempotent sinks can drop duplicates.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterable
from typing import Any

import orjson


def derive_event_id(type: str, parents: Iterable[str], config_version: str, *extra: Any) -> str:
    """Deterministic id: first 32 hex chars of sha256 over a canonical JSON of the inputs.

    Parents are sorted, so the id does not depend on the order in which a join
    happened to receive them (which differs between live runs and replays).
    `extra` must be JSON-serializable (dict keys are sorted).
    """
    canonical = orjson.dumps(
        [type, sorted(parents), config_version, list(extra)],
        option=orjson.OPT_SORT_KEYS,
    )
    return hashlib.sha256(canonical).hexdigest()[:32]


def new_event_id() -> str:
    """Random id for root events (nothing to derive from, e.g. a live interaction)."""
    return uuid.uuid4().hex


def now_ms() -> int:
    """Wall-clock time in Unix epoch milliseconds."""
    return time.time_ns() // 1_000_000
