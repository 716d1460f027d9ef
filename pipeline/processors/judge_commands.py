"""``liverl judges``: how each judge's verdicts agree with the outcomes recorded beside them.

``liverl judges compare NAME`` reads namespace NAME's verdicts and next states (a replay
re-judged with ``liverl workers --namespace NAME --judge ...``) to their current ends, with
assign only (no group offsets read or committed), and joins them with
:class:`~pipeline.processors.consistency.ConsistencyTracker`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import click

from pipeline import events
from pipeline.kafka import names
from pipeline.kafka.connection import Connectable

from .consistency import ConsistencyTracker, JudgeKey, Tally


@dataclass
class Comparison:
    """Per judge key its tally, plus what the read saw."""

    tallies: dict[JudgeKey, Tally] = field(default_factory=dict)
    verdicts: int = 0
    outcomes: int = 0
    undecodable: int = 0
    contradictory: int = 0  # turns (or sessions) whose outcomes disagree with each other

    def rows(self) -> list[dict[str, Any]]:
        return [
            {
                "judge_id": j,
                "judge_version": v,
                "agree": t.agree,
                "disagree": t.disagree,
                "abstain": t.abstain,
                "contradicted": t.contradicted,
                "agreement": t.agreement,
                "consistency": round(t.consistency, 6),
            }
            for (j, v), t in sorted(self.tallies.items())
        ]


def compare(
    settings: Connectable, namespace: str | None, idle_timeout_s: float = 30.0
) -> Comparison:
    """Join every verdict of the namespace (None: the live topics) to its outcomes."""
    from .consistency_watch import read_history

    history = read_history(settings, namespace, idle_timeout_s)
    tracker = ConsistencyTracker()
    tracker.feed(history.verdicts, history.outcomes)
    return Comparison(
        tracker.tallies,
        len(history.verdicts),
        len(history.outcomes),
        history.undecodable,
        tracker.contradictory,
    )


@click.group("judges")
def judges() -> None:
    """Judges checked against outcomes (RLAnything's reward-model consistency)."""


@judges.command("compare")
@click.argument("name")
@click.option(
    "--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True
)
@click.pass_context
def compare_command(ctx: click.Context, name: str, fmt: str) -> None:
    """Each judge's agreement with the outcomes recorded in replay namespace NAME.

    A verdict agrees when an outcome of its turn (a gate's exit code, a test run, thumbs
    feedback; a session's outcome for turns without their own) has its sign. Verdicts made
    from the outcome itself are left out; verdicts on turns whose outcomes disagree with each
    other are contradicted and count neither way.
    consistency = (agree + 1) / (agree + disagree + 2).

    \b
    liverl replay --into rules-check ...
    liverl workers --namespace rules-check --judge rules
    liverl judges compare rules-check
    """
    import orjson
    from rich.console import Console
    from rich.table import Table

    from pipeline.replay import namespace as nsmod

    settings = ctx.obj["settings"]
    nsmod.check_name(name)
    topic = names.resolve(names.PRM_SCORES, name)
    if topic not in nsmod.existing_topics(settings):
        raise click.UsageError(
            f"namespace {name!r} has no verdicts topic {topic}; replay into it and run its "
            f"workers first (liverl replay ... --into {name}; liverl workers --namespace {name})"
        )
    result = compare(settings, name)
    if fmt == "json":
        doc = {
            "namespace": name,
            "judges": result.rows(),
            "verdicts": result.verdicts,
            "outcomes": result.outcomes,
            "undecodable": result.undecodable,
            "contradictory_turns": result.contradictory,
        }
        click.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
        return
    console = Console(width=None if sys.stdout.isatty() else 200)
    table = Table(title=f"judges vs outcomes in {name}")
    for col in (
        "judge",
        "version",
        "agree",
        "disagree",
        "abstain",
        "contradicted",
        "agreement",
        "consistency",
    ):
        table.add_column(col, justify="left" if col in ("judge", "version") else "right")
    for r in result.rows():
        share = "-" if r["agreement"] is None else f"{r['agreement']:.0%}"
        table.add_row(
            r["judge_id"],
            r["judge_version"],
            str(r["agree"]),
            str(r["disagree"]),
            str(r["abstain"]),
            str(r["contradicted"]),
            share,
            f"{r['consistency']:.3f}",
        )
    console.print(table)
    console.print(
        f"{result.verdicts} verdicts, {result.outcomes} outcomes"
        + (f", {result.undecodable} undecodable" if result.undecodable else "")
        + (
            f", {result.contradictory} turn(s) with contradictory outcomes"
            if result.contradictory
            else ""
        )
    )
    if not result.tallies:
        console.print(
            "no verdict met an outcome: record outcomes (liverl record-outcome, "
            "feedback) for the sessions replayed"
        )


@judges.command("watch")
@click.option("--namespace", default=None, help="Watch replay namespace NAME, not live.")
@click.option(
    "--flag-below",
    type=click.FloatRange(0, 1),
    default=0.5,
    show_default=True,
    help="Flag a judge whose consistency falls below this...",
)
@click.option(
    "--min-decided",
    type=click.IntRange(1),
    default=10,
    show_default=True,
    help="...once it has this many verdicts that agreed or disagreed.",
)
@click.option(
    "--window",
    type=click.IntRange(1, 100_000),
    default=None,
    help="Flag by the consistency of each judge's last this many decided matches. "
    "Default: processors.consistency_window (20).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve liverl_judge_consistency, liverl_judge_recent_consistency, "
    "liverl_judge_excluded, liverl_judge_contradicted and liverl_judge_flags_total "
    "here (no authentication).",
)
@click.option(
    "--metrics-host",
    default=None,
    show_default=False,
    help="Interface the metrics server binds to. Default: processors.web_host, "
    "the workers' (127.0.0.1).",
)
@click.option(
    "--horizon-h",
    type=click.FloatRange(0, min_open=True),
    default=168.0,
    show_default=True,
    help="Forget sessions quiet for this long (memory bound; "
    "an outcome after that matches nothing). Default: the topics' 7-day retention.",
)
@click.option("--once", is_flag=True, help="Catch up to the topics' ends, publish, and exit.")
@click.pass_context
def watch_command(
    ctx: click.Context,
    namespace: str | None,
    flag_below: float,
    min_decided: int,
    window: int | None,
    metrics_port: int | None,
    metrics_host: str | None,
    horizon_h: float,
    once: bool,
) -> None:
    """Join verdicts to outcomes as they arrive; publish each match on judge_consistency.

    Runs beside the workers. At start it rebuilds the join from the topics' history and
    publishes what was never published, then follows their ends until Ctrl-C. A judge whose
    consistency over its last --window decided matches drops below --flag-below is flagged (a
    warning, flagged: true on the match, the liverl_judge_flags_total counter) and excluded:
    panels and the promotion gate give it weight 0 until that figure is back at --flag-below
    + 0.05 (recovered: true on the match). A verdict on a turn whose outcomes disagree with
    each other (passed and failed) is contradicted: it counts neither way, and a match of it
    published before is taken back (contradicted: true).
    """
    import signal
    import threading

    from pipeline.replay import namespace as nsmod

    from .consistency_watch import ConsistencyWatcher

    settings = ctx.obj["settings"]
    if namespace:
        nsmod.check_name(namespace)
    server = None
    if metrics_port is not None:
        from prometheus_client import start_http_server

        host = metrics_host or settings.processors.web_host
        try:
            server, _ = start_http_server(metrics_port, addr=host)
        except OSError as exc:
            raise click.ClickException(
                f"metrics server: cannot listen on {host}:{metrics_port} "
                f"({exc.strerror or exc}); pass another --metrics-port"
            ) from exc
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def say(ev: events.JudgeConsistency) -> None:
        if ev.flagged or ev.recovered:
            click.echo(
                f"{'flagged' if ev.flagged else 'recovered'} {ev.judge_id} "
                f"({ev.judge_version}): {ev.reason}",
                err=True,
            )

    watcher = ConsistencyWatcher(
        settings,
        namespace=namespace,
        flag_below=flag_below,
        min_decided=min_decided,
        on_event=say,
        window=window or settings.processors.consistency_window,
        horizon_s=horizon_h * 3600,
    )
    try:
        watcher.run(stop, once=once)
    except LookupError as exc:
        raise click.UsageError(str(exc)) from exc
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    click.echo(
        f"published {watcher.sent} match(es) on {watcher.output}"
        + (f", {watcher.contradicted} contradicted" if watcher.contradicted else "")
    )
    if watcher.tracker.contradictory:
        click.echo(
            f"{watcher.tracker.contradictory} turn(s) with contradictory outcomes: "
            "their verdicts count neither way"
        )
