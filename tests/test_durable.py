"""pipeline.durable: atomic replacement of files and folders, with the fsyncs in order."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline import durable
from tests.support.disk import fill, read_only


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every fsync and rename, in order, as ``fsync:<name>`` / ``rename:<src>-><dst>``."""
    calls: list[str] = []
    real_fsync, real_replace, real_rename = durable.fsync_path, os.replace, os.rename

    def fsync(path: Path) -> None:
        calls.append(f"fsync:{Path(path).name}")
        real_fsync(path)

    def replace(src: object, dst: object) -> None:
        calls.append(f"rename:{Path(str(src)).name}->{Path(str(dst)).name}")
        real_replace(src, dst)  # type: ignore[arg-type]

    def rename(src: object, dst: object) -> None:
        calls.append(f"rename:{Path(str(src)).name}->{Path(str(dst)).name}")
        real_rename(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(durable, "fsync_path", fsync)
    monkeypatch.setattr(durable.os, "replace", replace)
    monkeypatch.setattr(durable.os, "rename", rename)
    return calls


def test_atomic_write_syncs_the_file_then_renames_then_syncs_the_folder(
    tmp_path: Path, synced: list[str]
) -> None:
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    durable.atomic_write(target, b"new")
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]  # no temp file left
    tmp = synced[0].removeprefix("fsync:")
    assert tmp.startswith(".state.json.") and tmp.endswith(".tmp")
    assert synced == [f"fsync:{tmp}", f"rename:{tmp}->state.json", f"fsync:{tmp_path.name}"]


def test_sync_folder_false_skips_only_the_folder_fsync(tmp_path: Path, synced: list[str]) -> None:
    durable.atomic_write(tmp_path / "pos", b"1", sync_folder=False)
    assert [c.split(":")[0] for c in synced] == ["fsync", "rename"]
    assert (tmp_path / "pos").read_bytes() == b"1"


def test_an_error_in_the_block_keeps_the_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "table.parquet"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), durable.replacing(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer died")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["table.parquet"]


def test_a_failed_rename_removes_the_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "busy"
    (target / "inside").mkdir(parents=True)  # a non-empty folder cannot be replaced by a file
    with pytest.raises(OSError):
        durable.atomic_write(target, b"x")
    assert [p.name for p in tmp_path.iterdir()] == ["busy"]


def test_two_writers_of_one_path_use_different_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    with durable.replacing(target) as a, durable.replacing(target) as b:
        assert a != b
        a.write_bytes(b"A")
        b.write_bytes(b"B")
    assert target.read_bytes() == b"A"  # the outer block ends last: its whole file wins


def test_publish_folder_syncs_everything_inside_before_the_rename(
    tmp_path: Path, synced: list[str]
) -> None:
    tmp = tmp_path / ".tmp-v1"
    (tmp / "trainer").mkdir(parents=True)
    (tmp / "weights.bin").write_bytes(b"w")
    (tmp / "trainer" / "optimizer.pt").write_bytes(b"o")
    durable.publish_folder(tmp, tmp_path / "v1", before_rename=lambda: synced.append("hook"))
    assert (tmp_path / "v1" / "trainer" / "optimizer.pt").read_bytes() == b"o"
    assert not tmp.exists()
    hook = synced.index("hook")
    assert set(synced[:hook]) == {
        "fsync:weights.bin",
        "fsync:optimizer.pt",
        "fsync:trainer",
        "fsync:.tmp-v1",
    }
    # A folder is synced after its entries; the top folder last.
    assert synced.index("fsync:optimizer.pt") < synced.index("fsync:trainer")
    assert synced[hook - 1] == "fsync:.tmp-v1"
    assert synced[hook + 1 :] == ["rename:.tmp-v1->v1", f"fsync:{tmp_path.name}"]


def test_publish_folder_refuses_an_existing_version(tmp_path: Path) -> None:
    (tmp_path / "v1" / "x").mkdir(parents=True)
    (tmp_path / "new").mkdir()
    with pytest.raises(OSError):
        durable.publish_folder(tmp_path / "new", tmp_path / "v1")
    assert (tmp_path / "v1" / "x").is_dir()


@pytest.mark.parametrize("at", ["write", "fsync"])
def test_the_writability_probe_finds_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: str
) -> None:
    """Issue 37: the probe wrote an empty file, which a full disk still creates (it takes no
    data block), so `broker up` passed it and failed at its next write with a traceback.
    Now the probe writes data and syncs it: a full disk, reported at the write or at the
    fsync, is a problem naming the folder, and the probe file is gone either way."""
    full = tmp_path / "full"
    assert durable.writable_problem(full) is None  # the same folder, before the disk fills
    fill(monkeypatch, full, at=at)
    problem = durable.writable_problem(full)
    assert problem == f"{full} is not writable (No space left on device)"
    assert list(full.iterdir()) == []
    assert durable.writable_problem(tmp_path / "elsewhere") is None


def test_the_writability_probe_finds_a_read_only_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "ro"
    read_only(monkeypatch, folder)
    assert durable.writable_problem(folder) == f"{folder} is not writable (Permission denied)"
