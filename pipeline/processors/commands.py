"""Click commands for the reward pipeline; the lead wires them into ``pipeline.cli``.

``liverl workers``: run a Faust worker (start more processes with the same app id to scale).
``liverl record-outcome``: a quality gate's pass/fail as a ``next_states`` event.
"""

from __future__ import annotations

import click

from pipeline.events import NextState, Producer, new_event_id, now_ms
from pipeline.settings import Settings, load_settings


def _settings(ctx: click.Context) -> Settings:
    obj = ctx.obj if isinstance(ctx.obj, dict) else {}
    return obj.get("settings") or load_settings()


@click.command("workers")
@click.option("--app-id", default=None, help="Faust app id = consumer group (default from config).")
@click.option("--web-port", type=int, default=None, help="Faust web/metrics port (default 6066).")
@click.option("--no-web", is_flag=True, help="Disable the web/metrics server.")
@click.option("--judge", default=None, help="Judge name: rules (default) or llm.")
@click.option("--rules", "rules_path", default=None, help="Path-penalty rules YAML.")
@click.option(
    "-l",
    "--loglevel",
    default="warn",
    type=click.Choice(["crit", "error", "warn", "info", "debug"]),
)
@click.pass_context
def workers(
    ctx: click.Context,
    app_id: str | None,
    web_port: int | None,
    no_web: bool,
    judge: str | None,
    rules_path: str | None,
    loglevel: str,
) -> None:
    """Run the reward pipeline worker: pairing, judge + hints, path penalties, rewards, samples.

    Settings: LIVERL_PROCESSORS_* (e.g. LIVERL_PROCESSORS_JUDGE=llm,
    LIVERL_PROCESSORS_LLM_BASE_URL=http://host:8000/v1). Scale out by running more workers
    with the same app id, up to one per partition.
    """
    import faust

    from .app import create_app, ensure_internal_topics
    from .config import ProcessorSettings
    from .penalties import RuleConfigError

    overrides: dict[str, object] = {}
    if app_id:
        overrides["app_id"] = app_id
    if web_port is not None:
        overrides["web_port"] = web_port
    if no_web:
        overrides["web_enabled"] = False
    if judge:
        overrides["judge"] = judge
    if rules_path:
        overrides["rules_path"] = rules_path
    try:
        settings = _settings(ctx)
        cfg = ProcessorSettings(**{**settings.processors.model_dump(), **overrides})
        app = create_app(settings, cfg)
        ensure_internal_topics(app, settings)
    except (RuleConfigError, ValueError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from exc
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()


@click.command("record-outcome")
@click.option("--session", "session_id", required=True, help="Session id.")
@click.option("--passed/--failed", default=None, required=True, help="Outcome of the gate.")
@click.option("--turn", type=int, default=None, help="Attach to one turn (default: the session).")
@click.option(
    "--kind",
    type=click.Choice(["test_result", "feedback"]),
    default="test_result",
    show_default=True,
)
@click.option("--detail", default="", help="Free text (e.g. the failing test names).")
@click.option("--source", default="record-outcome", show_default=True)
@click.pass_context
def record_outcome(
    ctx: click.Context,
    session_id: str,
    passed: bool,
    turn: int | None,
    kind: str,
    detail: str,
    source: str,
) -> None:
    """Record a pass/fail outcome for a session (or one turn) as a next_states event."""
    from pipeline.kafka import EventProducer, names

    event = outcome_event(session_id, passed, turn=turn, kind=kind, detail=detail, source=source)
    producer = EventProducer(_settings(ctx), client_id="liverl-record-outcome")
    producer.send(names.NEXT_STATES, event)
    producer.flush()
    click.echo(f"recorded {'passed' if passed else 'failed'} for {session_id}: {event.event_id}")


def outcome_event(
    session_id: str,
    passed: bool,
    *,
    turn: int | None = None,
    kind: str = "test_result",
    detail: str = "",
    source: str = "record-outcome",
    ts_ms: int | None = None,
) -> NextState:
    """The next state for an outcome; without ``turn`` it is session-scoped: ``scope="session"``
    (``turn`` is then 0 only because the schema requires one). Random id: it is a root event."""
    return NextState(
        event_id=new_event_id(),
        ts_ms=ts_ms if ts_ms is not None else now_ms(),
        producer=Producer(component=source, version="1"),
        session_id=session_id,
        turn=0 if turn is None else turn,
        kind=kind,  # type: ignore[arg-type]
        content=detail or ("passed" if passed else "failed"),
        exit_code=0 if passed else 1,
        score=1.0 if passed else -1.0,
        source=source,
        detail={"passed": passed},
        scope="session" if turn is None else "turn",
    )
