"""``liverl`` command line."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipeline import __version__, events
from pipeline.errors import LiverlError
from pipeline.kafka.connection import BrokerSettings
from pipeline.options import field_option, merged
from pipeline.serving.settings import ServeSettings
from pipeline.settings import Settings, load_settings
from pipeline.trainer.config import TrainerSettings

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient

    from pipeline.kafka.broker import LocalBroker
    from pipeline.kafka.topics import TopicSpec

# Wide when piped (CI logs, tests) so tables are never cut to 80 columns.
console = Console(width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)


def _human_ms(value: str) -> str:
    """``1209600000`` -> ``14d``; keeps the raw value when it is not a whole unit."""
    try:
        ms = int(value)
    except ValueError:
        return value
    if ms < 0:
        return "forever"
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def _settings(ctx: click.Context) -> Settings:
    return ctx.obj["settings"]


def _fail(message: str, code: int = 1) -> NoReturn:
    # soft_wrap: one line however long (a namespace's missing topics run past any width);
    # rich would otherwise break it, and a command or a test reading it would see two.
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(code)


class LiverlGroup(click.Group):
    """The one place domain errors become CLI errors: ``error: <one line>`` on stderr and the
    error's exit status, no traceback (the library raises :class:`LiverlError`, never click's)."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except LiverlError as exc:
            _fail(exc.one_line(), exc.exit_code)


@click.group(cls=LiverlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Settings TOML file (default: $LIVERL_CONFIG or ./liverl.toml if present).",
)
@click.version_option(__version__, prog_name="liverl")
@click.pass_context
def cli(ctx: click.Context, config: Path | None) -> None:
    """liverl: real-time RL for LLM agents on Kafka.

    Every interaction, next-state signal, reward, sample, gradient step and weight
    version is an event. Settings come from a TOML file and LIVERL_* environment
    variables (e.g. LIVERL_KAFKA_BOOTSTRAP=host:9092 to use an existing cluster).
    """
    try:
        ctx.obj = {"settings": load_settings(config)}
    except (FileNotFoundError, ValueError) as exc:
        _fail(str(exc))
    # What every encode in this process writes when no settings are at hand (recorder, Faust).
    events.set_codec_version(ctx.obj["settings"].kafka.codec_version)


# ---- broker -------------------------------------------------------------------------------


@cli.group()
def broker() -> None:
    """Run the embedded Apache Kafka (KRaft) for local use and tests: one node, or a local
    cluster with --nodes 3 (or broker.nodes / LIVERL_BROKER_NODES).

    Jars come from Maven Central (resolved once with Maven into ~/.cache/liverl);
    data lives under the state dir (.liverl/kafka/data, a cluster's in
    .liverl/kafka/nodes-N/) and survives down/up.
    With LIVERL_KAFKA_BOOTSTRAP set, nothing local is started.
    """


_nodes_option = field_option(
    BrokerSettings,
    "nodes",
    "--nodes",
    type=click.IntRange(1, 5),
    default=None,  # None: the settings' broker.nodes
    help=f"Nodes of the local cluster (default broker.nodes, "
    f"{BrokerSettings.model_fields['nodes'].default}); 3 nodes listen on "
    "port, port+2, port+4 (9092, 9094, 9096).",
)


def _local_broker(ctx: click.Context, nodes: int | None = None) -> LocalBroker:
    from pydantic import ValidationError

    from pipeline.kafka.broker import LocalBroker

    settings = _settings(ctx)
    if not settings.uses_local_broker:
        console.print(
            f"an external cluster is configured ({settings.bootstrap}); nothing local to manage"
        )
        sys.exit(0)
    if nodes is not None and nodes != settings.broker.nodes:
        try:
            cfg = BrokerSettings.model_validate({**settings.broker.model_dump(), "nodes": nodes})
        except ValidationError as exc:
            raise click.UsageError(exc.errors()[0]["msg"]) from None
        settings = settings.model_copy(update={"broker": cfg})
    return LocalBroker(settings)


@broker.command("up")
@_nodes_option
@click.pass_context
def broker_up(ctx: click.Context, nodes: int | None) -> None:
    """Start Kafka (idempotent) and wait until every node answers metadata requests."""
    from pipeline.kafka.broker import BrokerError

    try:
        _local_broker(ctx, nodes).up()
    except BrokerError as exc:
        _fail(str(exc))
    if nodes is not None and nodes != _settings(ctx).broker.nodes:
        console.print(
            f"note: the settings say broker.nodes={_settings(ctx).broker.nodes}; set "
            f"LIVERL_BROKER_NODES={nodes} (or [broker] nodes) so topics, workers and the gateway "
            "use every node and its replication",
            markup=False,
        )


@broker.command("down")
@_nodes_option
@click.pass_context
def broker_down(ctx: click.Context, nodes: int | None) -> None:
    """Stop every node gracefully (SIGTERM, then SIGKILL after broker.stop_timeout_s)."""
    _local_broker(ctx, nodes).down()


@broker.command("status")
@_nodes_option
@click.pass_context
def broker_status(ctx: click.Context, nodes: int | None) -> None:
    """Show whether Kafka runs, where, and whether it answers (each node of a cluster)."""
    local = _local_broker(ctx, nodes)
    status = local.status()
    if not status.running:
        console.print(f"Kafka: [red]stopped[/] (would listen on {status.bootstrap})")
        if other := local.running_elsewhere():
            console.print(f"a local Kafka started with --nodes {other[0]} runs", highlight=False)
        sys.exit(3)
    state = "[green]answering[/]" if status.answering else "[yellow]not answering[/]"
    console.print(
        f"Kafka: running, pid {status.pid}, {status.bootstrap}, {state}, data {status.data_dir}"
    )
    if len(status.nodes) > 1:
        for node in status.nodes:
            how = (
                "[green]in the cluster[/]"
                if node.registered
                else "[yellow]not registered[/]"
                if node.pid
                else "[red]stopped[/]"
            )
            console.print(f"  node {node.node_id}: {node.address}, pid {node.pid or '-'}, {how}")


@broker.command("logs")
@click.option("-n", "--lines", default=50, show_default=True, help="Lines to show.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines.")
@click.pass_context
def broker_logs(ctx: click.Context, lines: int, follow: bool) -> None:
    """Print the broker's log tail."""
    local = _local_broker(ctx)
    console.print(local.log_tail(lines), highlight=False, markup=False)
    if follow:
        path = local.log_file
        with open(path, errors="replace") as fh:
            fh.seek(0, 2)
            try:
                while True:
                    line = fh.readline()
                    if line:
                        print(line, end="")
                    else:
                        time.sleep(0.5)
            except KeyboardInterrupt:
                pass


# ---- topics -------------------------------------------------------------------------------


@cli.group()
def topics() -> None:
    """Keep the cluster's topics equal to the specs in topics/*.yaml."""


def _admin(settings: Settings) -> AdminClient:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(settings.kafka_client_config())
    try:
        admin.list_topics(timeout=10)
    except Exception as exc:  # noqa: BLE001
        hint = (
            "start it with `liverl broker up`"
            if settings.uses_local_broker
            else "check LIVERL_KAFKA_BOOTSTRAP and the client settings"
        )
        _fail(f"cannot reach Kafka at {settings.bootstrap} ({exc}); {hint}")
    return admin


def _specs(settings: Settings) -> list[TopicSpec]:
    from pipeline.kafka.topics import TopicSpecError, load_specs

    try:
        return load_specs(
            settings.topics.specs_dir,
            settings.topics.replication_factor,
            max_record_bytes=settings.kafka.max_record_bytes,
        )
    except TopicSpecError as exc:
        _fail(str(exc))


@topics.command("apply")
@click.option("--dry-run", is_flag=True, help="Show the plan, change nothing.")
@click.option(
    "--namespace",
    default=None,
    help="Apply the specs to replay namespace NAME (topics replay.NAME.*), not to the live topics.",
)
@click.pass_context
def topics_apply(ctx: click.Context, dry_run: bool, namespace: str | None = None) -> None:
    """Create missing topics, grow partitions, align configs; refuse shrinks.

    A second run changes nothing and says so.
    """
    from pipeline.kafka import topics as t

    settings = _settings(ctx)
    specs = _specs(settings)
    if namespace:
        from pipeline.replay import namespace as ns

        specs = ns.specs(settings, ns.check_name(namespace))
    admin = _admin(settings)
    the_plan = t.plan(admin, specs)
    for refusal in the_plan.refusals:
        err_console.print(f"[bold red]refused:[/] {refusal}", highlight=False)
    if the_plan.refusals:
        _fail("nothing was changed; fix the specs above and run again")
    if not the_plan.changes:
        console.print(f"topics up to date: {len(specs)} topic(s) match {settings.topics.specs_dir}")
        return
    for change in the_plan.changes:
        console.print(f"  {change.action:<15} {change.topic}: {change.detail}", highlight=False)
    if dry_run:
        console.print(f"dry run: {len(the_plan.changes)} change(s) not applied")
        return
    try:
        t.apply(admin, the_plan)
    except t.TopicSpecError as exc:
        _fail(str(exc))
    console.print(f"applied {len(the_plan.changes)} change(s); {len(the_plan.unchanged)} unchanged")


@topics.command("list")
@click.pass_context
def topics_list(ctx: click.Context) -> None:
    """Show each spec next to the broker's topic, differences marked."""
    from pipeline.kafka import topics as t

    settings = _settings(ctx)
    specs = _specs(settings)
    admin = _admin(settings)
    the_plan = t.plan(admin, specs)  # the differences apply would act on, stated once
    table = Table(title=f"topics ({settings.bootstrap})")
    for col in ("topic", "partitions", "replication", "retention", "key", "schema", "status"):
        table.add_column(col)
    drifted = 0
    for spec in specs:
        state = the_plan.states.get(spec.name)
        diffs = the_plan.differences(spec.name)
        drifted += bool(diffs)
        parts, repl = str(spec.partitions), str(spec.replication)
        retention = _human_ms(spec.config.get("retention.ms", "-"))
        if state is not None:
            if state.partitions != spec.partitions:
                parts = f"[yellow]{spec.partitions} (broker {state.partitions})[/]"
            if state.replication != spec.replication:
                repl = f"[yellow]{spec.replication} (broker {state.replication})[/]"
            broker_ret = state.config.get("retention.ms")
            if "retention.ms" in spec.config and broker_ret != spec.config["retention.ms"]:
                retention = f"[yellow]{retention} (broker {_human_ms(broker_ret or '-')})[/]"
        if state is None:
            status = "[red]missing[/]"
        elif diffs:
            status = "[yellow]differs: " + "; ".join(diffs) + "[/]"
        else:
            status = "[green]ok[/]"
        table.add_row(spec.name, parts, repl, retention, spec.key, spec.value_schema, status)
    console.print(table)
    if drifted:
        console.print(f"{drifted} topic(s) differ from the specs; run `liverl topics apply`")
        sys.exit(2)


# ---- the whole stack ----------------------------------------------------------------------


@cli.command("up")
@field_option(ServeSettings, "host", "--host", help="Gateway address.")
@field_option(ServeSettings, "port", "--port", help="Gateway port.")
@field_option(TrainerSettings, "policy", "--policy", help="Policy id served, recorded and trained.")
@click.option(
    "--model",
    default=None,
    help="smollm2-135m-instruct (default, pulled on first use), 'tiny' (built in code) or a "
    "local HF model dir.",
)
@field_option(
    TrainerSettings,
    "method",
    "--method",
    help="Training method: rl, opd, hybrid, or one a [trainer] plugins module registers.",
)
@click.option(
    "--without",
    "without",
    multiple=True,
    type=click.Choice(["gateway", "workers", "judges", "trainer", "archive", "canary"]),
    help="Leave a component out (repeatable). judges: `liverl judges watch`, which keeps each "
    "judge's consistency with outcomes (a live panel and the gate read it). canary: `liverl "
    "versions canary`, which rolls out or withdraws canary versions by their live outcomes "
    "and watches the serving version for a drop.",
)
@click.option(
    "--gateways",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Gateway replicas, all listening on --port (SO_REUSEPORT; Linux). Any replica serves "
    "any turn of a session: no sticky sessions. Each loads its own copy of the model.",
)
@click.option(
    "--worker-processes",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Reward worker processes (liverl workers --processes N): one consumer group, Kafka "
    "spreads the partitions over them; one core each.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65533),
    default=None,
    help="Serve Prometheus metrics: the trainer's on this port, the canary decider's on the "
    "next, the judges' watcher's on the one after (each on its metrics_host, 127.0.0.1 by "
    "default). The gateway's are always on its own port, at /metrics.",
)
@click.pass_context
def up(
    ctx: click.Context,
    host: str,
    port: int,
    policy: str,
    model: str | None,
    method: str,
    without: tuple[str, ...],
    gateways: int,
    worker_processes: int,
    metrics_port: int | None,
) -> None:
    """Run the whole loop on this machine until Ctrl-C.

    Starts the local broker (unless LIVERL_KAFKA_BOOTSTRAP names a cluster), applies
    topics/, then runs the Faust workers, the judges' consistency watcher, the trainer, the
    canary decider, the gateway and the archive (every topic into <state_dir>/lake/events) as
    child processes (logs in <state_dir>/logs/). Point any OpenAI client at the printed base
    URL.

    A component that exits is started again (after 1 s, doubling up to 60 s); everything
    stops when one exits in its first 15 s, or a 6th time within 10 minutes.
    """
    from pipeline import stack
    from pipeline.durable import writable_problem
    from pipeline.kafka.broker import BrokerError, LocalBroker

    settings = _settings(ctx)
    # The effective values: the settings file and LIVERL_* env, then the options typed here
    # (a `[trainer] method` in liverl.toml reaches the trainer unless --method overrides it).
    trainer_cfg = merged(settings.trainer, ctx, {"policy": policy, "method": method})
    serve_cfg = merged(settings.serve, ctx, {"host": host, "port": port})
    policy, method = trainer_cfg.policy, trainer_cfg.method
    host, port = serve_cfg.host, serve_cfg.port
    try:  # an unknown method fails here, not in the trainer's log after the stack is up
        from pipeline.trainer import methods

        methods.load_plugins(settings.trainer.plugins)
        methods.get(method)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if (problem := writable_problem(Path(settings.state_dir) / "logs")) is not None:
        _fail(f"{problem}; set state_dir (LIVERL_STATE_DIR or --config)")
    # Everything that can be checked is checked before anything starts: a typo in --model or
    # a taken port used to fail only after Kafka had started, and left it running.
    if "gateway" not in without and (problem := stack.port_problem(host, port)) is not None:
        _fail(f"{problem}; pass another --port (or stop what listens there)")
    metrics_hosts = {
        "trainer": trainer_cfg.metrics_host,
        "canary": settings.canary.metrics_host,
        "judges": settings.processors.web_host,
    }
    if metrics_port is not None:
        for name, offset in stack.METRICS_LAYOUT.items():
            if name in without:
                continue
            at = (metrics_hosts[name], metrics_port + offset)
            if "gateway" not in without and at[1] == port:  # free now, the gateway's soon
                _fail(
                    f"--metrics-port {metrics_port} puts the {name}'s metrics on the "
                    f"gateway's port {port}; pass another --metrics-port"
                )
            if (problem := stack.port_problem(*at)) is not None:
                _fail(f"{problem} ({name} metrics); pass another --metrics-port")
    _pull_model(model)
    started_broker = False
    if settings.uses_local_broker:
        local = LocalBroker(settings)
        started_broker = local.pid() is None
        try:
            local.up()
        except BrokerError as exc:
            _fail(str(exc))
    else:
        console.print(f"using external Kafka at {settings.bootstrap}")
    try:
        ctx.invoke(topics_apply, dry_run=False)
    except BaseException:
        if started_broker:  # what this command started stops with it
            LocalBroker(settings).down()
        raise

    components: list[stack.Component] = []
    model_args = ["--model", model] if model else []
    if "archive" not in without:
        components.append(stack.archive_component())
    if "workers" not in without and "workers" in cli.commands:
        scale = ["--processes", str(worker_processes)] if worker_processes > 1 else []
        components.append(stack.Component("workers", ["workers", *scale]))
    if "judges" not in without and "judges" in cli.commands:
        components.append(stack.Component("judges", ["judges", "watch"]))
    if "trainer" not in without:
        components.append(
            stack.Component(
                "trainer",
                [
                    "train",
                    "--policy",
                    policy,
                    "--method",
                    method,
                    *model_args,
                ],
            )
        )
    if "canary" not in without:
        components.append(stack.canary_component(policy))
    if "gateway" not in without:
        components += stack.gateway_components(gateways, host, port, policy, model_args)
    scraped = stack.with_metrics(components, metrics_port)
    running = stack.start(settings.state_dir, components)
    logs = Path(settings.state_dir).resolve() / "logs"
    console.print(f"started {', '.join(c.name for c in components)}; logs in {logs}")
    if "gateway" not in without:
        replicas = f"; {gateways} gateway replicas" if gateways > 1 else ""
        console.print(
            f"[bold]OpenAI base URL: http://{host}:{port}/v1[/]  (model {policy!r}; "
            f"headers X-Session-Id, X-Turn-Type, X-Session-Done{replicas})"
        )
    if scraped:
        where = ", ".join(
            f"{name} http://{metrics_hosts[name]}:{p}/metrics" for name, p in scraped.items()
        )
        console.print(f"Prometheus metrics: {where}", highlight=False)
    console.print("Ctrl-C stops everything")
    restart = stack.RestartPolicy()
    window = f"{restart.window_s / 60:g} min"

    def restarting(item: stack.Running, delay: float) -> None:
        err_console.print(
            f"[bold yellow]{item.component.name} exited (code {item.proc.returncode}); "
            f"starting it again in {delay:g} s (restarts in the last {window}: "
            f"{len(item.restarts)} of {restart.max_restarts}). "
            f"Its last lines:[/]\n{stack.tail(item.log)}",
            highlight=False,
        )

    failed = stack.supervise(running, policy=restart, on_restart=restarting)
    if failed is not None:
        n = len(failed.restarts)
        why = f"{n} restarts within {window}" if n else "right after it started"
        err_console.print(
            f"[bold red]{failed.component.name} exited (code {failed.proc.returncode}, "
            f"{why}); stopping the rest. Its last lines:[/]\n{stack.tail(failed.log)}",
            highlight=False,
        )
    console.print("stopping…")
    stack.stop(running)
    if started_broker:
        LocalBroker(settings).down()
    if failed is not None:
        sys.exit(1)


def _pull_model(model: str | None) -> None:
    """Fetch and convert the model once in the foreground (with progress), so the trainer and
    the gateway start on a verified cache instead of racing to convert it."""
    from pipeline.models import store

    try:
        with console.status("checking the model…") as status:
            path = store.resolve(model, report=lambda msg: status.update(msg))
    except store.ModelStoreError as exc:
        _fail(str(exc))
    console.print(f"model: {model or store.DEFAULT_MODEL} ({path})", highlight=False)


@cli.command("status")
@click.pass_context
def status(ctx: click.Context) -> None:
    """Show the broker, consumer lag per group and each policy's state: the version that
    serves (pinned? withdrawn versions?) and what its trainer is doing."""
    from pipeline.kafka.inspect import consumer_lag
    from pipeline.versions.rule import require_promoted
    from pipeline.versions.status import policy_states

    settings = _settings(ctx)
    if settings.uses_local_broker:
        from pipeline.kafka.broker import LocalBroker

        bstat = LocalBroker(settings).status()
        if not bstat.running:
            _fail(f"local Kafka is not running ({bstat.bootstrap}); start it with `liverl up`", 3)
        console.print(f"Kafka: running, pid {bstat.pid}, {bstat.bootstrap}")
    admin = _admin(settings)
    names_on_broker = admin.list_topics(timeout=10).topics
    console.print(f"topics: {sum(1 for n in names_on_broker if n.startswith('liverl.'))} liverl")
    table = Table(title="consumer groups")
    for col in ("group", "state", "lag", "by topic"):
        table.add_column(col)
    for group in consumer_lag(settings):
        detail = ", ".join(f"{t}={n}" for t, n in sorted(group.by_topic.items()))
        table.add_row(group.group, group.state, str(group.lag), detail or "-")
    console.print(table)
    lines = policy_states(
        settings, require_promoted=require_promoted(settings), canary_cfg=settings.canary
    )
    for line in lines or ["weights: no version published yet"]:
        console.print(line, highlight=False, markup=False)


def _register_components() -> None:
    """Component commands live with their component; the CLI only lists them."""
    from pipeline.demo.commands import demo
    from pipeline.forget import forget
    from pipeline.kafka.commands import tap
    from pipeline.lake.commands import archive, sql
    from pipeline.models.commands import models
    from pipeline.processors.commands import gates, record_outcome, workers
    from pipeline.processors.judge_commands import judges
    from pipeline.processors.task_commands import tasks
    from pipeline.replay.commands import diff_rewards, drop_namespace, replay
    from pipeline.report import report
    from pipeline.serving.commands import serve
    from pipeline.trainer.commands import train
    from pipeline.versions.commands import versions

    cli.add_command(models)
    cli.add_command(demo)
    cli.add_command(serve)
    cli.add_command(workers)
    cli.add_command(record_outcome)
    cli.add_command(gates)
    cli.add_command(judges)
    cli.add_command(tasks)
    cli.add_command(train)
    cli.add_command(versions)
    cli.add_command(report)
    cli.add_command(tap)
    cli.add_command(sql)
    cli.add_command(forget)
    cli.add_command(replay)
    cli.add_command(diff_rewards)
    cli.add_command(drop_namespace)
    cli.add_command(archive)


_register_components()


def main() -> None:
    cli(prog_name="liverl")


if __name__ == "__main__":
    main()
