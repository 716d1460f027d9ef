"""Click commands for the reward pipeline, registered in ``pipeline.cli``.

``liverl workers``: run a Faust worker; ``--processes N`` runs N of them under a supervisor
(``supervisor.py``), one consumer group, so Kafka spreads the partitions over them.
``liverl record-outcome``: a quality gate's pass/fail as a ``next_states`` event; with
``-- CMD ARGS`` it runs the gate itself and records its exit code and the ends of its output.
``liverl gates run``: each gate of a gates file (``gates_file.py``), recorded the same way.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import click
from click.core import ParameterSource

from pipeline.events import NextState
from pipeline.events.types import NextStateKind
from pipeline.options import field_option, merged
from pipeline.settings import Settings, load_settings

from .config import ProcessorSettings, free_port, port_problem
from .gates_file import DEFAULT_FILE as DEFAULT_GATES_FILE
from .gates_file import Gate, GatesFile, GatesFileError, load_gates, run_gates
from .gates_file import exit_code as gates_exit_code
from .outcomes import gate_event, outcome_event, run_gate, workspace_of
from .outcomes import verdict as gate_verdict
from .terminal import TAIL_CHARS

MAX_PROCESSES = 64  # `liverl workers --processes`: a sanity bound, far above any partition count


def _settings(ctx: click.Context) -> Settings:
    obj = ctx.obj if isinstance(ctx.obj, dict) else {}
    return obj.get("settings") or load_settings()


@click.command("workers")
@field_option(ProcessorSettings, "app_id", "--app-id", help="Faust app id = consumer group.")
@field_option(
    ProcessorSettings,
    "web_enabled",
    "--web/--no-web",
    help="Faust's web server with the workers' /metrics (off by default).",
)
@field_option(
    ProcessorSettings, "web_host", "--web-host", help="Interface the web server binds to."
)
@field_option(
    ProcessorSettings,
    "web_port",
    "--web-port",
    help="Web server port; 0: a free one (--processes: each child its own).",
)
@field_option(
    ProcessorSettings,
    "plugins",
    "--plugin",
    multiple=True,
    show_default=False,
    help="Python module imported before the judge is looked up; it may register "
    "judges (pipeline.processors.judges.register). Repeatable.",
)
@field_option(
    ProcessorSettings,
    "judge",
    "--judge",
    help="Judge name: replies (reply patterns + sentiment, with hints), "
    "rules (phrase lists), llm (PRM behind an OpenAI-compatible API), answer and on_topic "
    "(read the answer itself), panel (several judges voting, weighted by their consistency), "
    "or one a --plugin module registers; its options: [processors.judge_options].",
)
@field_option(
    ProcessorSettings,
    "exactly_once",
    "--exactly-once/--at-least-once",
    help="Commit each worker's outputs, state and input offsets in one Kafka "
    "transaction (derived records visible to read_committed readers at each commit), "
    "or send them at once and let consumers deduplicate by event id.",
)
@field_option(
    ProcessorSettings,
    "worker_index",
    "--worker-index",
    help="This worker's number within its app (its transactional id); --processes "
    "numbers its children itself.",
)
@field_option(
    ProcessorSettings,
    "rules_path",
    "--rules",
    show_default=False,
    help="Path-penalty rules YAML (default: the built-in rules/default.yaml).",
)
@click.option(
    "--namespace",
    default=None,
    help="Run in replay namespace NAME: its topics, app "
    "id and state (<state_dir>/replay/NAME/); never the live ones.",
)
@click.option(
    "-l",
    "--loglevel",
    default="warn",
    type=click.Choice(["crit", "error", "warn", "info", "debug"]),
)
@click.option(
    "--processes",
    default=1,
    show_default=True,
    type=click.IntRange(1, MAX_PROCESSES),
    help="Worker processes on this machine (one core each), one consumer group: Kafka "
    "spreads the partitions over them; beyond the partition count the rest stay idle. A "
    "child that dies is restarted; after 5 deaths within 60 s all stop (exit 1). With "
    "--web, child i listens on --web-port + i (a free port each for 0).",
)
@click.pass_context
def workers(
    ctx: click.Context,
    namespace: str | None,
    loglevel: str,
    processes: int,
    **options: object,
) -> None:
    """Run the reward pipeline worker: pairing, judge + hints, path penalties, rewards, samples.

    Settings: LIVERL_PROCESSORS_* (e.g. LIVERL_PROCESSORS_JUDGE=llm,
    LIVERL_PROCESSORS_LLM_BASE_URL=http://host:8000/v1). Scale out with --processes N on one
    machine, or by running more workers with the same app id elsewhere, up to one process
    per partition in all. With --processes N every child gets this command's options (and
    the same settings file and environment); their output is prefixed [worker i].
    """
    from pipeline.durable import writable_problem

    if processes > 1:
        _supervise(ctx, processes, options)
        return
    if namespace or _settings(ctx).kafka.namespace:
        from pipeline.replay.namespace import enter_checked

        obj = ctx.obj if isinstance(ctx.obj, dict) else {}
        ctx.obj = {**obj, "settings": enter_checked(_settings(ctx), namespace)}
    if (problem := writable_problem(Path(_settings(ctx).state_dir) / "processors")) is not None:
        raise click.ClickException(f"{problem}; set state_dir (LIVERL_STATE_DIR or --config)")
    from .app import create_app
    from .internal_topics import ensure_internal_topics
    from .penalties import RuleConfigError

    try:
        settings = _settings(ctx)
        cfg = web_listen(merged(settings.processors, ctx, options))
        app = create_app(settings, cfg, settings.state_dir)
        ensure_internal_topics(app, settings)
    except (RuleConfigError, ValueError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from exc
    from .worker import BoundedShutdownWorker

    worker = BoundedShutdownWorker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()


def web_listen(cfg: ProcessorSettings, ports: int = 1) -> ProcessorSettings:
    """``cfg`` with the web server's port settled: 0 becomes a free port; a port in use (or
    the ``ports`` after it, for ``--processes``) is a one-line error naming the way out, never
    Faust's traceback once the worker has joined its group. A second worker group beside the
    live one (``--namespace``) once died of that."""
    if not cfg.web_enabled:
        return cfg
    host = cfg.web_host
    if cfg.web_port == 0:
        if ports > 1:
            return cfg  # each child picks its own
        cfg = cfg.model_copy(update={"web_port": free_port(host)})
    else:
        for port in range(cfg.web_port, cfg.web_port + ports):
            if (problem := port_problem(host, port)) is not None:
                raise click.ClickException(
                    f"web server: cannot listen on {host}:{port} ({problem}); pass another "
                    "--web-port (0: a free one) or leave the web server off (--no-web)"
                )
    if ports == 1:
        click.echo(f"web server (/metrics) on http://{host}:{cfg.web_port}", err=True)
    return cfg


def forwarded_options(ctx: click.Context, skip: tuple[str, ...] = ()) -> list[str]:
    """The options the user typed for this command, as command-line words again (children
    re-read defaults, the settings file and the environment themselves)."""
    words: list[str] = []
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name in skip or param.name is None:
            continue
        if ctx.get_parameter_source(param.name) in (ParameterSource.DEFAULT, None):
            continue
        value = ctx.params[param.name]
        flag = max(param.opts, key=len)
        if param.is_flag and param.secondary_opts:  # --x/--no-x: whichever was typed
            words.append(param.opts[0] if value else param.secondary_opts[0])
        elif param.is_flag:
            if value == param.flag_value:
                words.append(flag)
        elif param.multiple:
            for item in value or ():
                words += [flag, str(item)]
        elif value is not None:
            words += [flag, str(value)]
    return words


def _supervise(ctx: click.Context, processes: int, options: dict[str, object]) -> None:
    """``--processes N``: the settings are checked here (a bad one fails once, not N times
    five), then the supervisor runs N plain ``liverl workers`` children. They share the
    Faust datadir <state_dir>/processors/<app_id>: Faust only creates it (no lock; the
    tables are in memory), so it needs no per-child directory."""
    from pipeline.durable import writable_problem

    from .penalties import load_rules
    from .supervisor import Supervisor, child_argvs

    settings = _settings(ctx)
    try:
        cfg = merged(settings.processors, ctx, options)
        load_rules(cfg.rules_path)
    except (OSError, ValueError) as exc:  # RuleConfigError and pydantic's are ValueErrors
        raise click.ClickException(str(exc)) from exc
    web_listen(cfg, processes)
    if (problem := writable_problem(Path(settings.state_dir) / "processors")) is not None:
        raise click.ClickException(f"{problem}; set state_dir (LIVERL_STATE_DIR or --config)")
    partitions = cfg.partitions or _session_partitions(settings)
    if partitions is not None and processes > partitions:
        click.echo(
            f"note: {processes} processes for {partitions} partitions: "
            f"{processes - partitions} will stay idle",
            err=True,
        )
    config = ctx.find_root().params.get("config")  # `liverl --config F workers`: children too
    argvs = child_argvs(
        forwarded_options(ctx, skip=("processes", "web_port", "worker_index")),
        processes,
        cfg.web_port if cfg.web_enabled else None,
        prefix=["--config", str(config)] if config else [],
    )
    code = Supervisor(argvs).run()
    if code:
        raise click.ClickException("worker processes kept dying (see their output above)")


def _session_partitions(settings: Settings) -> int | None:
    """The partition count of the session-keyed topics, if topics/ can be read."""
    from pipeline.kafka import topics as kafka_topics

    try:
        specs = kafka_topics.load_specs(
            settings.topics.specs_dir, max_record_bytes=settings.kafka.max_record_bytes
        )
        return kafka_topics.session_partitions(specs)
    except Exception:  # noqa: BLE001 - only a note depends on it; the children will say
        return None


@click.command("record-outcome")
@click.option(
    "--session",
    "session_id",
    required=True,
    envvar="LIVERL_SESSION_ID",
    help="Session id (env LIVERL_SESSION_ID).",
)
@click.option(
    "--passed/--failed",
    default=None,
    help="Outcome of the gate; omit it when a command after -- decides it.",
)
@click.option("--turn", type=int, default=None, help="Attach to one turn (default: the session).")
@click.option(
    "--kind",
    type=click.Choice(["test_result", "feedback"]),
    default="test_result",
    show_default=True,
)
@click.option("--detail", default="", help="Free text (e.g. the failing test names).")
@click.option("--source", default="record-outcome", show_default=True)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    default=1800.0,
    show_default=True,
    help="Seconds the command may run; then it is killed (exit 124).",
)
@click.option(
    "--tail",
    "tail_chars",
    type=click.IntRange(1, 100_000),
    default=TAIL_CHARS,
    show_default=True,
    help="Characters kept of the end of the command's stdout and stderr.",
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def record_outcome(
    ctx: click.Context,
    session_id: str,
    passed: bool | None,
    turn: int | None,
    kind: NextStateKind,
    detail: str,
    source: str,
    timeout_s: float,
    tail_chars: int,
    command: tuple[str, ...],
) -> None:
    """Record a pass/fail outcome for a session (or one turn) as a next_states event.

    Either say it (--passed / --failed) or let a quality gate decide: with
    `liverl record-outcome --session S -- pytest -q` the command runs (its output passes
    through), its exit code decides pass/fail, the ends of its output are recorded, and this
    command exits with the gate's exit code, so it can stand in for the gate in a script.
    """
    from pipeline.kafka import EventProducer, names

    if command and passed is not None:
        raise click.UsageError("give --passed/--failed or a command after --, not both")
    if not command and passed is None:
        raise click.UsageError("give --passed/--failed, or a command to run after --")
    settings = _settings(ctx)
    gate = None
    if command:
        gate = run_gate(list(command), timeout_s, tail_chars)
        event = gate_event(
            session_id,
            list(command),
            gate,
            turn=turn,
            kind=kind,
            detail=detail,
            source=source,
            workspace=workspace_of(),
        )
    else:
        assert passed is not None
        event = outcome_event(
            session_id, passed, turn=turn, kind=kind, detail=detail, source=source
        )
    said = (
        "no outcome"
        if event.score is None and gate is not None
        else "passed"
        if event.exit_code == 0
        else "failed"
    )
    try:
        producer = EventProducer(settings, client_id="liverl-record-outcome")
        producer.send(names.NEXT_STATES, event)
        producer.flush()
    except Exception as exc:  # noqa: BLE001 - Kafka's or the config's: say it, exit non-zero
        raise click.ClickException(f"{said}, but not recorded: {exc}") from exc
    if gate is None:
        click.echo(f"recorded {said} for {session_id}: {event.event_id}")
        return
    click.echo(  # stderr: stdout carried the command's own output
        f"recorded {gate_verdict(gate, timeout_s)} for {session_id}: {event.event_id}", err=True
    )
    ctx.exit(gate.exit_code)


@click.group("gates")
def gates() -> None:
    """Quality gates as configuration: a gates file's commands, each outcome a reward."""


_GATES_FILE = click.option(
    "--file",
    "path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_GATES_FILE,
    show_default=True,
    envvar="LIVERL_GATES_FILE",
    help="The gates file (env LIVERL_GATES_FILE); see `liverl gates check --help`.",
)


@gates.command("check")
@_GATES_FILE
def gates_check(path: Path) -> None:
    """Check a gates file and print what `gates run` would do; runs nothing.

    \b
    gates:
      - command: "pytest -q"      # split like sh would; never run through a shell
        record_outcome: true      # default: recorded as `liverl record-outcome -- CMD`
        timeout_s: 1800           # default; then killed, exit 124
      - name: lint
        command: ["ruff", "check", "."]
        record_outcome: false     # gates the exit code, records nothing
    fail_fast: false              # true: stop at the first failing gate

    Per gate also: kind (test_result | feedback), turn, source, detail.
    """
    spec = _load_gates(path)
    for i, gate in enumerate(spec.gates, 1):
        what = "records its outcome" if gate.record_outcome else "not recorded"
        click.echo(f"{i}. {gate.label}: {shlex.join(gate.argv)} ({what}, "
                   f"timeout {gate.timeout_s:g} s)")  # fmt: skip
    click.echo(f"{len(spec.gates)} gate(s) in {path}" + (", fail fast" if spec.fail_fast else ""))


@gates.command("run")
@click.option(
    "--session",
    "session_id",
    required=True,
    envvar="LIVERL_SESSION_ID",
    help="Session id (env LIVERL_SESSION_ID).",
)
@_GATES_FILE
@click.option(
    "--turn",
    type=int,
    default=None,
    help="Attach outcomes to one turn (default: the session; a gate's turn wins).",
)
@click.option(
    "--fail-fast/--no-fail-fast",
    default=None,
    help="Stop at the first failing gate (default: the file's fail_fast).",
)
@click.option(
    "--tail",
    "tail_chars",
    type=click.IntRange(1, 100_000),
    default=TAIL_CHARS,
    show_default=True,
    help="Characters kept of the end of each command's stdout and stderr.",
)
@click.pass_context
def gates_run(
    ctx: click.Context,
    session_id: str,
    path: Path,
    turn: int | None,
    fail_fast: bool | None,
    tail_chars: int,
) -> None:
    """Run each gate of the gates file for a session, in order, and record each outcome
    exactly as `liverl record-outcome --session S -- CMD` does (their output passes through).

    Exits with the first failing gate's exit code, 0 when all pass, 1 when all passed but an
    outcome could not be recorded (Kafka down: the gates still run and say so).
    """
    from pipeline.kafka import EventProducer, names

    spec = _load_gates(path)
    if fail_fast is not None:
        spec = spec.model_copy(update={"fail_fast": fail_fast})
    settings = _settings(ctx)
    producer: EventProducer | None = None

    def record(event: NextState) -> None:
        nonlocal producer
        if producer is None:
            producer = EventProducer(settings, client_id="liverl-gates")
        producer.send(names.NEXT_STATES, event)
        producer.flush()

    def start(i: int, gate: Gate) -> None:
        click.echo(f"[gate {i + 1}/{len(spec.gates)}] {gate.label}", err=True)

    runs = run_gates(spec, session_id, record, turn=turn, tail_chars=tail_chars, on_start=start)
    for run in runs:
        said = gate_verdict(run.result, run.gate.timeout_s)
        if not run.result.timed_out:
            said += f" in {run.result.duration_s:g} s"
        if run.event is None:
            note = "not recorded (record_outcome: false)"
        elif run.error:
            note = f"NOT recorded: {run.error}"
        else:
            note = f"recorded {run.event.event_id}"
        click.echo(f"{run.gate.label}: {said}; {note}", err=True)
    skipped = len(spec.gates) - len(runs)
    if skipped:
        click.echo(f"{skipped} gate(s) not run (fail fast)", err=True)
    ctx.exit(gates_exit_code(runs))


def _load_gates(path: Path) -> GatesFile:
    try:
        return load_gates(path)
    except GatesFileError as exc:
        raise click.UsageError(str(exc)) from exc
