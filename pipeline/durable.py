"""fsync for files and folders: what makes a rename or an append survive a power cut."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync persists the names in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def writable_problem(path: Path) -> str | None:
    """Why ``path`` (created if missing) cannot take files, or None. Components check their
    state folders at start-up so a bad path is one clear line, not a traceback from deep
    inside Kafka, Faust or Delta start-up."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return f"{path} is not writable ({exc.strerror or exc})"
    return None
