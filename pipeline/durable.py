"""Files that survive: fsync for files and folders (what makes a rename or an append survive
a power cut), atomic replacement of a file or a folder, content hashes, and a writability
check for state folders. Every temp-file + fsync + rename in liverl goes through here."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import uuid
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def replacing(path: Path, *, sync_folder: bool = True) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; when the block ends normally, the temporary
    file (written by the caller, by any means) is fsynced and renamed over ``path``, then the
    folder is fsynced, so a reader sees the old or the new file, never a mix, and the new one
    survives a power cut. An exception removes the temporary file and leaves ``path`` alone.

    The temporary name is unique (two writers of one path never write into each other's
    file) and hidden (``.name.<hex>.tmp``: globs for ``*.log``, ``*.bad``, ... skip it).
    ``sync_folder=False`` leaves the rename itself to the next folder fsync, for a file whose
    older version after a crash is acceptable (the spool's position: records are re-sent)
    or whose caller fsyncs the folder once after several replacements."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    if sync_folder:
        fsync_path(path.parent)


def atomic_write(path: Path, data: bytes, *, sync_folder: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically and durably (see :func:`replacing`)."""
    with replacing(path, sync_folder=sync_folder) as tmp:
        tmp.write_bytes(data)


def publish_folder(
    tmp: Path, target: Path, *, before_rename: Callable[[], None] | None = None
) -> None:
    """Move the fully written folder ``tmp`` to ``target`` (same parent folder) so a reader
    sees no folder or a complete one: every file and folder under ``tmp`` is fsynced (so the
    rename cannot reach the disk before the bytes do), then the rename, then the parent's
    fsync. ``target`` must not exist (a rename onto an empty folder would replace it, so the
    caller checks). ``before_rename`` runs between the fsyncs and the rename (crash tests).
    The caller removes ``tmp`` if this raises."""
    for folder, _dirs, files in os.walk(tmp, topdown=False):
        for name in files:
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder))  # after its entries: the folder lists them durably
    if before_rename is not None:
        before_rename()
    os.rename(tmp, target)
    fsync_path(target.parent)


# What the writability probe writes: an empty file needs no data block, so it is created on a
# full disk too (issue 37: `broker up` then failed with a traceback at its first real write).
PROBE_BYTES = 64 * 1024


def writable_problem(path: Path) -> str | None:
    """Why ``path`` (created if missing) cannot take files, or None. Components check their
    state folders at start-up so a bad path is one clear line, not a traceback from deep
    inside Kafka, Faust or Delta start-up.

    The probe writes :data:`PROBE_BYTES` random bytes and fsyncs them, so a full disk fails
    it (random: a compressing file system would store zeros in no space), and is removed
    whatever happened."""
    probe = path / f".write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            data = memoryview(os.urandom(PROBE_BYTES))
            while data:
                written = os.write(fd, data)
                if written <= 0:  # never on Linux (ENOSPC is raised), but never loop for ever
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                data = data[written:]
            os.fsync(fd)  # some file systems report a full disk only here
        finally:
            os.close(fd)
    except OSError as exc:
        return f"{path} is not writable ({exc.strerror or exc})"
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
    return None
