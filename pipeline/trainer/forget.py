"""The trainer's part of ``liverl forget``: sessions' rows in version folders.

A version folder keeps its lake rows (``vN/trainer/trajectories.parquet``, written by
:func:`.publish.write_folder_rows`) so that a restart can finish publishing them; they hold
the sessions' prompts and answers, so a forget rewrites them and the manifest's sha256
follows. Beside :mod:`.checkpoint` and :mod:`.publish`, which own that layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from pipeline.trainer import checkpoint as ck


@dataclass
class VersionHit:
    folder: Path
    rows: int


def trajectory_files(roots: Iterable[Path]) -> Iterator[Path]:
    """The trajectory file of every version folder of every policy under ``roots``."""
    from pipeline.trainer.publish import TRAJ_FILE  # loads the trainer (torch) only when used

    for root in roots:
        if not root.is_dir():
            continue
        for policy in sorted(p.name for p in root.iterdir() if p.is_dir()):
            for v in ck.versions(root, policy):
                f = ck.version_dir(root, policy, v) / ck.TRAINER_DIR / TRAJ_FILE
                if f.is_file():
                    yield f


def survey(roots: Iterable[Path], sessions: list[str]) -> list[VersionHit]:
    """The version folders under the weights ``roots`` holding rows of the sessions."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    hits = []
    wanted = pa.array(sessions, pa.string())
    for f in trajectory_files(roots):
        col = pq.read_table(f, columns=["session_id"]).column("session_id")
        n = pc.sum(pc.is_in(col, value_set=wanted)).as_py() or 0
        if n:
            hits.append(VersionHit(f.parent.parent, int(n)))
    return hits


def erase(hit: VersionHit, sessions: list[str]) -> int:
    """The folder's trajectory rows without the sessions; the manifest follows the new file.
    Returns the rows removed.

    Two renames (rows, then manifest): a trainer starting between them would take this version
    as corrupt, so folders are rewritten oldest first and only those holding the sessions."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from pipeline.durable import atomic_write, replacing, sha256_file
    from pipeline.trainer.publish import TRAJ_FILE

    f = hit.folder / ck.TRAINER_DIR / TRAJ_FILE
    table = pq.read_table(f)
    drop = pc.is_in(table.column("session_id"), value_set=pa.array(sessions, pa.string()))
    keep = table.filter(pc.invert(pc.fill_null(drop, False)))
    manifest = ck.Manifest.from_json((hit.folder / ck.MANIFEST).read_bytes())
    rel = f.relative_to(hit.folder).as_posix()
    with replacing(f) as tmp:
        pq.write_table(keep, tmp)
        for entry in manifest.trainer_files:
            if entry["path"] == rel:
                entry["sha256"], entry["bytes"] = sha256_file(tmp), tmp.stat().st_size
    atomic_write(hit.folder / ck.MANIFEST, manifest.to_json())
    return table.num_rows - keep.num_rows
