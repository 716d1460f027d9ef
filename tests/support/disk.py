"""Folders that fail the way a full or a read-only disk does, whichever user runs the tests.

A tmpfs small enough to fill needs root to mount, and root writes into a folder of mode
0o500 anyway, so both are faked at the system calls the probe (``durable.writable_problem``)
and every other writer go through: only for files under the given folder, the rest of the
process is untouched.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest


def _error(code: int, path: object = None) -> OSError:
    return OSError(code, os.strerror(code), *(() if path is None else (os.fspath(path),)))  # type: ignore[arg-type]


def _fd_under(fd: Any, root: Path) -> bool:
    fd = fd if isinstance(fd, int) else fd.fileno()
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(root)
    except OSError:
        return False


def fill(monkeypatch: pytest.MonkeyPatch, root: Path, at: str = "write") -> None:
    """``root`` is on a full disk: a file can still be created (an empty file takes no data
    block, only an inode) but data written into one fails with ENOSPC, at ``write`` or, as
    some file systems report it, at ``fsync``."""
    root = root.resolve()
    real_write, real_fsync = os.write, os.fsync

    def write(fd: int, data: Any) -> int:
        if at == "write" and len(data) and _fd_under(fd, root):
            raise _error(errno.ENOSPC)
        return real_write(fd, data)

    def fsync(fd: Any) -> None:
        if at == "fsync" and _fd_under(fd, root):
            raise _error(errno.ENOSPC)
        real_fsync(fd)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)


def read_only(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """``folder`` (created) is mode 0o500: no file can be created in it. Root is not held
    back by the mode, so for root creating a file there fails with EACCES as it would for
    anyone else."""
    folder.mkdir(parents=True, exist_ok=True)
    folder = folder.resolve()
    folder.chmod(0o500)
    if os.geteuid() != 0:
        return
    real_open = os.open

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_CREAT and Path(os.path.abspath(path)).parent == folder:
            raise _error(errno.EACCES, path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
