"""Versioned weight folders and their manifests: ``<weights_root>/<policy>/v<N>/``.

A version folder is written under a temporary name, every file and the folder are fsynced,
then it is renamed into place (atomic on POSIX) and the parent is fsynced: a reader sees
either no ``vN`` or a complete one. The manifest is the trainer's durable state: weights
(sha256 per file), parent, step and the input offsets consumed up to this version.
The ``trainer/`` subfolder holds what only the trainer needs (optimizer state, the lake rows
of this version, so a crash after the rename can still finish publishing them).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from pipeline.durable import fsync_path, publish_folder, sha256_file

MANIFEST = "manifest.json"
TRAINER_DIR = "trainer"
EVENTS_DONE = "events.done"
_VERSION_DIR = re.compile(r"^v(\d+)$")
_TMP_PREFIX = ".tmp-"


@dataclass
class Manifest:
    policy_id: str
    version: int
    parent: int | None
    step: int
    created_ms: int
    input_topic: str
    consumed_offsets: dict[str, int]  # partition -> next offset to consume
    files: list[dict[str, Any]]  # servable files: path, sha256, bytes
    trainer_files: list[dict[str, Any]] = field(default_factory=list)
    method: str = "rl"
    metrics: dict[str, Any] = field(default_factory=dict)
    # LoRA versions: the base the adapter applies to (path, fingerprint); None: full weights
    base_model: dict[str, str] | None = None

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        return cls(**orjson.loads(raw))

    def offsets(self) -> dict[int, int]:
        return {int(p): o for p, o in self.consumed_offsets.items()}


def policy_dir(root: Path, policy: str) -> Path:
    return Path(root) / policy


def version_dir(root: Path, policy: str, version: int) -> Path:
    return policy_dir(root, policy) / f"v{version}"


def _describe(base: Path, paths: list[Path]) -> list[dict[str, Any]]:
    out = []
    for p in sorted(paths):
        rel = p.relative_to(base).as_posix()
        out.append({"path": rel, "sha256": sha256_file(p), "bytes": p.stat().st_size})
    return out


def versions(root: Path, policy: str) -> list[int]:
    """Published versions (folders with a manifest), ascending."""
    base = policy_dir(root, policy)
    if not base.is_dir():
        return []
    found = []
    for child in base.iterdir():
        m = _VERSION_DIR.match(child.name)
        if m and (child / MANIFEST).is_file():
            found.append(int(m.group(1)))
    return sorted(found)


def read_manifest(root: Path, policy: str, version: int) -> Manifest:
    return Manifest.from_json((version_dir(root, policy, version) / MANIFEST).read_bytes())


def latest_manifest(root: Path, policy: str) -> Manifest | None:
    found = versions(root, policy)
    return read_manifest(root, policy, found[-1]) if found else None


def clean_temp(root: Path, policy: str) -> int:
    """Remove half-written folders left by a crash before the rename."""
    base = policy_dir(root, policy)
    removed = 0
    if base.is_dir():
        for child in base.iterdir():
            if child.name.startswith(_TMP_PREFIX):
                shutil.rmtree(child, ignore_errors=True)
                removed += 1
    return removed


def write_version(
    root: Path,
    manifest: Manifest,
    write_files: Callable[[Path], None],
    on_stage: Callable[[str], None] | None = None,
) -> Path:
    """Create ``vN`` atomically; ``write_files(tmp)`` writes servable files at the top and
    trainer-only files under ``trainer/``. Fills ``files``/``trainer_files`` of ``manifest``."""
    base = policy_dir(root, manifest.policy_id)
    base.mkdir(parents=True, exist_ok=True)
    target = base / f"v{manifest.version}"
    if target.exists():
        raise FileExistsError(f"{target} already exists; versions are never overwritten")
    tmp = base / f"{_TMP_PREFIX}v{manifest.version}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        (tmp / TRAINER_DIR).mkdir()
        write_files(tmp)
        all_files = [p for p in tmp.rglob("*") if p.is_file()]
        trainer = [p for p in all_files if p.relative_to(tmp).parts[0] == TRAINER_DIR]
        manifest.files = _describe(tmp, [p for p in all_files if p not in trainer])
        manifest.trainer_files = _describe(tmp, trainer)
        (tmp / MANIFEST).write_bytes(manifest.to_json())
        publish_folder(
            tmp,
            target,
            before_rename=None if on_stage is None else lambda: on_stage("before_rename"),
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def verify_version(directory: Path) -> Manifest:
    """Check every file's sha256 against the manifest; raise ValueError on a mismatch."""
    manifest = Manifest.from_json((directory / MANIFEST).read_bytes())
    for entry in [*manifest.files, *manifest.trainer_files]:
        actual = sha256_file(directory / entry["path"])
        if actual != entry["sha256"]:
            raise ValueError(f"{directory / entry['path']}: sha256 {actual} != {entry['sha256']}")
    return manifest


def newest_valid(
    root: Path, policy: str, on_invalid: Callable[[int, str], None] | None = None
) -> Manifest | None:
    """The manifest of the newest version whose files match it (None if none does).

    Newer versions that fail (a corrupt or missing file, an unreadable manifest) are reported
    through ``on_invalid(version, reason)`` and skipped: resuming from one would build on
    weights nobody can verify. Hashes every file of each version tried."""
    for version in reversed(versions(root, policy)):
        try:
            manifest = verify_version(version_dir(root, policy, version))
        except Exception as exc:  # noqa: BLE001 - any defect makes the version unusable
            if on_invalid is not None:
                on_invalid(version, f"{type(exc).__name__}: {exc}")
            continue
        if manifest.version == version and manifest.policy_id == policy:
            return manifest
        if on_invalid is not None:
            on_invalid(version, f"manifest says {manifest.policy_id} v{manifest.version}")
    return None


def mark_events_done(directory: Path) -> None:
    """Record that step 3 (events) finished, so recovery does not re-send them."""
    marker = directory / TRAINER_DIR / EVENTS_DONE
    marker.write_bytes(b"")
    with contextlib.suppress(OSError):
        fsync_path(marker.parent)


def events_done(directory: Path) -> bool:
    return (directory / TRAINER_DIR / EVENTS_DONE).exists()
