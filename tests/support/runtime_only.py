"""Run ``liverl`` as if only ``[project.dependencies]`` were installed.

``python tests/support/runtime_only.py <liverl args>`` installs an import hook that refuses
every top-level module whose distributions are all outside the runtime closure of
``pyproject.toml``'s ``[project.dependencies]`` (followed recursively through the installed
distributions' requirements, without extras, markers evaluated), then runs the CLI. The
project file, not the installed metadata, is the source: an editable install's metadata is
as old as its last ``pip install``. A module that only a dev extra brings (pytest, jsonschema,
schemathesis, mypy, ...) raises ``ModuleNotFoundError`` exactly as on a machine that ran the
README's ``pip install -e .``. The standard library and modules no distribution claims
(``pipeline`` itself) pass.
"""

from __future__ import annotations

import importlib.abc
import re
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def declared(pyproject: Path = PYPROJECT) -> list[Requirement]:
    with pyproject.open("rb") as f:
        return [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]


def runtime_closure(pyproject: Path = PYPROJECT) -> set[str]:
    """Normalised names of the distributions ``pip install -e .`` (no extras) brings."""
    seen: set[str] = set()
    todo = ["liverl"]  # the project itself (its metadata's requirements are not read)
    todo += [r.name for r in declared(pyproject) if r.marker is None or r.marker.evaluate()]
    while todo:
        name = _norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        if name == "liverl":
            continue
        try:
            reqs = distribution(name).requires or []
        except PackageNotFoundError:
            continue  # a marker-excluded or absent requirement: nothing of it can load
        for raw in reqs:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


class RuntimeOnly(importlib.abc.MetaPathFinder):
    def __init__(self, allowed: set[str]) -> None:
        self.owners = {top: {_norm(d) for d in ds} for top, ds in packages_distributions().items()}
        self.allowed = allowed
        self.refused: list[str] = []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        top = fullname.partition(".")[0]
        owners = self.owners.get(top)
        if top in sys.stdlib_module_names or not owners or owners & self.allowed:
            return None  # let the normal finders answer
        self.refused.append(top)
        raise ModuleNotFoundError(
            f"No module named {top!r} (runtime-only: it comes from {', '.join(sorted(owners))}, "
            "not from liverl's [project.dependencies])",
            name=top,
        )


def install() -> RuntimeOnly:
    finder = RuntimeOnly(runtime_closure())
    sys.meta_path.insert(0, finder)
    return finder


def check_all() -> dict[str, Any]:
    """Import every module of ``pipeline`` and run every command's ``--help``; what failed."""
    import importlib
    import pkgutil

    import click
    from click.testing import CliRunner

    import pipeline
    from pipeline.cli import cli

    broken: dict[str, str] = {}
    modules = [m.name for m in pkgutil.walk_packages(pipeline.__path__, "pipeline.")]
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            broken[name] = str(exc)

    helps: dict[str, int] = {}

    def walk(cmd: click.Command, path: list[str]) -> None:
        res = CliRunner().invoke(cli, [*path, "--help"])
        helps[" ".join(path) or "liverl"] = res.exit_code
        if res.exit_code != 0:
            broken[" ".join([*path, "--help"])] = res.output[-500:] + repr(res.exception)
        if isinstance(cmd, click.Group):
            for sub_name, sub in sorted(cmd.commands.items()):
                walk(sub, [*path, sub_name])

    walk(cli, [])
    return {"modules": len(modules), "helps": helps, "broken": broken}


if __name__ == "__main__":
    finder = install()
    if sys.argv[1:] == ["--check-all"]:
        import json

        try:
            import pytest  # noqa: F401  (dev-only: must be refused)

            control = "imported"
        except ModuleNotFoundError as exc:
            control = str(exc)
        print(json.dumps({**check_all(), "control": control, "refused": sorted(finder.refused)}))
    else:
        from pipeline.cli import cli

        cli(args=sys.argv[1:], prog_name="liverl")
