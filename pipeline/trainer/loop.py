"""The trainer process: Kafka samples in, gradient steps, versioned weights and Delta rows out.

Input positions come from the newest manifest (assign + seek), never from the consumer
group, which only receives informational commits. See :mod:`publish` for the protocol.
On start the newest version is verified (sha256 of every file) and, if it fails, the newest
one that verifies is resumed from instead (said on stdout): its weights, optimizer and offsets
belong together, so the inputs after it are trained again. New versions still number after
the newest folder (versions are never overwritten), with the verified one as their parent;
the lake keeps the unusable version's rows, so trajectory rows of the re-trained inputs
appear under both versions (deduplicate by ``event_id``, newest version winning).

Publishing cadence: a version is due after ``publish_every_steps`` steps (default 1) or when
pending steps are ``publish_every_s`` old, and is published as soon as the time spent
publishing stays within ``publish_max_overhead`` (default 5%) of wall time: after a publish
that took ``c`` seconds the next waits ``c·(1-f)/f``, where ``c`` leaves out the promotion
gate's evaluation of the candidate (an evaluation beside serving, not publishing). The
default thus gives the freshest weights the overhead budget allows, whatever the model size
(tiny model on CPU: a version every ~2 s; a 7B model whose save takes 20 s: every ~6.5 min)
instead of a fixed step count that is far too often for large models and needlessly rare for
small ones.

Stopping: SIGTERM/SIGINT finish the current step and publish it, then exit. Whatever Kafka
does, the process exits ``LIVERL_TRAINER_SHUTDOWN_S`` (8 s) after the first signal, or at once
on a second one: the publish protocol survives a kill at any point (a half-written folder is
never renamed to ``v<N>``, and a restart completes the rest), so steps not yet published are
only trained again after the restart.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from confluent_kafka import TopicPartition

from pipeline import events, stopping
from pipeline.events import DeadLetter, Producer, Sample
from pipeline.kafka import EventConsumer, EventProducer, Record, names
from pipeline.kafka.connection import Connectable, connection_of
from pipeline.kafka.consumer import carries
from pipeline.kafka.inspect import watermarks
from pipeline.trainer import checkpoint as ck
from pipeline.trainer.batching import Batcher, check_sample
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.core import StepResult, TrainerCore
from pipeline.trainer.dedup import SeenIds
from pipeline.trainer.follow import Decision, WeightsFollower, decide
from pipeline.trainer.gate import Gate
from pipeline.trainer.offline import DeltaSource
from pipeline.trainer.progress import Progress
from pipeline.trainer.publish import Publisher, Stage, step_row, trajectory_rows

if TYPE_CHECKING:  # pragma: no cover
    from pipeline.trainer.distributed import RankGroup

log = logging.getLogger(__name__)


@dataclass
class LoopStats:
    steps: int = 0
    published: int = 0
    samples: int = 0
    dead_lettered: int = 0
    other_policy: int = 0
    dropped_stale: int = 0
    duplicates: int = 0  # samples whose id was already trained (upstream re-sends)
    timings: dict[str, float] = field(
        default_factory=lambda: {
            "compute_s": 0.0,
            "optimizer_s": 0.0,
            "publish_s": 0.0,
            "poll_s": 0.0,
        }
    )
    verdicts: dict[int, str] = field(default_factory=dict)


class TrainerLoop:
    """One policy's trainer; :meth:`run` returns when stopped or idle (``exit_when_idle_s``)."""

    def __init__(
        self,
        kafka: Connectable,
        cfg: TrainerSettings,
        *,
        on_stage: Stage | None = None,
        echo: Callable[[str], None] = print,
        dist: RankGroup | None = None,
        require_promoted: bool | None = None,
    ) -> None:
        self.settings = connection_of(kafka)  # where the samples and events are
        self.cfg = cfg
        self.echo = echo
        # Which versions the gateways serve (pipeline/versions/rule.py; None: promoted ones
        # while the gate is on, their default): the trainer folds the log the same way.
        self.require_promoted = cfg.gate if require_promoted is None else require_promoted
        self.progress = Progress(cfg.policy, echo=echo, every_s=cfg.progress_every_s)
        self.paused = False  # pinned with while_pinned = "pause"
        self.on_stage = on_stage
        self.stats = LoopStats()
        self._stop = False
        self._newest = 0  # highest version number on disk, usable or not
        self.parents: dict[int, int | None] = {}  # version -> its parent (manifests)
        self.seen = SeenIds()
        self.dist = dist  # rank 0 of cfg.nproc ranks (set by run when nproc > 1)

    def stop(self, *_: Any) -> None:
        self._stop = True

    def _gate(self, cfg: TrainerSettings) -> Gate | None:
        """The promotion gate (None when off), reading judges' consistency live if asked,
        telling the progress how far each evaluation is."""
        if not cfg.gate:
            return None
        live = None
        if cfg.gate_consistency_live:
            from pipeline.processors.consistency_live import LiveConsistency

            live = LiveConsistency(self.settings).start(wait_s=30.0)
        return Gate(cfg, consistency=live, on_progress=self.progress.answered)

    def _visible(self) -> tuple[EventProducer, Any]:
        """Progress sent as trainer_status events, and Prometheus metrics when
        ``metrics_port`` is set; returns the status producer and the metrics server (None:
        off). The status events have their own producer: the publish protocol flushes its
        producer and fails on any lost record, and a status event that cannot be delivered
        (a broker without the topic yet) must not fail a publish."""
        cfg = self.cfg
        status = EventProducer(self.settings, client_id=f"liverl-trainer-status-{cfg.policy}")
        self.progress.emit = lambda ev: status.send(names.TRAINER_STATUS, ev, key=cfg.policy)
        if cfg.metrics_port is None:
            return status, None
        from pipeline.trainer.metrics import TrainerMetrics

        metrics = TrainerMetrics(cfg.policy)
        try:
            server = metrics.serve(cfg.metrics_host, cfg.metrics_port)
        except OSError as exc:
            raise SystemExit(
                f"trainer metrics: cannot listen on {cfg.metrics_host}:"
                f"{cfg.metrics_port} ({exc.strerror or exc}); set another "
                "trainer.metrics_port"
            ) from exc
        self.progress.metrics = metrics
        self.echo(f"metrics on http://{cfg.metrics_host}:{cfg.metrics_port}/metrics")
        return status, server

    # ---- set-up ---------------------------------------------------------------------------

    def _recover(self, publisher: Publisher) -> tuple[TrainerCore, int, dict[int, int]]:
        """Newest manifest -> finish its publishing, load its weights, return its offsets."""
        cfg = self.cfg
        removed = ck.clean_temp(cfg.weights_root, cfg.policy)
        if removed:
            self.echo(f"removed {removed} half-written version folder(s)")
        found = ck.versions(cfg.weights_root, cfg.policy)
        self._newest = found[-1] if found else 0
        for v in found:
            try:
                self.parents[v] = ck.read_manifest(cfg.weights_root, cfg.policy, v).parent
            except (OSError, ValueError):  # a corrupt manifest: its samples count by number
                continue
        manifest = ck.newest_valid(cfg.weights_root, cfg.policy, self._report_invalid)
        if manifest is None:
            if found:
                self.echo(f"no version of {cfg.policy} verifies: starting from the base model")
            core = self._load_core(None, 0)
            if publisher.gate is not None:
                publisher.gate.seed(core, 0)
            return core, 0, {}
        if manifest.input_topic != cfg.input_topic:
            raise SystemExit(
                f"newest manifest v{manifest.version} consumed {manifest.input_topic!r}, not "
                f"{cfg.input_topic!r}: its offsets do not apply; use another policy or root"
            )
        directory = ck.version_dir(cfg.weights_root, cfg.policy, manifest.version)
        core = self._load_core(directory, manifest.step)
        self.seen.seed(cfg.weights_root, cfg.policy, manifest.version)
        if publisher.gate is not None:  # held-out turns and live model as of v(N-1)
            publisher.gate.seed(core, manifest.version - 1)
        publisher.complete(directory, core)
        self.echo(f"resumed from v{manifest.version} (step {manifest.step})")
        core, version = self._after_verdict(core, manifest.version, publisher)
        return core, version, manifest.offsets()

    def _load_core(self, directory: Path | None, step: int) -> TrainerCore:
        """The policy at ``directory`` (None: the base), loaded by every rank."""
        if self.dist is not None:
            return self.dist.load_core(self.cfg, directory, step)
        return TrainerCore.load(self.cfg, directory, step=step)

    def _report_invalid(self, version: int, reason: str) -> None:
        self.echo(f"v{version} does not verify ({reason}): falling back to an older version")
        log.error("weights v%d of %s unusable: %s", version, self.cfg.policy, reason)

    def _assign(self, consumer: EventConsumer, offsets: dict[int, int]) -> dict[int, int]:
        """Assign every partition at its manifest offset (or the configured start)."""
        topic = self.cfg.input_topic
        md = consumer.raw.list_topics(topic, timeout=30)
        meta = md.topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise SystemExit(f"input topic {topic!r} not found")
        start = dict(offsets)
        for p in meta.partitions:
            if p not in start:
                low, high = watermarks(consumer.raw, TopicPartition(topic, p), 30)
                start[p] = low if self.cfg.start == "earliest" else high
        consumer.assign([TopicPartition(topic, p, o) for p, o in sorted(start.items())])
        return start

    # ---- main loop ------------------------------------------------------------------------

    def run(self) -> LoopStats:
        if self.cfg.nproc > 1 and self.dist is None:  # this process becomes rank 0
            from pipeline.trainer.distributed import spawn_ranks

            with spawn_ranks(self.cfg, self.echo) as self.dist:
                return self.run()
        if self.cfg.from_delta:
            return self._run_offline()
        cfg = self.cfg
        producer = EventProducer(self.settings, client_id=f"liverl-trainer-{cfg.policy}")
        consumer = EventConsumer(
            self.settings,
            group_id=cfg.group_id or f"liverl-trainer-{cfg.policy}",
            dlq=producer,
            component="trainer",
            expected_types={cfg.input_topic: "sample"},
        )

        def commit(offsets: dict[int, int]) -> None:
            tps = [TopicPartition(cfg.input_topic, p, o) for p, o in offsets.items()]
            try:
                consumer.raw.commit(offsets=tps, asynchronous=False)
            except Exception as exc:  # noqa: BLE001 - informational only
                log.warning("offset commit failed (restart uses the manifest): %s", exc)

        status, server = self._visible()
        gate = self._gate(cfg)
        publisher = Publisher(
            cfg, producer, commit, self.on_stage, gate=gate, progress=self.progress
        )
        follower = None
        try:
            core, version, offsets = self._recover(publisher)
            polled = self._assign(consumer, offsets)
            if cfg.follow_serving:
                follower = WeightsFollower(self.settings, cfg.policy)
            self._loop(core, version, polled, consumer, producer, publisher, follower)
        finally:
            self.progress.stopped()
            if follower is not None:
                follower.close()
            consumer.close()
            producer.flush()
            if server is not None:
                server.shutdown()
            try:
                status.flush(timeout=5.0)
            except Exception as exc:  # noqa: BLE001 - status only: say it, exit as usual
                log.warning("trainer_status events not delivered: %s", exc)
        return self.stats

    def _run_offline(self) -> LoopStats:
        """Train from the Delta selection (pipeline/trainer/offline.py), then return."""
        from pipeline.trainer import offline

        cfg = self.cfg
        newest = ck.newest_valid(cfg.weights_root, cfg.policy, lambda _v, _r: None)
        allocation = offline.Allocation(cfg.allocate, cfg.allocate_budget, cfg.allocate_seed)
        table_version = offline.pinned_version(
            newest.input_topic if newest else None,
            cfg.from_delta or "",
            cfg.where,
            allocation.spec,
        )
        selection = offline.select(
            cfg.lake_root, cfg.from_delta or "", cfg.where, version=table_version
        )
        drawn_from = selection.rows.num_rows
        # Drawn the same way again on a resume: same rows, same seed, same table version.
        selection = offline.allocate(selection, allocation, policy_id=cfg.policy)
        for line in offline.allocation_summary(selection):
            self.echo(line)
        if offline.record_allocation(cfg.lake_root, selection):
            self.echo(
                f"allocation of {selection.rows.num_rows} of {drawn_from} row(s) "
                "recorded in the lake's allocations table"
            )
        # The selection stands for the input topic in manifests (resume, refusal).
        self.cfg = cfg = cfg.model_copy(update={"input_topic": selection.input_name})
        self.echo(
            f"offline: {selection.rows.num_rows} row(s) of {cfg.from_delta} "
            f"v{selection.table_version}" + (f" where {cfg.where}" if cfg.where else "")
        )
        producer = EventProducer(self.settings, client_id=f"liverl-trainer-{cfg.policy}")
        source = offline.DeltaSource(selection, cfg.policy)
        gate = self._gate(cfg)
        publisher = Publisher(
            cfg, producer, lambda _offsets: None, self.on_stage, gate=gate, progress=self.progress
        )
        # An offline policy's versions serve like any other's: a pin pauses the run, a
        # rollback makes it train on from what serves (trainer.follow_serving).
        follower = WeightsFollower(self.settings, cfg.policy) if cfg.follow_serving else None
        try:
            core, version, offsets = self._recover(publisher)
            source.seek(offsets.get(0, 0))
            self._loop(core, version, {0: source.position}, source, producer, publisher, follower)
        finally:
            if follower is not None:
                follower.close()
            producer.flush()
        return self.stats

    def _loop(
        self,
        core: TrainerCore,
        version: int,
        polled: dict[int, int],
        consumer: EventConsumer | DeltaSource,
        producer: EventProducer,
        publisher: Publisher,
        follower: WeightsFollower | None = None,
    ) -> None:
        cfg = self.cfg
        batcher = Batcher(
            cfg.batch_max_samples,
            cfg.batch_max_tokens,
            cfg.batch_max_wait_s,
            idle_s=cfg.batch_idle_s,
        )
        limit = min(cfg.batch_max_tokens, core.max_positions)
        trainer_id = Producer(component="trainer", version=cfg.config_version)
        traj_rows: list[dict[str, Any]] = []
        step_rows: list[dict[str, Any]] = []
        last_publish = last_input = next_allowed = time.monotonic()
        f = cfg.publish_max_overhead
        self.echo(f"trainer ready: policy {cfg.policy}, v{version}, step {core.step}")
        self.progress.held(version, core.step, announce=True)
        acted = follower is not None  # decide once on the whole log, then at each new action
        while not self._stop:
            if follower is not None and (self._polled_actions(follower) or acted):
                acted = False
                decision = decide(
                    follower.log,
                    version,
                    self.parents,
                    require_promoted=self.require_promoted,
                    while_pinned=cfg.while_pinned,
                )
                if decision.kind != "keep" and step_rows:
                    # Steps trained before the action are published first: their samples
                    # are consumed once, under the lineage they were trained on.
                    version = self._publish(
                        core, version, polled, batcher, producer, publisher, traj_rows, step_rows
                    )
                    core, version = self._after_verdict(core, version, publisher)
                    traj_rows, step_rows = [], []
                    last_publish = next_allowed = time.monotonic()
                core, version = self._follow(decision, core, version, publisher)
            if self.paused:
                # Pinned: no sample is read, nothing published; not idle either.
                last_input = time.monotonic()
                time.sleep(0.2)
                continue
            # Never wait on the broker while a batch is ready to train.
            t_poll = time.perf_counter()
            # The idle trigger waits while unpublished steps or the publish budget hold the
            # next version back (Batcher.ready).
            publish_now = not step_rows and time.monotonic() >= next_allowed
            wait = 0.0 if batcher.ready(publish_now) else 0.2
            if isinstance(consumer, DeltaSource):
                consumer.behavior_version = version  # history is not stale, only off-policy
            batch = consumer.poll_batch(max_records=cfg.batch_max_samples * 4, timeout=wait)
            if batch.offsets:  # idle polls are waiting, not overhead
                self.stats.timings["poll_s"] += time.perf_counter() - t_poll
            self.stats.dead_lettered += batch.dead_lettered
            for (_topic, p), o in batch.offsets.items():
                polled[p] = o
            if batch.offsets:
                last_input = time.monotonic()
            for rec in batch.records:
                self._admit(rec, core, limit, batcher, producer, trainer_id)
            drained = isinstance(consumer, DeltaSource) and consumer.exhausted
            publish_now = not step_rows and time.monotonic() >= next_allowed
            if batcher.ready(publish_now) or (drained and batcher):
                records = batcher.take()
                # History is off-policy, never stale (offline.py): one poll holds several
                # batches stamped with the poll's version, so a later batch would look
                # versions old and be dropped.
                stale = (
                    [0] * len(records)
                    if isinstance(consumer, DeltaSource)
                    else [
                        self._staleness(r.event.behavior_weight_version, version) for r in records
                    ]
                )
                t_step = time.perf_counter()
                if self.dist is not None:
                    self.dist.send_step([r.event for r in records], version, stale)
                result = core.train_step([r.event for r in records], version, stale)
                self._account(result)
                self.progress.stepped(
                    step=result.step,
                    samples=result.samples,
                    loss=float(result.losses["total"]),
                    seconds=time.perf_counter() - t_step,
                    version=version,
                )
                now_ms = events.now_ms()
                traj_rows += trajectory_rows(records, result, core.tokenizer)
                step_rows.append(step_row(cfg, result, batcher.next_offsets(polled), now_ms))
                last_input = time.monotonic()  # idle counts from the last input or step
            # A version is due for steps that changed the weights; steps that trained
            # nothing (every sample masked or stale) wait for the next one, or for
            # publish_every_s, so they do not mint identical versions that make every
            # in-flight sample look one version staler.
            changed = any(row["trained_tokens"] > 0 for row in step_rows)
            due = (changed and len(step_rows) >= cfg.publish_every_steps) or (
                time.monotonic() - last_publish >= cfg.publish_every_s
            )
            if step_rows and due and time.monotonic() >= next_allowed:
                started = time.monotonic()
                version = self._publish(
                    core, version, polled, batcher, producer, publisher, traj_rows, step_rows
                )
                core, version = self._after_verdict(core, version, publisher)
                traj_rows, step_rows = [], []
                last_publish = time.monotonic()
                self.progress.held(version, core.step)
                next_allowed = next_publish_at(
                    last_publish, last_publish - started, publisher.last_gate_s, f
                )
            if drained and not batcher:
                self.echo("offline: every selected row consumed")
                break
            idle_s = cfg.exit_when_idle_s
            if idle_s is not None and not batcher and time.monotonic() - last_input >= idle_s:
                self.echo(f"idle for {idle_s}s: exiting")
                break
        if step_rows:  # stop or idle exit: keep the finished steps
            version = self._publish(
                core, version, polled, batcher, producer, publisher, traj_rows, step_rows
            )
        self.echo(f"stopped at v{version}, step {core.step}")

    def _polled_actions(self, follower: WeightsFollower) -> bool:
        """New operator actions on the weights log since the last poll; a read error is
        logged, never raised (following is not worth a stopped trainer)."""
        try:
            return follower.poll()
        except Exception as exc:  # noqa: BLE001
            log.warning("reading the weights log failed (retrying): %s", exc)
            return False

    def _follow(
        self, decision: Decision, core: TrainerCore, version: int, publisher: Publisher
    ) -> tuple[TrainerCore, int]:
        """Carry out what :func:`pipeline.trainer.follow.decide` said: pause while pinned,
        resume after, or train on from the version that serves: its weights and the
        optimizer state saved with it (step numbers go on, so step ids never repeat), and it
        becomes the gate's live baseline. A version whose folder is not here is not
        followed (said, and the trainer keeps its weights)."""
        cfg = self.cfg
        if decision.kind == "pause":
            if not self.paused:
                self.paused = True
                assert decision.version is not None
                self.progress.paused(decision.version, decision.line(cfg.policy))
            return core, version
        if self.paused:
            self.paused = False
            self.progress.resumed(
                f"{cfg.policy} unpinned"
                + (f": v{decision.version} serves" if decision.version is not None else "")
                + "; training resumes"
            )
        if decision.kind != "switch" or decision.version is None:
            return core, version
        target = decision.version
        if target == 0:  # every version withdrawn: the base serves, training goes on from it
            core = self._load_core(None, core.step)
            if publisher.gate is not None:
                publisher.gate.follow(core, 0)
            self.progress.switched(0, core.step, decision.line(cfg.policy))
            return core, 0
        directory = ck.version_dir(cfg.weights_root, cfg.policy, target)
        if not (directory / ck.MANIFEST).is_file():
            self.echo(
                f"v{target} serves but its folder {directory} is not here: training "
                f"goes on from v{version}"
            )
            log.error("cannot follow %s v%d: no folder at %s", cfg.policy, target, directory)
            return core, version
        core = self._load_core(directory, core.step)
        if publisher.gate is not None:
            publisher.gate.follow(core, target)
        self.progress.switched(target, core.step, decision.line(cfg.policy))
        return core, target

    def _staleness(self, behavior: int, current: int) -> int:
        """Versions of ``current``'s lineage after ``behavior``: walk the parents (a rejected
        candidate is never a parent, and never served, so it is not counted). A version
        outside the lineage counts by number."""
        at, hops = current, 0
        while at > behavior and hops <= self.cfg.max_staleness + 1:
            parent = self.parents.get(at)
            if parent is None and at not in self.parents:
                break  # unknown version: count by number
            at, hops = (parent or 0), hops + 1
        if at == behavior:
            return hops
        return max(0, current - behavior)

    def _after_verdict(
        self, core: TrainerCore, version: int, publisher: Publisher
    ) -> tuple[TrainerCore, int]:
        """After a rejection (``gate_on_reject = "rollback"``), train on from the live version:
        its weights and the optimizer state saved with it (the base and a fresh optimizer
        when nothing is promoted yet), so a rejected candidate is never the parent of the next
        version and its Adam moments are dropped. The samples it trained on stay consumed (their
        rows say so in ``trajectories``); they are not trained again. The loop then passes the
        live version as the current one, so staleness and drift count from the weights the
        trainer holds. ``continue`` keeps training the rejected candidate."""
        gate = publisher.gate
        if (
            gate is None
            or publisher.verdicts.get(version) != "rejected"
            or self.cfg.gate_on_reject != "rollback"
        ):
            return core, version
        live = gate.baseline_version
        step = core.step
        core = self._load_core(gate.live_dir(), step)
        self.echo(f"v{version} rejected: training goes on from live v{live}")
        self.progress.held(live, step)
        return core, live

    def _admit(
        self,
        rec: Record[events.Event],
        core: TrainerCore,
        limit: int,
        batcher: Batcher,
        producer: EventProducer,
        trainer_id: Producer,
    ) -> None:
        assert carries(rec, Sample)  # the consumer checks each record's type against the topic
        sample = rec.event
        if sample.policy_id != self.cfg.policy:
            self.stats.other_policy += 1
            return
        if sample.event_id in self.seen:
            self.stats.duplicates += 1
            log.info("skipped duplicate sample %s (already trained)", sample.event_id)
            return
        reason = check_sample(sample, core.vocab_size, limit)
        if reason is None:
            self.seen.add(sample.event_id)
            batcher.add(rec)
            return
        letter = DeadLetter.wrap(
            rec.value,
            topic=rec.topic,
            partition=rec.partition,
            offset=rec.offset,
            error=reason,
            producer=trainer_id,
            key=rec.key,
            headers=rec.headers,
        )
        producer.send(names.DLQ, letter, key=rec.key)
        self.stats.dead_lettered += 1
        log.warning("dead-lettered sample %s: %s", sample.event_id, reason)

    def _account(self, result: StepResult) -> None:
        self.stats.steps += 1
        self.stats.samples += result.samples
        self.stats.dropped_stale += result.dropped_stale
        for key in ("compute_s", "optimizer_s"):
            self.stats.timings[key] += result.timings.get(key, 0.0)

    def _publish(
        self,
        core: TrainerCore,
        version: int,
        polled: dict[int, int],
        batcher: Batcher,
        producer: EventProducer,
        publisher: Publisher,
        traj_rows: list[dict[str, Any]],
        step_rows: list[dict[str, Any]],
    ) -> int:
        started = time.perf_counter()
        producer.flush()  # dead letters are durable before any manifest covers their offsets
        rewards = [r["reward"] for r in traj_rows]
        manifest = publisher.publish(
            core,
            version=max(version, self._newest) + 1,
            parent=version if version > 0 else None,
            offsets=batcher.next_offsets(polled),
            trajectories=traj_rows,
            steps=step_rows,
            created_ms=events.now_ms(),
            metrics={
                "reward_mean": sum(rewards) / len(rewards),
                "samples": len(traj_rows),
                "method": self.cfg.method,
            },  # `liverl versions list` shows it
        )
        self._newest = manifest.version
        self.parents[manifest.version] = manifest.parent
        self.stats.published += 1
        self.stats.timings["publish_s"] += time.perf_counter() - started
        verdict = publisher.verdicts.get(manifest.version)
        if verdict is not None:
            self.stats.verdicts[manifest.version] = verdict
        suffix = f" ({verdict})" if verdict else ""
        self.echo(f"published v{manifest.version} at step {manifest.step}{suffix}")
        return manifest.version


def next_publish_at(now: float, spent_s: float, gate_s: float, overhead: float) -> float:
    """When the next version may be published so that publishing stays within ``overhead``
    of wall time: publishing took ``spent_s``, of which ``gate_s`` evaluated the candidate.
    The evaluation is not publishing overhead: counted, an 80 s verdict held the next version
    back 25 minutes at the default 5 %."""
    publish_s = max(0.0, spent_s - gate_s)
    return now + publish_s * (1 - overhead) / overhead


def shutdown_seconds() -> float:
    """``LIVERL_TRAINER_SHUTDOWN_S``: how long a stop may take before the process exits
    (default :data:`pipeline.stopping.STOP_S`: ``liverl up`` expects each component gone
    within 10 s of its SIGTERM)."""
    raw = os.environ.get("LIVERL_TRAINER_SHUTDOWN_S", f"{stopping.STOP_S:g}")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"LIVERL_TRAINER_SHUTDOWN_S must be a number of seconds > 0, not {raw!r}")
    return value


def install_signal_handlers(loop: TrainerLoop, shutdown_s: float | None = None) -> None:
    """SIGTERM/SIGINT finish the current step and publish it, then exit; a watchdog
    (:mod:`pipeline.stopping`) bounds that to ``shutdown_s`` (default
    :func:`shutdown_seconds`), or ends it at a second signal: a publish that waits on a
    broker that is gone would otherwise hold the process for the client's timeouts."""
    bound = shutdown_seconds() if shutdown_s is None else shutdown_s
    signal.signal(signal.SIGTERM, loop.stop)
    signal.signal(signal.SIGINT, loop.stop)
    stopping.arm(
        bound,
        "liverl train: not stopped after {why}, Kafka unreachable? Exiting now; steps not "
        "published yet are trained again after a restart",
        setting="LIVERL_TRAINER_SHUTDOWN_S",
    )
