"""Domain errors are raised by domain code and become one-line CLI errors in one place."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import pipeline
from pipeline.cli import cli
from pipeline.errors import LiverlError

PACKAGE = Path(pipeline.__file__).parent


def _all_modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages([str(PACKAGE)], "pipeline.")]


def test_no_domain_error_subclasses_click() -> None:
    """The library must not depend on the CLI to report a failure."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                if any(b.startswith("click.") for b in bases if "Group" not in b):
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert offenders == []


def test_every_liverl_error_lives_in_an_errors_module() -> None:
    for name in _all_modules():
        if name.endswith(("sglang_server", "__main__")):
            continue
        importlib.import_module(name)
    seen: list[type] = []
    todo = [LiverlError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    names = {f"{c.__module__}.{c.__name__}" for c in seen}
    assert {
        "pipeline.models.errors.ModelStoreError",
        "pipeline.lake.errors.SqlError",
        "pipeline.kafka.errors.TapError",
        "pipeline.replay.errors.ReplayError",
    } <= names
    assert [n for n in names if not n.rsplit(".", 1)[0].endswith("errors")] == []


@pytest.mark.parametrize(
    ("args", "expected", "code"),
    [
        (["serve", "--model", "./no-such-model"], "error: unknown model './no-such-model'", 1),
        (
            ["train", "--model", "{empty}"],
            "is not a Hugging Face model directory (no config.json)",
            1,
        ),
        (["sql"], 'error: give a query, e.g. liverl sql "SELECT * FROM weights"', 2),
    ],
)
def test_cli_prints_domain_errors_as_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], expected: str, code: int
) -> None:
    monkeypatch.setenv("LIVERL_STATE_DIR", str(tmp_path / "state"))
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    result = CliRunner().invoke(cli, [a.format(empty=empty) for a in args])
    assert result.exit_code == code, result.output
    err = result.stderr
    assert expected in err
    assert "Traceback" not in result.output + err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1
    assert not isinstance(result.exception, LiverlError)  # handled, not escaped


def test_error_message_with_brackets_is_printed_verbatim(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pipeline.cli import _fail

    with pytest.raises(SystemExit) as done:
        _fail("reading liverl.samples.v1[3]: [bold]no record[/bold]", 4)
    assert done.value.code == 4
    assert "liverl.samples.v1[3]: [bold]no record[/bold]" in capsys.readouterr().err


def test_a_long_error_stays_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``error: <one line>`` even past the console's width (a namespace's missing topics, 15
    of them, once broke the command line it suggests over two lines)."""
    from pipeline.cli import _fail

    message = "no topic(s) " + ", ".join(f"replay.ns.liverl.t{i}.v1" for i in range(15))
    with pytest.raises(SystemExit):
        _fail(message + "; create them with `liverl topics apply --namespace ns`")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`liverl topics apply --namespace ns`" in err
    assert len(err) > 300
