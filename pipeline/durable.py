"""Files that survive: fsync for files and folders (what makes a rename or an append survive
a power cut), content hashes, and a writability check for state folders."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync persists the names in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so a reader sees the old or the new bytes, never a mix,
    and the new ones survive a power cut (temp file, fsync, rename, fsync the folder)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


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
