"""``liverl replay``, ``liverl diff-rewards`` and ``liverl drop-namespace`` (registered in
``pipeline.cli``). See docs/architecture.md#replay-and-namespaces."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from pipeline.kafka import names
from pipeline.settings import Settings

from . import namespace as nsmod

DEFAULT_TOPICS = "interactions,next_states"


def _settings(ctx: click.Context) -> Settings:
    obj: dict[str, Any] = ctx.find_root().obj or {}
    settings: Settings = obj.get("settings") or Settings()
    # A replay reads live topics: a namespace in the environment must not redirect its reads.
    if settings.kafka.namespace:
        settings = settings.model_copy(
            update={"kafka": settings.kafka.model_copy(update={"namespace": None})}
        )
    return settings


def _known_topics(settings: Settings) -> dict[str, tuple[str, int]]:
    """topic -> (spec key field, partitions), from ``topics/``."""
    from pipeline.kafka.topics import TopicSpecError, load_specs

    try:
        specs = load_specs(
            settings.topics.specs_dir,
            settings.topics.replication_factor,
            max_record_bytes=settings.kafka.max_record_bytes,
        )
    except TopicSpecError as exc:
        raise click.ClickException(str(exc)) from exc
    return {s.name: (s.key, s.partitions) for s in specs}


def _sessions(values: tuple[str, ...]) -> list[str] | None:
    out = sorted({s.strip() for v in values for s in v.split(",") if s.strip()})
    return out or None


@click.command("replay")
@click.option(
    "--from",
    "source_kind",
    type=click.Choice(["kafka", "delta"]),
    default="kafka",
    show_default=True,
    help="Read the live topics, or the Delta archive (<lake>/events/).",
)
@click.option(
    "--topics",
    "topic_args",
    multiple=True,
    default=(DEFAULT_TOPICS,),
    show_default=True,
    help="Topics to replay, full or short names, repeated or comma-separated.",
)
@click.option("--since", default=None, help="Start: ISO-8601 time, or 30m/2h/1d/1w ago.")
@click.option(
    "--until",
    default=None,
    help="End (exclusive): ISO-8601, 2h ago, or now "
    "[default: the end of each partition at the first run].",
)
@click.option(
    "--sessions",
    "session_args",
    multiple=True,
    help="Only these sessions (repeated or comma-separated); each must have an event in the range.",
)
@click.option(
    "--allocate",
    type=click.Choice(["all", "uniform", "frontier"]),
    default="all",
    show_default=True,
    help="Replay --budget sessions of the lake's trajectories drawn uniformly or by frontier "
    "sampling (tasks solved near 50 % first) instead of every session; recorded in the "
    "allocations table. Instead of --sessions.",
)
@click.option(
    "--budget", type=click.IntRange(min=1), default=None, help="Sessions --allocate draws."
)
@click.option("--allocate-seed", type=int, default=0, show_default=True)
@click.option(
    "--where", default=None, help="With --allocate: SQL filter on the trajectories rows drawn from."
)
@click.option(
    "--speed",
    default="max",
    show_default=True,
    help="max, or pace by the original timestamps: 1x, 10x, 0.5x ...",
)
@click.option("--into", "into", required=True, help="Namespace NAME: topics replay.NAME.*.")
@click.option(
    "--again",
    "--force",
    "again",
    is_flag=True,
    help="Replay a range that already finished once more (a second copy).",
)
@click.option(
    "--lake-root",
    type=click.Path(path_type=Path),
    default=None,
    help="With --from delta: the lake holding events/; with --allocate: the lake whose "
    "trajectories are drawn from [default: <state_dir>/lake].",
)
@click.pass_context
def replay(
    ctx: click.Context,
    source_kind: str,
    topic_args: tuple[str, ...],
    since: str | None,
    until: str | None,
    session_args: tuple[str, ...],
    allocate: str,
    budget: int | None,
    allocate_seed: int,
    where: str | None,
    speed: str,
    into: str,
    again: bool,
    lake_root: Path | None,
) -> None:
    """Republish live events, byte-exact and in per-partition order, into namespace --into.

    \b
    The first run fixes the range (as offsets) in <state_dir>/replay/NAME/replay.json;
    running the same command again resumes an interrupted replay, or does nothing when it
    finished (--again replays it once more). Re-judging a day with other rules:
      liverl replay --topics interactions,next_states --since 1d --into rejudge
      liverl workers --namespace rejudge --rules other.yaml
      liverl diff-rewards rejudge
    """
    from rich.console import Console

    from .replay import (
        MANIFEST,
        DeltaSource,
        KafkaSource,
        Manifest,
        canonical_time,
        describe_request,
        foreign_replays,
        keys_partitions,
        parse_speed,
        parse_time,
        rederived,
        resume_points,
        run,
    )

    settings = _settings(ctx)
    nsmod.check_name(into)
    specs = _known_topics(settings)
    topics = names.resolve_topics(topic_args, list(specs))
    pace = parse_speed(speed)
    since_ms = parse_time(since, "--since") if since is not None else None
    until_ms = parse_time(until, "--until") if until is not None else None
    if since_ms is not None and until_ms is not None and since_ms >= until_ms:
        raise click.UsageError(
            f"--since {since} is not before --until {until}: the range would be empty"
        )
    sessions = _sessions(session_args)
    console = Console(stderr=True)
    path = nsmod.local_dir(settings.state_dir, into) / MANIFEST
    try:
        manifest = Manifest.load(path)
    except Exception as exc:  # noqa: BLE001 - a damaged manifest: say where, change nothing
        raise click.ClickException(f"cannot read the replay manifest {path}: {exc}") from exc
    allocation_spec, drawn = None, None
    if allocate != "all":
        sessions, allocation_spec, drawn = _allocated_sessions(
            settings, manifest, sessions, allocate, budget, allocate_seed, where, into,
            lake_root, console)  # fmt: skip
    keys = {s.encode() for s in sessions} if sessions else None
    request = {
        "from": source_kind,
        "topics": sorted(topics),
        "since": canonical_time(since),
        "until": canonical_time(until),
        "sessions": sessions,
    }
    if allocation_spec is not None:  # absent otherwise: older manifests stay equal
        request["allocation"] = allocation_spec
    source: KafkaSource | DeltaSource
    if source_kind == "kafka":
        source = KafkaSource(settings)
    else:
        root = lake_root or settings.trainer.under_state_dir(settings.state_dir).lake_root
        source = DeltaSource(settings, root, lambda topic: specs[topic][1])
    try:
        if manifest is not None:
            if manifest.request != request:
                raise click.UsageError(
                    f"namespace {into!r} already holds another replay "
                    f"({describe_request(manifest.request)}); this one asks for "
                    f"{describe_request(request)}. Replay into another "
                    f"namespace, or drop it first: liverl drop-namespace {into}"
                )
            if again:
                if manifest.completed < manifest.passes:
                    raise click.UsageError(
                        f"pass {manifest.passes} into {into!r} has not finished: run the same "
                        "command without --again to complete it first"
                    )
                manifest.passes += 1
            elif manifest.completed >= manifest.passes:
                click.echo(
                    f"nothing to replay: {into} already holds this range "
                    f"({manifest.total} source records, pass {manifest.completed}); "
                    "--again replays it once more"
                )
                return
        else:
            if (run_id := foreign_replays(settings, into, topics)) is not None:
                raise click.UsageError(
                    f"namespace {into!r} holds records of replay {run_id} but no manifest at "
                    f"{path} (another state dir?); drop it first: liverl drop-namespace {into}"
                )

            def session_parts(topic: str, partitions: int) -> set[int] | None:
                if keys is None or specs[topic][0] != "session_id":
                    return None
                return keys_partitions(keys, partitions)

            spans = source.spans(topics, since_ms, until_ms, session_parts)
            if keys is not None:
                present = source.keys_present(spans, keys)
                unknown = sorted(k.decode() for k in keys - present)
                if unknown:
                    raise click.UsageError(
                        f"unknown session(s) {', '.join(unknown)}: no event of them in "
                        f"{', '.join(topics)} between {fmt_bound(since)} and {fmt_bound(until)}"
                    )
            if not spans:
                raise click.UsageError(
                    f"nothing in range: {', '.join(topics)} have no record between "
                    f"{fmt_bound(since)} and {fmt_bound(until)}"
                )
            manifest = Manifest(into, request, spans, since_ms=since_ms, until_ms=until_ms)
        if isinstance(source, DeltaSource):
            source.window(manifest.since_ms, manifest.until_ms)
        created = nsmod.ensure_topics(settings, into)
        if created:
            console.print(f"namespace {into}: created {len(created)} topic(s)", highlight=False)
        _check_partitions(settings, manifest)
        manifest.save(path)
        if drawn is not None:
            from pipeline.trainer import offline

            root = lake_root or settings.trainer.under_state_dir(settings.state_dir).lake_root
            offline.record_allocation(Path(root), drawn)
        starts, resumed = resume_points(settings, manifest)
        done = sum(max(0, starts[(s.topic, s.partition)] - s.start) for s in manifest.spans)
        if resumed:
            console.print(
                f"resuming pass {manifest.passes}: {done} of {manifest.total} source offsets "
                f"already replayed in {resumed} partition(s)",
                highlight=False,
            )
        try:
            stats = run(
                settings,
                manifest,
                source,
                starts,
                speed=pace,
                keys=keys,
                console=console,
                skip=rederived(manifest.request["topics"]),
            )
        except KeyboardInterrupt:
            console.print("interrupted: run the same command again to resume")
            sys.exit(130)
        manifest.completed = manifest.passes
        manifest.save(path)
    finally:
        source.close()
    left = (
        f", {stats.left_to_workers} derived next state(s) left to the namespace's workers"
        if stats.left_to_workers
        else ""
    )
    click.echo(
        f"replayed {stats.produced} record(s) ({stats.examined} examined{left}) of "
        f"{', '.join(topics)} into {into} in {stats.seconds:.1f}s "
        f"({stats.rate:,.0f} records/s); pass {manifest.passes} complete"
    )


def _allocated_sessions(
    settings: Settings,
    manifest: Any,
    sessions: list[str] | None,
    allocate: str,
    budget: int | None,
    seed: int,
    where: str | None,
    into: str,
    lake_root: Path | None,
    console: Any,
) -> tuple[list[str], str, Any]:
    """The sessions an allocation draws; a replay resumed with the same allocation keeps the
    sessions its manifest holds (the lake has grown since: a new draw would differ)."""
    from pipeline.trainer import offline
    from pipeline.trainer.errors import OfflineInputError

    from .allocation import allocate_sessions

    if sessions:
        raise click.UsageError("give --sessions or --allocate, not both")
    if budget is None:
        raise click.UsageError(f"--allocate {allocate} needs --budget N (sessions)")
    allocation = offline.Allocation(allocate, budget, seed)
    spec = f"{allocation.spec}|{where or ''}"
    if manifest is not None and manifest.request.get("allocation") == spec:
        return list(manifest.request["sessions"]), spec, None
    root = lake_root or settings.trainer.under_state_dir(settings.state_dir).lake_root
    try:
        drawn, chosen = allocate_sessions(Path(root), where, allocation, into)
    except OfflineInputError as exc:
        raise click.UsageError(f"--allocate: {exc}") from None
    if not drawn:
        raise click.UsageError(
            "--allocate: no session in the lake's trajectories"
            + (f" where {where}" if where else "")
        )
    for line in offline.allocation_summary(chosen):
        console.print(line, highlight=False)
    return drawn, spec, chosen


def fmt_bound(value: str | None) -> str:
    return value if value is not None else "the start/end of the topics"


def _check_partitions(settings: Settings, manifest: Any) -> None:
    """Source partition p goes to destination partition p: the copy needs at least as many."""
    from .replay import partitions_of, reader

    need: dict[str, int] = {}
    for s in manifest.spans:
        need[s.topic] = max(need.get(s.topic, 0), s.partition + 1)
    c = reader(settings)
    try:
        for topic, count in need.items():
            dest = names.resolve(topic, manifest.namespace)
            have = len(partitions_of(c, dest) or [])
            if have < count:
                raise click.ClickException(
                    f"{dest} has {have} partition(s) but {topic} has data in partition "
                    f"{count - 1}: align topics/{topic} specs with the broker "
                    f"(`liverl topics apply` then `liverl topics apply --namespace "
                    f"{manifest.namespace}`)"
                )
    finally:
        c.close()


@click.command("diff-rewards")
@click.argument("name")
@click.option(
    "--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True
)
@click.option("--changed", is_flag=True, help="Only rows whose reward changed.")
@click.pass_context
def diff_rewards(ctx: click.Context, name: str, fmt: str, changed: bool) -> None:
    """Per (session, turn): the live reward, namespace NAME's, and the difference.

    Reads both rewards topics from the beginning up to their current ends with assign only:
    no consumer group offset is read or committed.
    """
    import orjson
    from rich.console import Console, JustifyMethod
    from rich.table import Table

    from .diff import diff_rewards as compute
    from .replay import MANIFEST, Manifest

    settings = _settings(ctx)
    nsmod.check_name(name)
    topic = names.resolve(names.REWARDS, name)
    if topic not in nsmod.existing_topics(settings):
        raise click.UsageError(
            f"namespace {name!r} has no rewards topic {topic}; replay into it first "
            f"(liverl replay ... --into {name})"
        )
    try:
        manifest = Manifest.load(nsmod.local_dir(settings.state_dir, name) / MANIFEST)
    except Exception:  # noqa: BLE001 - the manifest only narrows the live read
        manifest = None
    result = compute(settings, name, since_ms=manifest.since_ms if manifest else None)
    rows = [r for r in result.rows if r.changed or not changed]
    summary = result.summary()
    if fmt == "json":
        doc = {"rows": [r.to_dict() for r in rows], "summary": summary}
        click.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
        return
    console = Console(width=None if sys.stdout.isatty() else 200)

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:+.4f}"

    table = Table(title=f"rewards: live vs {name}")
    columns: list[tuple[str, JustifyMethod]] = [
        ("session", "left"),
        ("turn", "right"),
        ("live", "right"),
        (name, "right"),
        ("Δ", "right"),
    ]
    for col, justify in columns:
        table.add_column(col, justify=justify)
    for r in rows:
        style = "yellow" if r.changed else None
        table.add_row(
            r.session_id,
            str(r.turn),
            num(None if r.live is None else r.live.total),
            num(None if r.new is None else r.new.total),
            num(r.delta),
            style=style,
        )
    if rows:
        console.print(table)
    console.print(
        f"{summary['turns_compared']} turn(s) compared in {summary['sessions']} session(s), "
        f"{summary['changed']} changed, mean |Δ| {summary['mean_abs_delta']:.4f}, "
        f"max |Δ| {summary['max_abs_delta']:.4f}; only live {summary['only_live']}, "
        f"only {name} {summary['only_namespace']}",
        highlight=False,
    )


@click.command("drop-namespace")
@click.argument("name")
@click.option("--yes", is_flag=True, help="Do not ask.")
@click.pass_context
def drop_namespace(ctx: click.Context, name: str, yes: bool) -> None:
    """Delete namespace NAME: its topics and consumer groups (prefix replay.NAME.) and its
    local state (<state_dir>/replay/NAME). Nothing live is touched."""
    settings = _settings(ctx)
    nsmod.check_name(name)
    topics = nsmod.namespace_topics(settings, name)
    local = nsmod.local_dir(settings.state_dir, name)
    if not topics and not local.exists():
        click.echo(f"no namespace {name!r}: nothing to drop")
        return
    if not yes:
        click.confirm(
            f"delete {len(topics)} topic(s) under {names.prefix(name)}*, their groups and {local}?",
            abort=True,
        )
    dropped, groups = nsmod.drop(settings, settings.state_dir, name)
    click.echo(f"dropped {name}: {len(dropped)} topic(s), {len(groups)} group(s), {local}")
