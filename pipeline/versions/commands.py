"""``liverl versions``: list and show a policy's weight versions (the canary marked with its
share); promote, pin, unpin, roll back, and roll out or withdraw a canary, each one
``weights`` event that every gateway follows (pipeline/versions/table.py
says how) and that stays in the log as the audit trail. The logic lives in ``table`` and
``actions``; these commands read, print and send."""

from __future__ import annotations

import getpass
import sys
import time
from typing import Any

import click

from pipeline import events
from pipeline.options import field_option, merged

from . import actions, reading, rule
from .config import CanarySettings
from .errors import VersionError
from .outcomes import rate_text
from .table import VersionLog, lineage


def _settings(ctx: click.Context) -> Any:
    """The composed settings the command layer (pipeline.cli) loaded."""
    return (ctx.find_root().obj or {})["settings"]


def _policy(ctx: click.Context, policy: str | None) -> str:
    return policy or _settings(ctx).trainer.policy


def _require_promoted(settings: Any) -> bool:
    """What the gateways load (:func:`pipeline.versions.rule.require_promoted`)."""
    return rule.require_promoted(settings)


def _produce(settings: Any, event: events.WeightsPublished) -> None:
    """Send one action and wait for the broker's acknowledgement (idempotent producer)."""
    from pipeline.kafka import EventProducer, names

    producer = EventProducer(settings, client_id="liverl-versions")
    producer.send(names.WEIGHTS, event, key=event.policy_id)
    producer.flush()


def _when(ms: int | None) -> str:
    return "-" if ms is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000))


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _gate(r: dict[str, Any]) -> tuple[str, str, str]:
    g = r["gate"]
    votes = (
        f"{r['status']} {g.get('gate_won', 0)}-{g.get('gate_lost', 0)}-{g.get('gate_tied', 0)}"
        if g
        else r["status"]
    )
    probe = (
        f"{g['gate_probe_correct']}/{g.get('gate_probe_n', '?')} "
        f"(live {g.get('gate_live_probe_correct', '?')})"
        if "gate_probe_correct" in g
        else "-"
    )
    fluency = (
        f"{g['gate_fluency']:.2f} (live {g.get('gate_live_fluency', 0):.2f})"
        if isinstance(g.get("gate_fluency"), int | float)
        else "-"
    )
    return votes, probe, fluency


def _flags(r: dict[str, Any]) -> str:
    flags = [f for f in ("live", "pinned", "withdrawn") if r[f]]
    if r.get("canary") is not None:
        flags.append(f"canary {r['canary']:.0%}")
    elif r.get("pending") and not r["withdrawn"]:
        flags.append("waiting (canary)")
    return ",".join(flags) or "-"


def _now(log: VersionLog, require_promoted: bool) -> str:
    """What serves: ``v3`` / ``the base``, and the canary if any (``, canary v4 at 10%``)."""
    live = log.live(require_promoted)
    now = f"v{live}" if live is not None else "the base"
    canary = log.canary(require_promoted)
    if canary is not None:
        now += f", canary v{canary[0]} at {canary[1]:.0%}"
    return now


def _table(
    ctx: click.Context, policy: str, outcomes: bool
) -> tuple[VersionLog, list[dict[str, Any]]]:
    settings = _settings(ctx)
    log, table_rows = reading.version_rows(
        settings, policy, outcomes=outcomes, require_promoted=_require_promoted(settings)
    )
    if not log.manifests:
        raise VersionError(
            f"policy {policy} has no published version on the weights topic "
            "(liverl train publishes them)"
        )
    return log, table_rows


def _echo_json(doc: Any) -> None:
    import orjson

    click.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())


policy_option = click.option("--policy", default=None, help="The policy [default: trainer.policy].")
format_option = click.option(
    "--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True
)


@click.group("versions")
def versions() -> None:
    """A policy's weight versions, which one serves, and the operator's levers.

    promote, pin, unpin, rollback, rollout and withdraw are each one event on
    liverl.weights.v1 (who, when, why), the topic every gateway follows: each replica moves
    to the version it names within its next poll (about half a second), between requests. A
    retried command is found in the log and not sent again. A new version with a canary
    share (trainer.canary_share) first serves that share of users, by a hash of their user
    or session id, until rollout (or promote) serves it to everyone or withdraw drops it.
    """


@versions.command("list")
@policy_option
@format_option
@click.option(
    "--outcomes/--no-outcomes",
    default=True,
    show_default=True,
    help="Read the samples topic for each version's live outcome rate.",
)
@click.pass_context
def list_command(ctx: click.Context, policy: str | None, fmt: str, outcomes: bool) -> None:
    """Every version: parent, optimizer steps, samples, method, the gate's verdict (votes
    won-lost-tied, probe, fluency), when it served, its live outcome rate (sessions with a
    verified outcome it answered, Wilson 95 % interval) and its size."""
    from rich.console import Console
    from rich.table import Table

    policy = _policy(ctx, policy)
    log, table_rows = _table(ctx, policy, outcomes)
    if fmt == "json":
        _echo_json(table_rows)
        return
    console = Console(width=None if sys.stdout.isatty() else 200)
    pinned = f", pinned at v{log.pinned}" if log.pinned is not None else ""
    now = _now(log, _require_promoted(_settings(ctx)))
    table = Table(title=f"{policy}: {len(table_rows)} versions, {now} should serve{pinned}")
    for col in (
        "v",
        "parent",
        "steps",
        "samples",
        "method",
        "gate votes",
        "probe",
        "fluency",
        "served since",
        "until",
        "outcome rate (95% CI)",
        "size",
        "",
    ):
        table.add_column(col)
    for r in table_rows:
        votes, probe, fluency = _gate(r)
        table.add_row(
            str(r["version"]),
            "-" if r["parent"] is None else str(r["parent"]),
            "-" if r["steps"] is None else str(r["steps"]),
            "-" if r["samples"] is None else str(r["samples"]),
            r["method"] or "-",
            votes,
            probe,
            fluency,
            _when(r["served_since_ms"]),
            _when(r["served_until_ms"]) if r["served_since_ms"] is not None else "-",
            rate_text(r["outcomes"]) if outcomes else "-",
            _size(r["size_bytes"]),
            _flags(r),
        )
    console.print(table)


@versions.command("show")
@click.argument("version", type=int)
@policy_option
@format_option
@click.option(
    "--outcomes/--no-outcomes",
    default=True,
    show_default=True,
    help="Read the samples topic for the version's live outcome rate.",
)
@click.pass_context
def show_command(
    ctx: click.Context, version: int, policy: str | None, fmt: str, outcomes: bool
) -> None:
    """One version in full: its row, its lineage (samples -> optimizer steps -> version, back
    through its parents), the sessions it trained on (from its folder's trajectories, when
    the folder is readable here) and the operator actions that named it."""
    from pipeline.serving.reloader import local_dir

    policy = _policy(ctx, policy)
    log, table_rows = _table(ctx, policy, outcomes)
    actions.known(log, version)
    row = next(r for r in table_rows if r["version"] == version)
    by_version = {r["version"]: r for r in table_rows}
    chain = [
        {
            "version": v,
            "samples": by_version[v]["samples"],
            "steps": by_version[v]["steps"],
            "step": by_version[v]["step"],
        }
        for v in lineage(log, version)
    ]
    try:
        sessions = reading.trained_sessions(local_dir(row["uri"]))
    except Exception:  # noqa: BLE001 - a remote uri or an unreadable file: say unknown
        sessions = None
    doc = {
        **row,
        "lineage": chain,
        "sessions": sessions,
        "actions": [
            {
                "kind": a.kind,
                "by": a.by,
                "reason": a.reason,
                "ts_ms": a.ts_ms,
                "event_id": a.event_id,
                "figures": a.figures,
            }
            for a in log.actions
            if a.version == version
        ],
    }
    if fmt == "json":
        _echo_json(doc)
        return
    votes, probe, fluency = _gate(row)
    as_canary = (
        "; as canary on: " + ", ".join(row["canary_replicas"]) if row["canary_replicas"] else ""
    )
    lines = [
        f"{policy} v{version} ({row['status']}; {_flags(row)})",
        f"  parent      {'base' if row['parent'] is None else 'v' + str(row['parent'])}",
        f"  step        {row['step']} ({row['steps'] if row['steps'] is not None else '?'} "
        f"since the parent), {row['samples'] if row['samples'] is not None else '?'} samples, "
        f"method {row['method'] or '?'}",
        f"  gate        {votes}; probe {probe}; fluency {fluency}",
        f"  gate figures {row['gate'] or '-'}",
        f"  published   {_when(row['published_ms'])}, verdict {_when(row['gate_ts_ms'])}",
        f"  served      {_when(row['served_since_ms'])} .. "
        f"{_when(row['served_until_ms']) if row['served_since_ms'] else '-'}"
        f" (now on: {', '.join(row['replicas']) or 'no replica'}{as_canary})",
        f"  outcomes    {rate_text(row['outcomes']) if outcomes else '(not read)'}",
        f"  size        {_size(row['size_bytes'])} at {row['uri']}",
        "  lineage     "
        + " <- ".join(
            f"v{c['version']} ({c['samples'] if c['samples'] is not None else '?'} samples, "
            f"{c['steps'] if c['steps'] is not None else '?'} steps)"
            for c in chain
        )
        + " <- base",
    ]
    if sessions is None:
        lines.append("  sessions    unknown (the version folder is not readable here)")
    else:
        lines.append(f"  sessions    {len(sessions)} trained on:")
        lines += [f"    {sid} ({n} turns)" for sid, n in sorted(sessions.items())]
    for a in doc["actions"]:
        lines.append(
            f"  {a['kind']:<11} {_when(a['ts_ms'])} by {a['by']}: "
            f"{a['reason'] or '(no reason given)'} [{a['event_id']}]"
        )
        if a["figures"]:
            lines.append("              " + ", ".join(f"{k}={v}" for k, v in a["figures"].items()))
    click.echo("\n".join(lines))


def _act(
    ctx: click.Context,
    kind: str,
    version: int | None,
    policy: str | None,
    by: str | None,
    reason: str | None,
) -> None:
    settings = _settings(ctx)
    policy = _policy(ctx, policy)
    who = by or getpass.getuser()
    log = reading.weights_log(settings, policy)
    event = actions.action_event(
        log, kind, version, by=who, reason=reason, require_promoted=_require_promoted(settings)
    )
    if event is None:
        done = actions.action_id(log, kind, version, who, reason)[0]
        click.echo(f"already in the log (event {done}): not sent again")
        return
    try:
        _produce(settings, event)
    except Exception as exc:  # noqa: BLE001 - Kafka's or the config's: say it, exit non-zero
        raise click.ClickException(
            f"{kind} v{event.version} not confirmed: {exc}. Run the same command again: it "
            "is sent once whatever the number of tries"
        ) from exc
    log.add(event)
    now = _now(log, _require_promoted(settings))
    click.echo(
        f"{kind} v{event.version} of {policy} by {who} (event {event.event_id}); "
        f"{now} should serve now"
    )


by_option = click.option("--by", default=None, help="Who acts [default: the OS user].")
reason_option = click.option("--reason", default=None, help="Why, for the audit trail.")


@versions.command("promote")
@click.argument("version", type=int)
@policy_option
@by_option
@reason_option
@click.pass_context
def promote_command(
    ctx: click.Context, version: int, policy: str | None, by: str | None, reason: str | None
) -> None:
    """Count VERSION as promoted whatever the gate said (a withdrawn one comes back); it
    serves if it is the newest servable version and nothing is pinned."""
    _act(ctx, "promote", version, policy, by, reason)


@versions.command("pin")
@click.argument("version", type=int)
@policy_option
@by_option
@reason_option
@click.pass_context
def pin_command(
    ctx: click.Context, version: int, policy: str | None, by: str | None, reason: str | None
) -> None:
    """Serve VERSION until unpin, whatever is published or promoted meanwhile (a version the
    gate rejected must be promoted first)."""
    _act(ctx, "pin", version, policy, by, reason)


@versions.command("unpin")
@policy_option
@by_option
@reason_option
@click.pass_context
def unpin_command(
    ctx: click.Context, policy: str | None, by: str | None, reason: str | None
) -> None:
    """End the pin: the newest servable version serves again."""
    _act(ctx, "unpin", None, policy, by, reason)


@versions.command("rollback")
@click.option(
    "--to",
    "to",
    type=int,
    default=None,
    help="The version to go back to [default: the newest servable one older than the live one].",
)
@policy_option
@by_option
@reason_option
@click.pass_context
def rollback_command(
    ctx: click.Context, to: int | None, policy: str | None, by: str | None, reason: str | None
) -> None:
    """Serve an older version: every version newer than it is withdrawn (never served again
    unless promoted), and versions published afterwards serve as usual."""
    _act(ctx, "rollback", to, policy, by, reason)


@versions.command("rollout")
@click.argument("version", type=int)
@policy_option
@by_option
@reason_option
@click.pass_context
def rollout_command(
    ctx: click.Context, version: int, policy: str | None, by: str | None, reason: str | None
) -> None:
    """Serve the canary VERSION to everyone now (it becomes the stable version), whatever
    its outcomes so far; the next waiting version, if any, becomes the canary."""
    _act(ctx, "rollout", version, policy, by, reason)


@versions.command("withdraw")
@click.argument("version", type=int)
@policy_option
@by_option
@reason_option
@click.pass_context
def withdraw_command(
    ctx: click.Context, version: int, policy: str | None, by: str | None, reason: str | None
) -> None:
    """Never serve VERSION, nor any newer version published so far, again (unless promoted):
    its users, canary or not, go back to the newest servable version below it, or the base."""
    _act(ctx, "withdraw", version, policy, by, reason)


@versions.command("canary")
@policy_option
@click.option(
    "--namespace",
    default=None,
    help="Decide on replay namespace NAME's weights and samples topics, not the live "
    "ones [default: kafka.namespace].",
)
@field_option(
    CanarySettings,
    "watch_action",
    "--watch-action",
    help="On a drop the watch finds: withdraw (an event) or alert (a warning and a metric only).",
)
@field_option(
    CanarySettings,
    "metrics_port",
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="Serve liverl_canary_* and liverl_watch_* here (no authentication).",
)
@field_option(
    CanarySettings, "metrics_host", "--metrics-host", help="Interface the metrics server binds to."
)
@click.option(
    "--once",
    is_flag=True,
    help="Catch up, evaluate once (sending a decision if one is due), and exit.",
)
@click.pass_context
def canary_command(
    ctx: click.Context, policy: str | None, namespace: str | None, once: bool, **options: Any
) -> None:
    """Judge canaries by their live outcomes, and watch the serving version for a drop.

    Follows liverl.weights.v1 and liverl.samples.v1 (at start: from their beginning). While a
    canary serves its share of the traffic, its sessions' outcomes (verified by a gate, a
    test run or feedback; else the mean judged score of their turns, such as the user's
    replies) are compared with the stable version's over the same period:
    with Beta(1,1) priors, p_worse = P(canary rate < stable rate - margin). With at least
    min_sessions sessions per arm it withdraws the canary when p_worse >=
    withdraw_probability, rolls it out when 1 - p_worse >= rollout_probability, and after
    max_sessions canary sessions decides by the posterior means. Each decision is one
    rollout or withdraw event on the weights topic, by "canary", with its figures; every
    gateway follows it. A restart never sends a decision twice (one event id per version).

    With no canary, the regression watch compares the serving version's last watch_window
    sessions with its parent's; a drop (P(serving < parent - margin) >= watch_probability)
    withdraws it (by "watch"), or only alerts with --watch-action alert. Once per version.

    Settings: the [canary] section (LIVERL_CANARY_*). `liverl up` starts this command
    unless --without canary.
    """
    import logging
    import signal
    import threading

    from pydantic import ValidationError

    from .runner import CanaryRunner

    settings = _settings(ctx)
    try:
        cfg = merged(settings.canary, ctx, options)
    except ValidationError as exc:
        raise click.UsageError("; ".join(e["msg"] for e in exc.errors())) from None
    namespace = namespace or settings.kafka.namespace
    if namespace:
        from pipeline.replay import namespace as nsmod

        nsmod.check_name(namespace)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    server = None
    if cfg.metrics_port is not None:
        from prometheus_client import start_http_server

        try:
            server, _ = start_http_server(cfg.metrics_port, addr=cfg.metrics_host)
        except OSError as exc:
            raise click.ClickException(
                f"metrics server: cannot listen on {cfg.metrics_host}:{cfg.metrics_port} "
                f"({exc.strerror or exc}); pass another --metrics-port"
            ) from exc
    stop = threading.Event()
    if not once:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    policy = _policy(ctx, policy)
    runner = CanaryRunner(
        settings,
        cfg,
        policy_id=policy,
        require_promoted=_require_promoted(settings),
        namespace=namespace,
    )
    try:
        runner.run(stop, once=once)
    except LookupError as exc:
        raise click.UsageError(str(exc)) from exc
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    click.echo(
        f"{policy}: {len(runner.sent)} decision(s) sent"
        + "".join(
            f"; {e.action['by']} {e.action['kind']} v{e.version}"
            for e in runner.sent
            if e.action is not None
        )
    )
