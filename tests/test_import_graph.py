"""The package's import graph has no circles, counting every import: module level, inside
functions and under ``TYPE_CHECKING``. A function-level import that dodges a cycle at run time
still ties the two modules together, so it counts. A package's ``__init__`` re-exporting its
own submodules (and a submodule importing names through its parent package) is a facade, not a
circle, and is left out."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "pipeline").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module of ``known`` that ``name`` imports anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in known else module)
    facade = {m for m in found if m.startswith(name + ".") or name.startswith(m + ".")}
    return {m for m in found if m in known and m != name} - facade


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_the_import_graph_has_no_cycles() -> None:
    try:
        graphlib.TopologicalSorter(graph()).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(exc.args[1])}")


def test_a_cycle_is_found() -> None:
    """The check itself: a function-level import back into an importer is a cycle."""
    g = graph()
    g["pipeline.serving.protocol"] = g["pipeline.serving.protocol"] | {"pipeline.serving.app"}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(g).prepare()
    assert "pipeline.serving.protocol" in g["pipeline.serving.app"]


def test_benchmarks_do_not_import_the_tests() -> None:
    """Shared helpers live in the package (or in bench/): tests are not a library."""
    offenders = []
    for path in (ROOT / "bench").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [f"{path.name}: {m}" for m in mods if m.split(".")[0] == "tests"]
    assert offenders == []


# The command layer: it reads the settings file and hands each component its sections.
# ``pipeline.forget`` is the ``liverl forget`` command with the walk over every store it
# orchestrates, so it reads the composition too.
COMMAND_LAYER = {"pipeline.cli", "pipeline.forget", "pipeline.report.command"}


def test_only_the_command_layer_imports_the_composed_settings() -> None:
    """Components take the connection, their own section and a state dir; only commands
    know the composed ``Settings`` (no back-arrows into ``pipeline/settings.py``)."""
    g = graph()
    importers = {m for m, deps in g.items() if "pipeline.settings" in deps}
    runtime = {m for m in importers if m not in COMMAND_LAYER and not m.endswith(".commands")}
    assert runtime == set()
    assert {"pipeline.cli", "pipeline.processors.commands"} <= importers  # the check sees them
