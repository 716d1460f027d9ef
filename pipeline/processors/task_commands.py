"""``liverl tasks``: the pool of verified tasks (processors/task_pool.py) for people.

``watch`` builds it; ``list``, ``show`` and ``export`` read it (the compacted tasks topic, to
its end, assign only); ``check`` re-runs a task's gate command, only one liverl ran itself
and whose whole argv the operator allows (``tasks.allowed_commands``, argv patterns: nothing
from event content runs by default), or the operator's ``--command``; ``replay``
republishes the accepted tasks' sessions into a replay namespace, where the workers and the
trainer train on them through the usual exactly-once path.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import IO, Any

import click

from pipeline import events

from .task_pool import TaskPool, build_judges, read_tasks


def _settings(ctx: click.Context) -> Any:
    """The composed settings the command layer (pipeline.cli) loaded."""
    return (ctx.find_root().obj or {})["settings"]


def _check_namespace(namespace: str | None) -> None:
    if namespace:
        from pipeline.replay import namespace as nsmod

        nsmod.check_name(namespace)


def _pool(settings: Any, namespace: str | None) -> dict[str, events.VerifiedTask]:
    from pipeline.kafka import names
    from pipeline.replay import namespace as nsmod

    topic = names.resolve(names.TASKS, namespace)
    if topic not in nsmod.existing_topics(settings):
        raise click.UsageError(
            f"no tasks topic {topic}: liverl topics apply"
            + (f" --namespace {namespace}" if namespace else "")
        )
    return read_tasks(settings, namespace)


def find_task(pool: dict[str, events.VerifiedTask], task_id: str) -> events.VerifiedTask:
    """The task of id ``task_id``, or of the one id it begins (a prefix, as git's)."""
    if task_id in pool:
        return pool[task_id]
    hits = [t for i, t in sorted(pool.items()) if i.startswith(task_id)]
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise click.UsageError(
            f"task id {task_id!r} is ambiguous: " + ", ".join(t.task_id for t in hits[:5])
        )
    raise click.UsageError(
        f"unknown task {task_id!r} ({len(pool)} in the pool; liverl tasks list shows them)"
    )


def success_rate(t: events.VerifiedTask) -> dict[str, Any]:
    """The task's success rate under the current policy: of its outcomes (the verifying one
    and the session's later ones) those of the newest policy version among them (the
    ``policy_id`` and ``weight_version`` of the turn each judged), the share that passed.
    ``rate`` None when no outcome is kept (tasks published before they were)."""
    kept = [o for o in t.outcomes if o.get("vote") in (-1, 1)]
    if not kept:
        return {"policy_id": None, "weight_version": None, "passed": 0, "failed": 0, "rate": None}
    newest = max(
        kept,
        key=lambda o: (
            o.get("weight_version") is not None,
            o.get("weight_version") or 0,
            o.get("ts_ms") or 0,
        ),
    )
    version = (newest.get("policy_id"), newest.get("weight_version"))
    mine = [o for o in kept if (o.get("policy_id"), o.get("weight_version")) == version]
    passed = sum(1 for o in mine if o["vote"] == 1)
    return {
        "policy_id": version[0],
        "weight_version": version[1],
        "passed": passed,
        "failed": len(mine) - passed,
        "rate": passed / len(mine),
    }


def task_doc(t: events.VerifiedTask) -> dict[str, Any]:
    """A task as people and scripts read it (``show``, ``export``)."""
    return {
        "task_id": t.task_id,
        "status": t.status,
        "k": t.k,
        "yes": sum(1 for v in t.votes if v.get("vote") == 1),
        "prompt": t.prompt,
        "messages": t.messages,
        "answer": t.answer,
        "checker": t.checker,
        "provenance": t.provenance,
        "votes": t.votes,
        "event_id": t.event_id,
        "ts_ms": t.ts_ms,
        "outcomes": t.outcomes,
        "success_rate": success_rate(t),
    }


@click.group("tasks")
def tasks() -> None:
    """Verified tasks from traffic: sessions whose outcome was verified, validated by k judges."""


namespace_option = click.option(
    "--namespace", default=None, help="The pool of replay namespace NAME, not live."
)


@tasks.command("watch")
@namespace_option
@click.option(
    "--judge",
    "judges",
    multiple=True,
    help="A judge by registry name, repeated (k of them, k odd) [default: tasks.judges].",
)
@click.option("--session-prefix", default="", help="Only sessions whose id starts with this.")
@click.option("--once", is_flag=True, help="Catch up to the topics' ends, publish, and exit.")
@click.pass_context
def watch_command(
    ctx: click.Context,
    namespace: str | None,
    judges: tuple[str, ...],
    session_prefix: str,
    once: bool,
) -> None:
    """Turn verified sessions into tasks, each after a vote of k judges; publish on tasks.

    A session is verified by a positive outcome: a gate or test run with exit code 0
    (liverl record-outcome), explicit feedback with a positive score. The task is accepted
    when a strict majority of the judges votes +1, else rejected (still published, for audit).
    At start the pool is rebuilt from the topics' history and only tasks never published are
    sent; then it follows until Ctrl-C.
    """
    import signal
    import threading

    settings = _settings(ctx)
    _check_namespace(namespace)
    names_ = list(judges) or settings.tasks.judges
    if len(names_) % 2 == 0:
        raise click.UsageError(
            f"{len(names_)} judges: k must be odd, so a strict majority always decides"
        )
    try:
        built = build_judges(names_, settings.tasks.judge_options, settings.processors.plugins)
    except (KeyError, ValueError) as exc:
        raise click.UsageError(str(exc)) from exc
    stop = threading.Event()
    if not once:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())

    def say(t: events.VerifiedTask) -> None:
        yes = sum(1 for v in t.votes if v["vote"] == 1)
        click.echo(f"{t.task_id} {t.status} ({yes}/{t.k}) {t.provenance['session_id']}", err=True)

    pool = TaskPool(
        settings,
        built,
        namespace=namespace,
        session_prefix=session_prefix,
        chars=settings.tasks.text_chars,
        on_task=say,
    )
    try:
        pool.run(stop, once=once)
    except LookupError as exc:
        raise click.UsageError(str(exc)) from exc
    s = pool.stats
    click.echo(
        f"published {s.sent} task(s) on {pool.output}: {s.accepted} accepted, "
        f"{s.rejected} rejected, {s.revised} revised by later outcomes "
        f"({s.withdrawn} withdrawn)"
    )


@tasks.command("list")
@namespace_option
@click.option(
    "--status",
    type=click.Choice(["accepted", "rejected", "withdrawn", "all"]),
    default="all",
    show_default=True,
)
@click.option(
    "--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True
)
@click.pass_context
def list_command(ctx: click.Context, namespace: str | None, status: str, fmt: str) -> None:
    """The pool: one row per task (id, status, votes, success rate under the newest policy
    version of its outcomes, checker, session, prompt)."""
    import orjson
    from rich.console import Console
    from rich.table import Table

    _check_namespace(namespace)
    pool = _pool(_settings(ctx), namespace)
    rows = sorted(
        (t for t in pool.values() if status in ("all", t.status)),
        key=lambda t: (t.ts_ms, t.task_id),
    )
    if fmt == "json":
        doc = [
            {k: v for k, v in task_doc(t).items() if k not in ("messages", "votes", "outcomes")}
            for t in rows
        ]
        click.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
        return
    console = Console(width=None if sys.stdout.isatty() else 200)
    table = Table(title=f"tasks ({len(rows)} of {len(pool)})")
    for col in ("task", "status", "yes/k", "rate", "checker", "session", "prompt"):
        table.add_column(col)
    for t in rows:
        d = task_doc(t)
        checker = t.checker.get("command") or t.checker.get("kind", "")
        r = d["success_rate"]
        rate = "-" if r["rate"] is None else f"{r['passed']}/{r['passed'] + r['failed']}"
        table.add_row(
            t.task_id,
            t.status,
            f"{d['yes']}/{t.k}",
            rate,
            str(checker)[:40],
            str(t.provenance.get("session_id", "")),
            " ".join(t.prompt.split())[:60],
        )
    console.print(table)


@tasks.command("show")
@click.argument("task_id")
@namespace_option
@click.pass_context
def show_command(ctx: click.Context, task_id: str, namespace: str | None) -> None:
    """One task, whole, as JSON (TASK_ID or a unique prefix of it)."""
    import orjson

    _check_namespace(namespace)
    task = find_task(_pool(_settings(ctx), namespace), task_id)
    click.echo(orjson.dumps(task_doc(task), option=orjson.OPT_INDENT_2).decode())


@tasks.command("export")
@namespace_option
@click.option(
    "--output",
    "-o",
    type=click.File("wb"),
    default="-",
    show_default=True,
    help="JSONL file to write.",
)
@click.pass_context
def export_command(ctx: click.Context, namespace: str | None, output: IO[bytes]) -> None:
    """The accepted tasks as JSONL, one task a line, oldest first (rejected ones never)."""
    import orjson

    _check_namespace(namespace)
    pool = _pool(_settings(ctx), namespace)
    accepted = sorted(
        (t for t in pool.values() if t.status == "accepted"), key=lambda t: (t.ts_ms, t.task_id)
    )
    for t in accepted:
        output.write(orjson.dumps(task_doc(t)) + b"\n")
    output.flush()
    click.echo(f"exported {len(accepted)} accepted task(s) of {len(pool)}", err=True)


def argv_pattern(entry: str) -> list[str]:
    """One ``tasks.allowed_commands`` entry as an argv pattern: split as sh would, each word a
    shell glob (``fnmatch``) for one argument."""
    words = shlex.split(entry)
    if not words:
        raise ValueError(f"empty pattern {entry!r}")
    return words


def argv_allowed(argv: list[str], pattern: list[str]) -> bool:
    """Whether ``argv`` matches ``pattern`` whole: as many arguments, each matching its glob."""
    return len(argv) == len(pattern) and all(
        fnmatch.fnmatchcase(arg, glob) for arg, glob in zip(argv, pattern, strict=True)
    )


PATTERN_FORM = (
    "an entry is a whole command line, one shell glob per argument, matched against every "
    "argument (e.g. \"pytest -q 'tests/*'\" allows pytest -q with one argument under tests/)"
)


def allowed_argv(checker: dict[str, Any], allowed: list[str]) -> list[str]:
    """The argv of a task's checker command, if it may run; else a UsageError saying why.

    It runs only when liverl ran it in the first place (kind ``command`` from producer
    ``record-outcome``: ``liverl record-outcome -- CMD``, ``liverl gates run``) and its whole
    argv matches a pattern of ``tasks.allowed_commands``. A command a client posted through
    the gateway (kind ``reported``) never runs: event content picks nothing to run."""
    from .outcomes import GATE_RUNNER

    command = checker.get("command")
    kind = checker.get("kind")
    instead = "; to check the task, give a command of yours: --command CMD"
    if kind == "reported":
        raise click.UsageError(
            "this task's command was reported by a client through the "
            "gateway, not run by liverl: it is never run" + instead
        )
    if kind != "command" or not command:
        raise click.UsageError("this task's checker is not a command (nothing to run)" + instead)
    if checker.get("producer") != GATE_RUNNER:
        raise click.UsageError(
            "this task's checker does not say liverl ran its command (liverl record-outcome "
            "-- CMD or liverl gates run; tasks built before the checker kept its producer do "
            "not): it is not run" + instead
        )
    if command.endswith("…"):
        raise click.UsageError(
            "the recorded command was cut to fit the event; it cannot be run again as recorded"
        )
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise click.UsageError(f"cannot split the recorded command {command!r}: {exc}") from exc
    if not argv:
        raise click.UsageError("the recorded command is empty")
    if any(argv_allowed(argv, argv_pattern(entry)) for entry in allowed):
        return argv
    listed = ", ".join(repr(e) for e in allowed) if allowed else "none: the list is empty"
    bare = [e for e in allowed if argv_pattern(e) == [argv[0]]]
    note = f" (the entry {bare[0]!r} allows {argv[0]!r} run with no argument only)" if bare else ""
    raise click.UsageError(
        f"the recorded command {command!r} matches no pattern of tasks.allowed_commands "
        f"({listed}){note}: {PATTERN_FORM}. Read the command before allowing it."
    )


def _git(directory: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "-C", directory, *args], capture_output=True, text=True, timeout=120, check=False
    )


@contextlib.contextmanager
def workspace(recorded: Any) -> Iterator[tuple[str | None, str]]:
    """Where to run a task's command, and a line saying so: the recorded directory when it
    is at the recorded commit (or none was recorded); else a temporary detached git worktree
    of that commit (the same subdirectory in it), removed afterwards. The user's checkout is
    never changed: no checkout, no stash, no reset. No recorded workspace: the current
    directory, said so."""
    if not isinstance(recorded, dict) or not recorded.get("dir"):
        yield (
            None,
            f"no recorded workspace (the outcome predates it): running here, in {os.getcwd()}",
        )
        return
    where, commit = str(recorded["dir"]), recorded.get("commit")
    if not os.path.isdir(where):
        raise click.UsageError(f"the task's workspace {where} does not exist here")
    if not commit:
        yield where, f"in {where} (no commit recorded: not a git work tree then)"
        return
    head = _git(where, "rev-parse", "--verify", "-q", "HEAD").stdout.strip()
    if head == commit:
        yield where, f"in {where} at {commit[:12]}"
        return
    if _git(where, "cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        raise click.UsageError(
            f"commit {commit} of the task's workspace {where} is not in its repository"
        )
    top = _git(where, "rev-parse", "--show-toplevel").stdout.strip()
    sub = os.path.relpath(os.path.realpath(where), os.path.realpath(top))
    tmp = tempfile.mkdtemp(prefix="liverl-task-check-")
    tree = os.path.join(tmp, "tree")
    try:
        added = _git(top, "worktree", "add", "--detach", tree, commit)
        if added.returncode != 0:
            raise click.ClickException(
                f"cannot check out {commit} in a temporary worktree: {added.stderr.strip()}"
            )
        yield (
            os.path.join(tree, sub) if sub != "." else tree,
            f"in a temporary worktree of {top} at {commit[:12]} (the workspace is at "
            f"{head[:12] or 'no commit'}; left as it is)",
        )
    finally:
        _git(top, "worktree", "remove", "--force", tree)
        shutil.rmtree(tmp, ignore_errors=True)
        _git(top, "worktree", "prune")


@tasks.command("check")
@click.argument("task_id")
@namespace_option
@click.option(
    "--command",
    "command",
    default=None,
    metavar="CMD",
    help="Run CMD (split as sh would) as the task's checker instead of its recorded "
    "command: an operator's own, not read from an event, so "
    "tasks.allowed_commands is not consulted.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Seconds the command may run [default: tasks.check_timeout_s].",
)
@click.pass_context
def check_command(
    ctx: click.Context,
    task_id: str,
    namespace: str | None,
    command: str | None,
    timeout_s: float | None,
) -> None:
    """Run a task's gate command again, here: one liverl ran (record-outcome, gates run) whose
    whole argv matches a pattern of tasks.allowed_commands, or --command CMD.

    It runs in the task's recorded workspace: its directory, at its commit (a temporary
    worktree of that commit when the directory has moved on; the checkout is never changed).
    Exits with the command's exit code, so it can stand in for the gate: 124 on timeout,
    which is no outcome (not a failure), as 126 and 127 (could not run).
    """
    from .outcomes import run_gate, verdict

    settings = _settings(ctx)
    _check_namespace(namespace)
    task = find_task(_pool(settings, namespace), task_id)
    if command is not None:
        try:
            argv = shlex.split(command)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--command") from exc
        if not argv:
            raise click.BadParameter("empty command", param_hint="--command")
    else:
        argv = allowed_argv(task.checker, settings.tasks.allowed_commands)
    timeout = timeout_s or settings.tasks.check_timeout_s
    with workspace(task.checker.get("workspace")) as (cwd, where):
        click.echo(f"{task.task_id}: running {shlex.join(argv)} {where}", err=True)
        gate = run_gate(argv, timeout, cwd=cwd)
    was = task.checker.get("exit_code")
    click.echo(f"{task.task_id}: {verdict(gate, timeout)}; recorded exit {was}", err=True)
    ctx.exit(gate.exit_code)


@tasks.command("replay")
@click.option("--into", "into", required=True, help="Namespace NAME: topics replay.NAME.*.")
@click.option("--session-prefix", default="", help="Only tasks of sessions starting with this.")
@click.pass_context
def replay_command(ctx: click.Context, into: str, session_prefix: str) -> None:
    """Republish the accepted tasks' sessions (interactions, next states) into namespace --into.

    The pool as offline RL through the usual path: liverl replay --sessions of the accepted
    tasks, then the namespace's workers score them and its trainer trains exactly once.

    \b
    liverl tasks replay --into pool
    liverl workers --namespace pool
    liverl train --namespace pool
    """
    from pipeline.replay.commands import DEFAULT_TOPICS, replay

    pool = _pool(_settings(ctx), None)
    sessions = sorted(
        {
            sid
            for t in pool.values()
            if t.status == "accepted"
            and (sid := str(t.provenance["session_id"])).startswith(session_prefix)
        }
    )
    if not sessions:
        raise click.UsageError(
            f"no accepted task in the pool ({len(pool)} task(s)): liverl tasks watch builds it"
        )
    click.echo(f"replaying {len(sessions)} session(s) of accepted tasks into {into}", err=True)
    ctx.invoke(
        replay,
        source_kind="kafka",
        topic_args=(DEFAULT_TOPICS,),
        since=None,
        until=None,
        session_args=(",".join(sessions),),
        speed="max",
        into=into,
        again=False,
        lake_root=None,
    )
