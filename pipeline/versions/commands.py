"""``liverl versions``: list and show a policy's weight versions; promote, pin, unpin and
roll back, each one ``weights`` event that every gateway follows (pipeline/versions/table.py
says how) and that stays in the log as the audit trail. The logic lives in ``table`` and
``actions``; these commands read, print and send."""

from __future__ import annotations

import getpass
import sys
import time
from typing import Any

import click

from pipeline import events

from . import actions, reading, rule
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
    votes = (f"{r['status']} {g.get('gate_won', 0)}-{g.get('gate_lost', 0)}-"
             f"{g.get('gate_tied', 0)}" if g else r["status"])
    probe = (f"{g['gate_probe_correct']}/{g.get('gate_probe_n', '?')} "
             f"(live {g.get('gate_live_probe_correct', '?')})"
             if "gate_probe_correct" in g else "-")
    fluency = (f"{g['gate_fluency']:.2f} (live {g.get('gate_live_fluency', 0):.2f})"
               if isinstance(g.get("gate_fluency"), int | float) else "-")
    return votes, probe, fluency


def _flags(r: dict[str, Any]) -> str:
    return ",".join(f for f in ("live", "pinned", "withdrawn") if r[f]) or "-"


def _table(ctx: click.Context, policy: str, outcomes: bool) -> tuple[VersionLog,
                                                                      list[dict[str, Any]]]:
    settings = _settings(ctx)
    log, table_rows = reading.version_rows(settings, policy, outcomes=outcomes,
                                           require_promoted=_require_promoted(settings))
    if not log.manifests:
        raise VersionError(f"policy {policy} has no published version on the weights topic "
                           "(liverl train publishes them)")
    return log, table_rows


def _echo_json(doc: Any) -> None:
    import orjson

    click.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())


policy_option = click.option("--policy", default=None,
                             help="The policy [default: trainer.policy].")
format_option = click.option("--format", "fmt", type=click.Choice(["table", "json"]),
                             default="table", show_default=True)


@click.group("versions")
def versions() -> None:
    """A policy's weight versions, which one serves, and the operator's levers.

    promote, pin, unpin and rollback are each one event on liverl.weights.v1 (who, when,
    why), the topic every gateway follows: each replica moves to the version it names within
    its next poll (about half a second), between requests. A retried command is found in the
    log and not sent again.
    """


@versions.command("list")
@policy_option
@format_option
@click.option("--outcomes/--no-outcomes", default=True, show_default=True,
              help="Read the samples topic for each version's live outcome rate.")
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
    live = log.live(_require_promoted(_settings(ctx)))
    pinned = f", pinned at v{log.pinned}" if log.pinned is not None else ""
    now = f"v{live}" if live is not None else "the base"
    table = Table(title=f"{policy}: {len(table_rows)} versions, {now} should serve{pinned}")
    for col in ("v", "parent", "steps", "samples", "method", "gate votes", "probe", "fluency",
                "served since", "until", "outcome rate (95% CI)", "size", ""):
        table.add_column(col)
    for r in table_rows:
        votes, probe, fluency = _gate(r)
        table.add_row(
            str(r["version"]), "-" if r["parent"] is None else str(r["parent"]),
            "-" if r["steps"] is None else str(r["steps"]),
            "-" if r["samples"] is None else str(r["samples"]), r["method"] or "-", votes,
            probe, fluency, _when(r["served_since_ms"]),
            _when(r["served_until_ms"]) if r["served_since_ms"] is not None else "-",
            rate_text(r["outcomes"]) if outcomes else "-", _size(r["size_bytes"]), _flags(r))
    console.print(table)


@versions.command("show")
@click.argument("version", type=int)
@policy_option
@format_option
@click.option("--outcomes/--no-outcomes", default=True, show_default=True,
              help="Read the samples topic for the version's live outcome rate.")
@click.pass_context
def show_command(ctx: click.Context, version: int, policy: str | None, fmt: str,
                 outcomes: bool) -> None:
    """One version in full: its row, its lineage (samples -> optimizer steps -> version, back
    through its parents), the sessions it trained on (from its folder's trajectories, when
    the folder is readable here) and the operator actions that named it."""
    from pipeline.serving.reloader import local_dir

    policy = _policy(ctx, policy)
    log, table_rows = _table(ctx, policy, outcomes)
    actions.known(log, version)
    row = next(r for r in table_rows if r["version"] == version)
    by_version = {r["version"]: r for r in table_rows}
    chain = [{"version": v, "samples": by_version[v]["samples"], "steps": by_version[v]["steps"],
              "step": by_version[v]["step"]} for v in lineage(log, version)]
    try:
        sessions = reading.trained_sessions(local_dir(row["uri"]))
    except Exception:  # noqa: BLE001 - a remote uri or an unreadable file: say unknown
        sessions = None
    doc = {**row, "lineage": chain, "sessions": sessions,
           "actions": [{"kind": a.kind, "by": a.by, "reason": a.reason, "ts_ms": a.ts_ms,
                        "event_id": a.event_id} for a in log.actions if a.version == version]}
    if fmt == "json":
        _echo_json(doc)
        return
    votes, probe, fluency = _gate(row)
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
        f" (now on: {', '.join(row['replicas']) or 'no replica'})",
        f"  outcomes    {rate_text(row['outcomes']) if outcomes else '(not read)'}",
        f"  size        {_size(row['size_bytes'])} at {row['uri']}",
        "  lineage     " + " <- ".join(
            f"v{c['version']} ({c['samples'] if c['samples'] is not None else '?'} samples, "
            f"{c['steps'] if c['steps'] is not None else '?'} steps)" for c in chain) + " <- base",
    ]
    if sessions is None:
        lines.append("  sessions    unknown (the version folder is not readable here)")
    else:
        lines.append(f"  sessions    {len(sessions)} trained on:")
        lines += [f"    {sid} ({n} turns)" for sid, n in sorted(sessions.items())]
    for a in doc["actions"]:
        lines.append(f"  {a['kind']:<11} {_when(a['ts_ms'])} by {a['by']}: "
                     f"{a['reason'] or '(no reason given)'} [{a['event_id']}]")
    click.echo("\n".join(lines))


def _act(ctx: click.Context, kind: str, version: int | None, policy: str | None,
         by: str | None, reason: str | None) -> None:
    settings = _settings(ctx)
    policy = _policy(ctx, policy)
    who = by or getpass.getuser()
    log = reading.weights_log(settings, policy)
    event = actions.action_event(log, kind, version, by=who, reason=reason,
                                 require_promoted=_require_promoted(settings))
    if event is None:
        done = actions.action_id(log, kind, version, who, reason)[0]
        click.echo(f"already in the log (event {done}): not sent again")
        return
    try:
        _produce(settings, event)
    except Exception as exc:  # noqa: BLE001 - Kafka's or the config's: say it, exit non-zero
        raise click.ClickException(
            f"{kind} v{event.version} not confirmed: {exc}. Run the same command again: it "
            "is sent once whatever the number of tries") from exc
    log.add(event)
    live = log.live(_require_promoted(settings))
    now = f"v{live}" if live is not None else "the base"
    click.echo(f"{kind} v{event.version} of {policy} by {who} (event {event.event_id}); "
               f"{now} should serve now")


by_option = click.option("--by", default=None, help="Who acts [default: the OS user].")
reason_option = click.option("--reason", default=None, help="Why, for the audit trail.")


@versions.command("promote")
@click.argument("version", type=int)
@policy_option
@by_option
@reason_option
@click.pass_context
def promote_command(ctx: click.Context, version: int, policy: str | None, by: str | None,
                    reason: str | None) -> None:
    """Count VERSION as promoted whatever the gate said (a withdrawn one comes back); it
    serves if it is the newest servable version and nothing is pinned."""
    _act(ctx, "promote", version, policy, by, reason)


@versions.command("pin")
@click.argument("version", type=int)
@policy_option
@by_option
@reason_option
@click.pass_context
def pin_command(ctx: click.Context, version: int, policy: str | None, by: str | None,
                reason: str | None) -> None:
    """Serve VERSION until unpin, whatever is published or promoted meanwhile (a version the
    gate rejected must be promoted first)."""
    _act(ctx, "pin", version, policy, by, reason)


@versions.command("unpin")
@policy_option
@by_option
@reason_option
@click.pass_context
def unpin_command(ctx: click.Context, policy: str | None, by: str | None,
                  reason: str | None) -> None:
    """End the pin: the newest servable version serves again."""
    _act(ctx, "unpin", None, policy, by, reason)


@versions.command("rollback")
@click.option("--to", "to", type=int, default=None,
              help="The version to go back to [default: the newest servable one older than "
                   "the live one].")
@policy_option
@by_option
@reason_option
@click.pass_context
def rollback_command(ctx: click.Context, to: int | None, policy: str | None, by: str | None,
                     reason: str | None) -> None:
    """Serve an older version: every version newer than it is withdrawn (never served again
    unless promoted), and versions published afterwards serve as usual."""
    _act(ctx, "rollback", to, policy, by, reason)
