"""``liverl forget --session S | --user U``: remove one session's, or one user's, data from
everywhere liverl keeps it, and record that it did (docs/architecture.md#data-retention-and-
forgetting).

A user is the interaction's ``user_id`` (``X-Liverl-User``, else the caller's key id, filled by
the gateway); ``--user`` finds the user's sessions in the archive's interaction tables, in the
interactions topic and in the gateway spools, then forgets each session.

This module orchestrates; each store's ``survey`` and ``erase`` live beside the format that
store owns, so a change to a format is a change to its forget:

- **Delta** (:mod:`pipeline.lake.forget`): every table of the lake (and of replay namespaces'
  lakes) with a ``session_id`` column, partitions rewritten without the rows, then a lite
  vacuum of the files removed at least ``vacuum_retention_hours`` ago (``--vacuum-now``:
  zero), safe next to a running trainer and archiver.
- **Trainer version folders** (:mod:`pipeline.trainer.forget`): ``vN/trainer/
  trajectories.parquet`` rewritten without the rows, the manifest's sha256 updated.
- **Faust changelogs** (:mod:`pipeline.processors.forget`): a tombstone for each of the
  sessions' keys whose latest value is not one already; likewise each task of the sessions
  in the compacted tasks topics (:func:`pipeline.processors.task_pool.forget_survey`).
- **Gateway spools** (:mod:`pipeline.serving.spool_forget`): rewritten only under the
  spool's lock taken exclusively, so never under a running gateway; a live spool still
  holding undelivered frames of the sessions is a refusal (they are about to reach Kafka);
  delivered frames in a live spool stay until the gateway deletes their segment, and the
  output and the log say so.
- **Kafka topics** (``cleanup.policy=delete``) cannot delete by key: their retention is the
  bound, which forget reports per topic from the records it saw.

Each run that changes something appends one row to the ``forget_log`` Delta table: who, when,
the session ids, a sha256 of the user id (never the id itself) and counts per place, never
content. ``--dry-run`` prints the same survey and changes nothing, the log included.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import os
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import orjson
import pyarrow as pa

from pipeline import __version__
from pipeline.errors import ForgetError
from pipeline.kafka import names
from pipeline.kafka.errors import ReadError
from pipeline.settings import Settings

# The stores' parts are imported where they are used: every `liverl` command loads this
# module (the CLI lists it), and the spool's and processors' parts pull in Kafka clients.
if TYPE_CHECKING:
    from pipeline.lake.forget import DeltaHit
    from pipeline.processors.forget import ChangelogHit
    from pipeline.serving.spool_forget import SpoolHit
    from pipeline.trainer.forget import VersionHit

FORGET_LOG = "forget_log"
FORGET_LOG_SCHEMA = pa.schema(
    [
        ("forget_id", pa.string()),
        ("ts_ms", pa.int64()),
        ("operator", pa.string()),  # who ran it: OS user@host
        ("target", pa.string()),  # session | user
        ("user_sha256", pa.string()),  # --user only: a hash, the id itself is not kept
        ("sessions", pa.list_(pa.string())),  # not "session_id": a later forget keeps the log
        ("removed", pa.string()),  # JSON counts per place (delta, changelogs, spools, versions)
        ("kept", pa.string()),  # JSON: what only time removes (Kafka retention, live spools)
        ("vacuum_retention_hours", pa.int64()),
        ("vacuumed_files", pa.int64()),
        ("liverl_version", pa.string()),
    ]
)
MAX_ID_CHARS = 256
# Kafka's default segment.ms (log.roll.hours = 168): a record is deleted with its segment, so
# it can outlive retention.ms by up to this when the spec does not set segment.ms.
DEFAULT_SEGMENT_MS = 7 * 24 * 3_600_000
GROUP_PREFIX = "liverl-forget-"  # the one-shot reader's throwaway group id


# ---- what was found --------------------------------------------------------------------------


@dataclass
class Survey:
    target: str
    value: str
    sessions: list[str]
    delta: list[DeltaHit] = field(default_factory=list)
    changelogs: list[ChangelogHit] = field(default_factory=list)
    spools: list[SpoolHit] = field(default_factory=list)
    versions: list[VersionHit] = field(default_factory=list)
    kafka: dict[str, tuple[int, int]] = field(default_factory=dict)  # topic -> (records, newest)
    notes: list[str] = field(default_factory=list)

    @property
    def found(self) -> bool:
        return bool(
            any(h.rows for h in self.delta)
            or any(h.keys for h in self.changelogs)
            or any(h.pending or h.delivered or h.quarantined for h in self.spools)
            or any(h.rows for h in self.versions)
            or any(n for n, _ in self.kafka.values())
        )


# ---- places ----------------------------------------------------------------------------------


def lakes(settings: Settings, lake: Path) -> list[tuple[str, Path]]:
    """(label prefix, root) of the lake and of every replay namespace's lake."""
    out = [("", Path(lake))]
    for root in sorted((Path(settings.state_dir) / "replay").glob("*/lake")):
        if root.resolve() != Path(lake).resolve():
            out.append((f"replay/{root.parent.name}/", root))
    return out


def weights_roots(settings: Settings) -> list[Path]:
    main = Path(settings.trainer.under_state_dir(settings.state_dir).weights_root)
    return [main, *sorted((Path(settings.state_dir) / "replay").glob("*/weights"))]


def spool_dirs(settings: Settings, extra: Iterable[Path] = ()) -> list[Path]:
    """Gateway spools: ``--spool-dir``, a configured ``serve.spool_dir`` and every folder of
    ``<state_dir>/spool/`` (``liverl serve`` uses ``<state_dir>/spool/<replica_id>``)."""
    from pipeline.serving.settings import ServeSettings

    found: list[Path] = list(extra)
    if settings.serve.spool_dir != ServeSettings().spool_dir:
        found.append(Path(settings.serve.spool_dir))
    base = Path(settings.state_dir) / "spool"
    if base.is_dir():
        found += [base, *sorted(p for p in base.iterdir() if p.is_dir())]
    out: dict[Path, Path] = {}
    for p in found:
        if p.is_dir() and (any(p.glob("*.log")) or (p / "quarantine").is_dir()):
            out.setdefault(p.resolve(), p)
    return list(out.values())


# ---- Kafka -----------------------------------------------------------------------------------


def broker_topics(settings: Settings, timeout_s: float = 15.0) -> set[str]:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    try:
        meta = AdminClient(settings.kafka_client_config()).list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise ForgetError(f"cannot reach Kafka at {settings.bootstrap}: {exc}") from None
    return {t for t, m in meta.topics.items() if m.error is None}


def interaction_topics(settings: Settings, present: set[str]) -> list[str]:
    """The interactions topic and its copies in replay namespaces (kept until dropped)."""
    live = settings.serve.interactions_topic
    topic = names.resolve(live, settings.kafka.namespace)
    copies = [
        t
        for t in sorted(present)
        if (ns := names.namespace_of(t)) and names.live(t, ns) == live and t != topic
    ]
    return [t for t in (topic, *copies) if t in present]


def scan_interactions(
    settings: Settings, topics: list[str], sessions: set[str], user: str | None
) -> tuple[set[str], dict[str, tuple[int, int]]]:
    """Sessions of ``user`` on the interactions topics, and per topic (records, newest
    timestamp) of those sessions (``sessions`` plus the user's)."""
    needle = orjson.dumps(user) if user is not None else None
    counts: dict[tuple[str, str], list[int]] = {}

    def handle(m: Any) -> None:
        key, value = m.key(), m.value()
        sid = key.decode("utf-8", "replace") if key else None
        if needle is not None and value and needle in value:
            with contextlib.suppress(Exception):
                doc = orjson.loads(value)
                if doc.get("user_id") == user and isinstance(doc.get("session_id"), str):
                    sid = doc["session_id"]
                    sessions.add(sid)
        if sid is not None:
            c = counts.setdefault((m.topic(), sid), [0, 0])
            c[0] += 1
            c[1] = max(c[1], m.timestamp()[1])

    from pipeline.kafka.reader import read_to_end

    read_to_end(settings, topics, handle, group_prefix=GROUP_PREFIX)
    out: dict[str, tuple[int, int]] = {}
    for topic in topics:
        mine = [c for (t, sid), c in counts.items() if t == topic and sid in sessions]
        out[topic] = (sum(c[0] for c in mine), max((c[1] for c in mine), default=0))
    return sessions, out


# ---- the stores' parts --------------------------------------------------------------------


def survey_delta(settings: Settings, lake: Path, sessions: list[str]) -> list[DeltaHit]:
    """The sessions' rows in the lake and in every replay namespace's lake."""
    from pipeline.lake import forget as lake_forget

    return lake_forget.survey(lakes(settings, lake), sessions)


def write_log(lake: Path, row: dict[str, Any]) -> None:
    from deltalake import write_deltalake

    write_deltalake(
        str(Path(lake) / FORGET_LOG),
        pa.Table.from_pylist([row], schema=FORGET_LOG_SCHEMA),
        mode="append",
    )


# ---- the survey and the run ------------------------------------------------------------------


def _retention(settings: Settings) -> dict[str, tuple[int, int]]:
    """topic -> (retention.ms, segment.ms) from topics/ (-1: kept forever)."""
    from pipeline.kafka.topics import load_specs

    out = {}
    with contextlib.suppress(Exception):
        for spec in load_specs(settings.topics.specs_dir):
            cfg = spec.config
            out[spec.name] = (
                int(cfg.get("retention.ms", 604_800_000)),
                int(cfg.get("segment.ms", DEFAULT_SEGMENT_MS)),
            )
    return out


def kafka_kept(settings: Settings, s: Survey) -> dict[str, dict[str, Any]]:
    """Per topic holding the sessions' records: how many (when known) and the time by which
    retention has deleted them (newest record + retention.ms + segment.ms)."""
    newest: dict[str, int] = {}
    records: dict[str, int] = {}
    for hit in s.delta:
        for topic, ts in hit.newest_ms.items():
            newest[topic] = max(newest.get(topic, 0), ts or 0)
    for topic, (n, ts) in s.kafka.items():
        if n:
            newest[topic] = max(newest.get(topic, 0), ts)
            records[topic] = n
    specs = _retention(settings)
    out: dict[str, dict[str, Any]] = {}
    for topic, ts in sorted(newest.items()):
        ns = names.namespace_of(topic)
        retention, segment = specs.get(names.live(topic, ns), (604_800_000, DEFAULT_SEGMENT_MS))
        if ns:
            retention = -1  # replay namespaces keep everything (docs: Replay and namespaces)
        entry: dict[str, Any] = {"retention_ms": retention}
        if topic in records:
            entry["records"] = records[topic]
        if ns:
            entry["gone_by"] = f"never: `liverl drop-namespace {ns}` deletes it"
        elif retention < 0:
            entry["gone_by"] = "never (retention.ms -1)"
        else:
            end = (ts + retention + segment) / 1000
            entry["gone_by"] = datetime.fromtimestamp(end, UTC).isoformat(timespec="seconds")
        out[topic] = entry
    return out


def resolve_sessions(
    settings: Settings, lake: Path, spools: list[Path], user: str, topics: list[str]
) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """The user's sessions from the archive, the spools and the interactions topics, and per
    topic (records, newest timestamp) of those sessions."""
    from pipeline.lake import forget as lake_forget
    from pipeline.serving import spool_forget

    found = lake_forget.user_sessions(lakes(settings, lake), user)
    topic = names.resolve(settings.serve.interactions_topic, settings.kafka.namespace)
    for spool in spools:
        found |= spool_forget.user_sessions(spool, topic, user)
    found, kafka = scan_interactions(settings, topics, found, user)
    return sorted(found), kafka


def survey(
    settings: Settings,
    lake: Path,
    target: str,
    value: str,
    spools: list[Path],
    live: dict[Path, bool],
) -> Survey:
    """Resolve the sessions, then ask every store what it holds of them."""
    try:
        return _survey(settings, lake, target, value, spools, live)
    except ReadError as exc:  # a topic read stopped short: nothing may be missed silently
        raise ForgetError(str(exc)) from None


def _survey(
    settings: Settings,
    lake: Path,
    target: str,
    value: str,
    spools: list[Path],
    live: dict[Path, bool],
) -> Survey:
    from pipeline.processors import forget as processors_forget
    from pipeline.processors import task_pool
    from pipeline.serving import spool_forget
    from pipeline.trainer import forget as trainer_forget

    present = broker_topics(settings)
    topics = interaction_topics(settings, present)
    if target == "user":
        sessions, kafka = resolve_sessions(settings, lake, spools, value, topics)
    else:
        sessions = [value]
        kafka = scan_interactions(settings, topics, {value}, None)[1]
    s = Survey(target, value, sessions, kafka=kafka)
    if not sessions:
        return s
    s.delta = survey_delta(settings, lake, sessions)
    s.changelogs = processors_forget.survey(
        settings, settings.processors.app_id, sessions, present
    ) + task_pool.forget_survey(settings, sessions, present)
    s.spools = [spool_forget.survey(p, sessions, live.get(p, False)) for p in spools]
    s.versions = trainer_forget.survey(weights_roots(settings), sessions)
    now = time.time() * 1000
    retain_ms = settings.processors.retain_s * 1000
    for hit in s.changelogs:
        if hit.touched_ms and now - hit.touched_ms < retain_ms:
            s.notes.append(
                f"{hit.topic}: the session's state changed {(now - hit.touched_ms) / 60000:.0f} "
                "min ago; a running worker keeps it in memory until it expires "
                f"(processors.retain_s = {settings.processors.retain_s:g} s) and would write it "
                "back if the session went on: run forget again after that, or restart the "
                "workers now"
            )
    return s


def operator() -> str:
    try:
        who = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in a container
        who = f"uid{os.getuid()}"
    return f"{who}@{socket.gethostname()}"


def _echo_survey(s: Survey, dry_run: bool) -> None:
    what = f"session {s.value}" if s.target == "session" else f"user {s.value}"
    click.echo(
        f"forget {what}: {len(s.sessions)} session(s)"
        + (" (dry run: nothing is changed)" if dry_run else "")
    )
    for sid in s.sessions:
        click.echo(f"  session {sid}")
    verb = "would remove" if dry_run else "removing"
    for d in s.delta:
        if d.rows:
            click.echo(f"  delta      {d.label}: {verb} {d.rows} row(s)")
    for v in s.versions:
        click.echo(f"  weights    {v.folder}: {verb} {v.rows} trajectory row(s)")
    for c in s.changelogs:
        click.echo(f"  changelog  {c.topic}: {verb} {len(c.keys)} key(s) (tombstones)")
    for sp in s.spools:
        if sp.live:
            if sp.pending:
                click.echo(
                    f"  spool      {sp.path}: {sp.pending} undelivered frame(s) held by a "
                    "running gateway: a forget is refused until they are delivered"
                )
            if sp.delivered:
                click.echo(
                    f"  spool      {sp.path}: {sp.delivered} delivered frame(s) kept: a "
                    "gateway holds this spool (they go with their segment)"
                )
            continue
        if sp.pending or sp.delivered or sp.quarantined:
            click.echo(
                f"  spool      {sp.path}: {verb} {sp.pending} undelivered and blanking "
                f"{sp.delivered} delivered frame(s), {len(sp.quarantined)} quarantine "
                "file(s)"
            )
    for note in s.notes:
        click.echo(f"  note: {note}")


@click.command("forget")
@click.option("--session", "session_id", default=None, metavar="S", help="Forget this session.")
@click.option(
    "--user",
    "user_id",
    default=None,
    metavar="U",
    help="Forget every session whose interactions carry user_id U (X-Liverl-User, "
    "else the API key's id).",
)
@click.option("--dry-run", is_flag=True, help="Print what would be removed; change nothing.")
@click.option(
    "--vacuum-now",
    is_flag=True,
    help="Vacuum with zero retention: the files are gone now, and so is every older "
    "version of the tables (time travel, a running offline retraining).",
)
@click.option(
    "--vacuum-only",
    is_flag=True,
    help="Forget nothing: vacuum the files forgets removed at least "
    "LIVERL_FORGET_VACUUM_RETENTION_HOURS ago (run it daily).",
)
@click.option(
    "--spool-dir",
    "spool_dir",
    multiple=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A gateway spool to clean besides those under <state_dir>/spool (repeatable).",
)
@click.option(
    "--lake",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The lake [default: <state_dir>/lake].",
)
@click.pass_context
def forget(
    ctx: click.Context,
    session_id: str | None,
    user_id: str | None,
    dry_run: bool,
    vacuum_now: bool,
    vacuum_only: bool,
    spool_dir: tuple[Path, ...],
    lake: Path | None,
) -> None:
    """Remove one session's (--session) or one user's (--user) data from the lake, the
    trainer's version folders, the processors' changelogs and the gateway spools.

    Kafka topics keep the records until their retention (docs/architecture.md, "Data
    retention and forgetting"); each run that changes something is recorded, counts only, in
    the forget_log table.
    """
    from pipeline.lake import forget as lake_forget
    from pipeline.lake.commands import default_lake
    from pipeline.processors import forget as processors_forget
    from pipeline.serving import spool_forget
    from pipeline.trainer import forget as trainer_forget

    settings: Settings = (ctx.find_root().obj or {}).get("settings") or Settings()
    lake = lake or default_lake(ctx)
    retention = 0 if vacuum_now else settings.forget.vacuum_retention_hours
    if vacuum_only:
        if session_id is not None or user_id is not None or dry_run:
            raise click.UsageError("--vacuum-only takes no --session, --user or --dry-run")
        paths = [
            p
            for _, root in lakes(settings, lake)
            for p in lake_forget.session_tables(root).values()
        ]
        n = lake_forget.vacuum(paths, retention)
        click.echo(
            f"vacuumed {len(paths)} table(s): {n} file(s) removed at least "
            f"{retention} h ago deleted"
        )
        return
    if (session_id is None) == (user_id is None):
        raise click.UsageError("give exactly one of --session S or --user U")
    target, value = ("session", session_id) if session_id is not None else ("user", user_id)
    assert value is not None
    if not value or len(value) > MAX_ID_CHARS or not value.isprintable():
        raise click.UsageError(
            f"--{target} must be a printable id of 1 to {MAX_ID_CHARS} characters"
        )
    spools = spool_dirs(settings, spool_dir)
    with spool_forget.locks([] if dry_run else spools) as live:
        if dry_run:  # only probe the locks: a dry run must not delay a starting gateway
            live = {p: spool_forget.held(p) for p in spools}
        s = survey(settings, lake, target, value, spools, live)
        if not s.found:
            where = (
                "the archive, the interactions topic and the spools"
                if target == "user"
                else (
                    "the lake, the trainer's versions, the changelogs, the spools and the "
                    "interactions topic"
                )
            )
            raise click.UsageError(f"unknown {target} {value!r}: nothing of it in {where}")
        busy = [sp for sp in s.spools if sp.live and sp.pending]
        if busy and not dry_run:
            raise ForgetError(
                "; ".join(
                    f"{sp.pending} undelivered frame(s) of these sessions wait in the "
                    f"spool {sp.path}, held by a running gateway"
                    for sp in busy
                )
                + ": they are about to reach Kafka. Run forget again once the gateway has "
                "delivered them (its /metrics liverl_gateway_record_backlog is 0), or stop it."
            )
        _echo_survey(s, dry_run)
        # what only time removes: topic -> retention facts, live spool -> delivered frames
        kept: dict[str, dict[str, Any]] = {"kafka": kafka_kept(settings, s)}
        for topic, entry in kept["kafka"].items():
            click.echo(f"  kafka      {topic}: kept until retention, gone by {entry['gone_by']}")
        if dry_run:
            return
        removed: dict[str, dict[str, int]] = {
            "spools": {},
            "changelogs": {},
            "versions": {},
            "delta": {},
        }
        for sp in s.spools:
            if not sp.live and (sp.pending or sp.delivered or sp.quarantined):
                removed["spools"][str(sp.path)] = spool_forget.erase(sp, s.sessions)
        kept["spools_live"] = {
            str(sp.path): sp.delivered for sp in s.spools if sp.live and sp.delivered
        }
    if s.changelogs:
        processors_forget.erase(settings, s.changelogs)
        removed["changelogs"] = {c.topic: len(c.keys) for c in s.changelogs}
    for v in s.versions:
        removed["versions"][str(v.folder)] = trainer_forget.erase(v, s.sessions)
    # The archive last: `--user` finds sessions in its interactions, so a forget interrupted
    # before it can be run again with the same arguments.
    order = sorted((d for d in s.delta if d.rows), key=lambda d: d.archive)
    for d in order:
        removed["delta"][d.label] = lake_forget.erase(d, s.sessions)
    vacuumed = lake_forget.vacuum([d.path for d in s.delta], retention)
    row = {
        "forget_id": uuid.uuid4().hex,
        "ts_ms": int(time.time() * 1000),
        "operator": operator(),
        "target": target,
        "user_sha256": hashlib.sha256(value.encode()).hexdigest() if target == "user" else None,
        "sessions": s.sessions,
        "removed": orjson.dumps(removed, option=orjson.OPT_SORT_KEYS).decode(),
        "kept": orjson.dumps(kept, option=orjson.OPT_SORT_KEYS).decode(),
        "vacuum_retention_hours": retention,
        "vacuumed_files": vacuumed,
        "liverl_version": __version__,
    }
    write_log(lake, row)
    total = sum(sum(v.values()) for v in removed.values())
    click.echo(
        f"forgot {len(s.sessions)} session(s): {total} row(s), key(s) and frame(s) "
        f"removed; {vacuumed} file(s) vacuumed; recorded in {Path(lake) / FORGET_LOG} "
        f"as {row['forget_id']}"
    )
    if retention:
        click.echo(
            f"the replaced Delta files are deleted by the first vacuum after {retention} h "
            "(`liverl forget --vacuum-only`, or the next forget)"
        )
