"""The Faust app of the reward pipeline: wiring only. What each agent does is in its module.

Agents over co-partitioned topics keyed by session id, with tables changelogged (a worker that
takes over a partition recovers its sessions), and one keyed by group id:

- ``session``  (`session_agent.py`) interactions + next_states + hints -> next_states +
               path_penalties + prm_scores + hints + rewards + samples: pairing, path
               penalties, judging and assembly of a session, over the pure stages of
               `session.py` (`pairing.py`, `penalties.py`, `judging.py`, `rewards.py`).
- ``judge``    (`judge_agent.py`) only for a judge that is not inline (the LLM PRM):
               interactions + next_states -> prm_scores + hints, which the session agent reads.
- ``group``    (`group_agent.py`) <app id>-groups -> samples, z-scored within (group, step
               index) across sessions (`grouping.py`).

`runtime.py` holds what they share (sends, dead letters, guarded timers), `records.py` the
table keys and kept records, `internal_topics.py` the changelogs' creation and compaction.

Bad records go to the DLQ (never crash an agent): invalid or over ``kafka.max_event_bytes``,
and keyless ones (a session-keyed topic needs the session id as key). Dead letters are cut to
the codec limit (size, sha256 and coordinates kept); aiokafka's request and fetch sizes follow
the size policy in ``KafkaSettings``, so no record the broker accepted can stop a worker.

Every piece of pending state lives in a changelogged table (a next state parked until its
interaction arrives too), so SIGKILL loses nothing; timers wait until table recovery has
finished, and a timer's error is logged, never fatal. Verdict ids are deterministic, so the
duplicates a restart may produce (at-least-once) are removed by id downstream.

Run more workers with the same app id to scale out: Kafka's consumer group spreads the
partitions.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import faust
from faust.types import AgentT, TopicT

from pipeline.kafka import names
from pipeline.kafka import topics as kafka_topics
from pipeline.kafka.connection import Connectable, connection_of

from . import ledger_consumer
from .config import ProcessorSettings
from .consistency_live import LiveConsistency
from .errors import RetentionError
from .group_agent import GroupAgent
from .judge_agent import JudgeAgent
from .judges import Judge, make_judge
from .pairing import Pairer
from .penalties import load_rules
from .rewards import Assembler
from .runtime import Runtime
from .session import SessionStage
from .session_agent import SessionAgent
from .transactions import SCHEME, Transaction, commit_on_revoke, transactional_id

log = logging.getLogger(__name__)

# The topics the agents read; what each carries comes from topics/ (kafka.topics.event_types).
INPUTS = (
    names.INTERACTIONS,
    names.NEXT_STATES,
    names.PRM_SCORES,
    names.PATH_PENALTIES,
    names.HINTS,
)


LIVE_CATCH_UP_S = 30.0  # a live panel's worker waits this long for the consistency history


def build_judge(cfg: ProcessorSettings) -> Judge:
    return make_judge(cfg.judge, cfg.effective_judge_options())


class ProcessorsApp(faust.App):
    """The Faust app, with handles on what it declared (tests drive the agents and timers;
    :func:`~.internal_topics.ensure_internal_topics` creates the internal topics)."""

    liverl_agents: tuple[AgentT, ...]
    liverl_transaction: Transaction | None = None
    liverl_redeliver_after_s: float = ledger_consumer.REDELIVER_AFTER_S
    liverl_consistency: LiveConsistency | None = None  # a live panel's reader
    liverl_timers: dict[str, Callable[[], Awaitable[None]]]
    liverl_topics: dict[str, TopicT]
    liverl_closers: tuple[Callable[[], None], ...] = ()  # run once the app has stopped

    async def on_stop(self) -> None:
        await super().on_stop()
        for close in self.liverl_closers:
            close()


def check_retention(specs: list[kafka_topics.TopicSpec], retain_s: float) -> None:
    """The worker keeps a turn's coordinates, not its tokens (`token_store.py`): refuse a
    session state that may outlive the interactions it points at."""
    spec = next((s for s in specs if s.name == names.INTERACTIONS), None)
    kept_ms = int(spec.config.get("retention.ms", "-1")) if spec is not None else -1
    if 0 <= kept_ms <= retain_s * 1000:
        raise RetentionError(
            f"topic {names.INTERACTIONS} keeps records for {kept_ms / 3_600_000:g} h "
            f"(retention.ms in its spec), processors.retain_s is {retain_s / 3600:g} h: a "
            "session's state would outlive the interactions its tokens are read back from; "
            "lower retain_s or raise the topic's retention.ms"
        )


def create_app(kafka: Connectable, cfg: ProcessorSettings, state_dir: Path) -> ProcessorsApp:
    """Build the Faust app with its topics, tables, agents and timers; its local data lives
    under ``state_dir/processors/<app id>``."""
    conn = connection_of(kafka)
    ns = conn.namespace  # a replay namespace: its topics, app id (= group) and tables
    if ns:
        cfg = cfg.model_copy(update={"app_id": names.resolve(cfg.app_id, ns)})
    # Stated once, in topics/: the partitions the tables must share with the session topics
    # and the event type of each input. A broken spec stops the worker here, loudly.
    specs = kafka_topics.load_specs(conn.specs_dir, max_record_bytes=conn.max_record_bytes)
    types = kafka_topics.event_types(specs)
    partitions = cfg.partitions or kafka_topics.session_partitions(specs)
    check_retention(specs, cfg.retain_s)
    datadir = Path(state_dir) / "processors" / cfg.app_id
    datadir.parent.mkdir(parents=True, exist_ok=True)
    app = ProcessorsApp(
        cfg.app_id,
        # Both transports commit the offsets of the consumer's ledger (offset_ledger.py).
        broker=f"{SCHEME if cfg.exactly_once else ledger_consumer.SCHEME}://{conn.bootstrap}",
        broker_commit_interval=cfg.commit_interval_s,
        value_serializer="raw",
        key_serializer="raw",
        topic_partitions=partitions,
        topic_replication_factor=conn.replication_factor or 1,
        store="memory://",
        # No standby copies: the memory store restores a newly active partition from its
        # changelog's start anyway (it keeps no offset), and a standby's records went into
        # the same in-memory table the timers walk, so a worker swept sessions it did not
        # own; every worker also read every other worker's changelogs all the time.
        table_standby_replicas=0,
        datadir=str(datadir),
        **cfg.faust_web(),  # loopback only, and a port of its own (config.py)
        consumer_auto_offset_reset=cfg.auto_offset_reset,
        producer_acks=-1,
        # The size policy (KafkaSettings): aiokafka's defaults (1 MB requests and fetches)
        # crash-looped the worker on any record over 1 MB the broker had accepted.
        producer_max_request_size=conn.max_record_bytes,
        consumer_max_fetch_size=conn.max_fetch_bytes,
        # aiokafka's 16 KB batches held one token payload or sample each, so every record
        # was its own produce request; 1 MiB batches and a linger share them.
        producer_max_batch_size=1 << 20,
        producer_linger=cfg.produce_linger_ms / 1000,
        # A restarted worker waits this long for its killed predecessor to leave the group.
        broker_session_timeout=cfg.session_timeout_s,
        broker_heartbeat_interval=min(3.0, cfg.session_timeout_s / 4),
    )
    app.liverl_redeliver_after_s = cfg.redeliver_after_s
    if cfg.exactly_once:
        app.liverl_transaction = Transaction(
            transactional_id(cfg.app_id, cfg.worker_index),
            cfg.app_id,
            cfg.transaction_timeout_s,
            idle_commit_s=cfg.commit_idle_s,
        )
        commit_on_revoke(app)
    # aiokafka and Faust's topics log every produce request at debug; building those records
    # was ~7% and ~5% of a busy worker even when the handler drops them.
    for noisy in ("aiokafka", "faust.topics"):
        logging.getLogger(noisy).setLevel(max(logging.INFO, logging.getLogger().level))
    rt = Runtime(app, conn, cfg, partitions=partitions,
                 expected={t: types[t] for t in INPUTS},
                 outputs=(*INPUTS, names.REWARDS, names.SAMPLES, names.DLQ))  # fmt: skip

    # One session's state is one changelog value: bounded below the record limit (config.py).
    # Pairing and judging share that value: 2/5 of the bound each, the rest is the assembly's
    # (ids, votes and hints of the session's turns).
    part_bytes = min(cfg.state_max_bytes, conn.max_event_bytes) * 2 // 5
    judge = build_judge(cfg)
    if getattr(judge, "live", False):  # a panel weighted by the consistency topic as it moves
        app.liverl_consistency = LiveConsistency(conn, ns).start(wait_s=LIVE_CATCH_UP_S)
        judge.use_live(app.liverl_consistency)  # type: ignore[attr-defined]
    inline = bool(getattr(judge, "inline", True))
    pairer = Pairer(
        load_rules(cfg.rules_path),
        cfg.pairing_version,
        text_chars=cfg.state_text_chars,
        max_bytes=part_bytes,
    )
    assembler = Assembler(
        cfg.reward_version,
        cfg.sample_version,
        grace_ms=int(cfg.grace_s * 1000),
        outcome_wait_ms=int(cfg.outcome_wait_s * 1000),
        hint_wait_ms=int(cfg.hint_wait(inline) * 1000),
        voters_per_turn=cfg.feedback_voters_per_turn,
        posted_per_turn=cfg.posted_per_turn,
    )
    stage = SessionStage(
        pairer,
        assembler,
        judge_inline=inline,
        text_chars=cfg.state_text_chars,
        judge_max_bytes=part_bytes,
    )
    group_topic = app.topic(
        f"{cfg.app_id}-groups",
        internal=True,
        partitions=partitions,
        value_type=bytes,
        value_serializer="raw",
        key_type=bytes,
    )

    sessions = SessionAgent(rt, stage, assembler, judge, group_topic)
    if sessions.reader is not None:
        app.liverl_closers = (sessions.reader.close,)
    agents = [app.agent(rt.topic(*sessions.inputs), name="session")(sessions.process)]
    rt.every(cfg.sweep_interval_s, sessions.session_sweep)
    expire_every = max(cfg.sweep_interval_s, min(60.0, cfg.retain_s / 4))
    rt.every(expire_every, sessions.expire_state)
    if not inline:
        judging = JudgeAgent(rt, judge, state_max_bytes=part_bytes)
        topic = rt.topic(names.INTERACTIONS, names.NEXT_STATES)
        agents.append(app.agent(topic, name="judge")(judging.process))
        rt.every(cfg.sweep_interval_s, judging.judge_grace)
        rt.every(expire_every, judging.expire_judge_state)
    groups = GroupAgent(rt, group_topic)
    agents.append(app.agent(group_topic, name="group")(groups.process))
    rt.every(cfg.sweep_interval_s, groups.group_sweep)

    app.liverl_agents = tuple(agents)
    app.liverl_timers = rt.timers
    app.liverl_topics = {**rt.out, "groups": group_topic}
    return app
