"""Samples seen by id: the trainer trains each sample event once, even when it arrives twice.

Sample ids are deterministic, so a processor that restarts mid-session and assembles a
session again sends the *same* sample again (at-least-once upstream). The trainer's
exactly-once protocol covers offsets on the samples topic, not ids; this window closes the
gap. It holds the newest ``capacity`` ids; after a restart it is seeded from the trajectory
rows kept in the newest version folders, so a duplicate is recognised across restarts too
(a sample read again because its step was never published is not in those rows, and is
rightly trained).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.trainer import checkpoint as ck
from pipeline.trainer.publish import TRAJ_FILE


@dataclass(eq=False)
class SeenIds:
    """A bounded insertion-ordered set of event ids."""

    capacity: int = 200_000
    _ids: OrderedDict[str, None] = field(default_factory=OrderedDict, init=False, repr=False)

    def __contains__(self, event_id: object) -> bool:
        return event_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, event_id: str) -> None:
        self._ids[event_id] = None
        self._ids.move_to_end(event_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def seed(self, weights_root: Path, policy: str, upto: int) -> int:
        """Ids trained (or recorded) by versions <= ``upto``, newest versions first, until
        the window is full; returns how many were added."""
        found: list[list[str]] = []
        total = 0
        for version in reversed([v for v in ck.versions(weights_root, policy) if v <= upto]):
            path = ck.version_dir(weights_root, policy, version) / ck.TRAINER_DIR / TRAJ_FILE
            if not path.is_file():
                continue
            ids = pq.read_table(path, columns=["event_id"]).column("event_id").to_pylist()
            found.append(ids)
            total += len(ids)
            if total >= self.capacity:
                break
        for ids in reversed(found):  # oldest first, so the newest stay in the window
            for event_id in ids:
                self.add(event_id)
        return min(total, self.capacity)
