"""The publish protocol (docs/architecture.md#exactly-once-publishing), and its recovery.

1. weights + manifest -> ``vN`` (atomic folder, :mod:`checkpoint`); the folder also holds
   the lake rows of this version, so everything after step 1 can be redone from disk;
2. Delta appends (``trajectories``, ``gradient_steps``, ``weights``), each with the
   application transaction ``(app_id, N)``: a retried commit is skipped;
3. ``GradientStep`` and ``WeightsPublished`` (``candidate``) events with deterministic ids,
   then a marker;
3g. with the promotion gate on (:mod:`gate`): the verdict is computed once and stored in
   ``vN/trainer/verdict.json``, appended to ``weights`` (application transaction
   ``(app_id/gate, N)``) and sent as a second ``WeightsPublished`` for N (``promoted`` or
   ``rejected``, the figures in ``metrics``, its own deterministic id), then a marker; the
   verdict's votes go first: ``gate_votes`` rows (application transaction
   ``(app_id/gate-votes, N)``) and one ``GateVote`` event each, sent before the verdict
   event so a reader of the verdict can find every vote behind it;
4. informational consumer-group offset commit (restart reads the manifest, not the group).

Gradient-step events are sent here, not after each optimizer step: their ids derive from
(policy, step) and their content from the published rows, so only once a step is durable in
a version folder can a retry re-send exactly the same event; a step trained and then lost
in a crash before its version existed is trained again from the same offsets and must not
have been announced.

:meth:`Publisher.complete` runs steps 2-4 and is idempotent, so a restart simply calls it
on the newest version. A crash before the rename loses only in-memory steps, whose input
offsets the newest manifest does not cover: they are read and trained again.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import __version__
from pipeline.durable import fsync_path
from pipeline.events import (
    GateVote,
    GradientStep,
    Producer,
    Sample,
    WeightsPublished,
    derive_event_id,
    now_ms,
)
from pipeline.events.types import WeightsStatus
from pipeline.kafka import EventProducer, Record, names
from pipeline.lake import tables as T
from pipeline.lake.writer import Appender
from pipeline.trainer import checkpoint as ck
from pipeline.trainer import gate as G
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.core import OPTIMIZER_FILE, StepResult, TrainerCore

Stage = Callable[[str], None]


class Judging(Protocol):
    """Told when the gate starts judging a version and what it said (None: no verdict, and
    why): the trainer's log line, status event and metrics (:mod:`pipeline.trainer.progress`)."""

    def judging(self, version: int) -> None: ...

    def judged(self, version: int, verdict: dict[str, Any] | None, why: str | None) -> None: ...


TRAJ_FILE = "trajectories.parquet"
STEPS_FILE = "gradient_steps.parquet"


def _json(obj: Any) -> str:
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS).decode()


def trajectory_rows(
    records: Sequence[Record[Sample]], result: StepResult, tokenizer: Any
) -> list[dict[str, Any]]:
    """One row per consumed sample; ``weight_version`` is filled in at publish time."""
    rows = []
    for rec, outcome in zip(records, result.outcomes, strict=True):
        s = rec.event
        rows.append(
            {
                "event_id": s.event_id,
                "session_id": s.session_id,
                "turn": s.turn,
                "policy_id": s.policy_id,
                "prompt_token_ids": s.prompt_token_ids,
                "response_token_ids": s.response_token_ids,
                "response_text": tokenizer.decode(s.response_token_ids),
                "loss_mask": s.loss_mask,
                "opd_mask": s.opd_token_mask(),
                "behavior_logprobs": s.behavior_logprobs,
                "reward": s.reward,
                "hints": s.hints,
                "selected_hint": outcome.selected_hint,
                "behavior_weight_version": s.behavior_weight_version,
                "staleness": outcome.staleness,
                "status": outcome.status,
                "step": result.step,
                "weight_version": None,
                "source_topic": rec.topic,
                "source_partition": rec.partition,
                "source_offset": rec.offset,
                "ts_ms": s.ts_ms,
                "day": dt.datetime.fromtimestamp(s.ts_ms / 1000, dt.UTC).strftime("%Y-%m-%d"),
            }
        )
    return rows


def write_folder_rows(trainer_dir: Path, trajectories: pa.Table, steps: pa.Table) -> None:
    """The lake rows a version folder keeps (``vN/trainer/``), so that a restart can finish
    publishing them (:meth:`Publisher.complete` reads them back; forget rewrites them)."""
    pq.write_table(trajectories, trainer_dir / TRAJ_FILE)
    pq.write_table(steps, trainer_dir / STEPS_FILE)


def step_row(
    cfg: TrainerSettings, result: StepResult, offsets: dict[int, int], ts_ms: int
) -> dict[str, Any]:
    return {
        "policy_id": cfg.policy,
        "step": result.step,
        "weight_version": result.weight_version,
        "published_version": None,
        "method": cfg.method,
        "loss": result.losses["total"],
        # every part by name (a map column): a new method needs no new column
        "losses": sorted((k, v) for k, v in result.losses.items() if k != "total"),
        "kl": result.kl,
        "clip_fraction": result.clip_fraction,
        "grad_norm": result.grad_norm,
        "samples": result.samples,
        "tokens": result.tokens,
        "trained_tokens": result.trained_tokens,
        "dropped_stale": result.dropped_stale,
        "reward_mean": result.reward_mean,
        "logprob_drift_mean": result.metrics.get("logprob_drift_mean"),
        "logprob_drift_max": result.metrics.get("logprob_drift_max"),
        "consumed_offsets": _json({str(p): o for p, o in sorted(offsets.items())}),
        "metrics": _json(result.metrics),
        "ts_ms": ts_ms,
    }


class Publisher:
    """Runs the publish protocol for one policy; ``on_stage`` is a fault-injection hook."""

    def __init__(
        self,
        cfg: TrainerSettings,
        producer: EventProducer | None = None,
        commit_offsets: Callable[[dict[int, int]], None] | None = None,
        on_stage: Stage | None = None,
        gate: G.Gate | None = None,
        progress: Judging | None = None,
    ) -> None:
        self.cfg = cfg
        self.progress = progress
        self.lake = T.LakeTables(cfg.lake_root)
        self.tables = {
            name: Appender(self.lake.uri(name), T.PARTITION_BY[name])
            for name in (T.TRAJECTORIES, T.GRADIENT_STEPS, T.WEIGHTS, T.GATE_VOTES)
        }
        self.gate = gate
        self.verdicts: dict[int, str] = {}  # version -> promoted | rejected (this process)
        # Seconds the last publish spent evaluating the candidate (the gate's rollouts): an
        # evaluation beside serving, not publishing overhead (TrainerLoop's budget).
        self.last_gate_s = 0.0
        self.producer = producer
        self.commit_offsets = commit_offsets
        self.on_stage = on_stage or (lambda _stage: None)
        self.producer_id = Producer(component="trainer", version=__version__)

    def publish(
        self,
        core: TrainerCore,
        *,
        version: int,
        parent: int | None,
        offsets: dict[int, int],
        trajectories: list[dict[str, Any]],
        steps: list[dict[str, Any]],
        created_ms: int,
        metrics: dict[str, Any] | None = None,
    ) -> ck.Manifest:
        """Steps 1-4 for version ``version`` trained up to ``core.step``."""
        self.last_gate_s = 0.0
        for row in trajectories:
            row["weight_version"] = version
        for row in steps:
            row["published_version"] = version
        manifest = ck.Manifest(
            policy_id=self.cfg.policy,
            version=version,
            parent=parent,
            step=core.step,
            created_ms=created_ms,
            input_topic=self.cfg.input_topic,
            consumed_offsets={str(p): o for p, o in sorted(offsets.items())},
            files=[],
            method=self.cfg.method,
            metrics=metrics or {},
            base_model=core.base_model_info(),
        )

        traj = T.to_table(T.TRAJECTORIES, trajectories)
        step_table = T.to_table(T.GRADIENT_STEPS, steps)

        def write(tmp: Path) -> None:
            core.save_weights(tmp)
            if self.cfg.save_optimizer:
                core.save_optimizer(tmp / ck.TRAINER_DIR / OPTIMIZER_FILE)
            write_folder_rows(tmp / ck.TRAINER_DIR, traj, step_table)

        directory = ck.write_version(self.cfg.weights_root, manifest, write, self.on_stage)
        self.on_stage("after_folder")
        return self.complete(directory, core, rows=(traj, step_table))

    def complete(
        self,
        directory: Path,
        core: TrainerCore | None = None,
        *,
        rows: tuple[Any, Any] | None = None,
    ) -> ck.Manifest:
        """Steps 2-4 for an already written version folder; safe to repeat. ``core`` holds
        this version's weights (needed by the gate); ``rows`` are the folder's lake rows
        when the caller still has them (else they are read back from the folder)."""
        manifest = ck.Manifest.from_json((directory / ck.MANIFEST).read_bytes())
        trainer = directory / ck.TRAINER_DIR
        if rows is None:
            rows = (
                pq.read_table(trainer / TRAJ_FILE, schema=T.TRAJECTORIES_SCHEMA),
                pq.read_table(trainer / STEPS_FILE, schema=T.GRADIENT_STEPS_SCHEMA),
            )
        traj, steps = rows
        weights = T.to_table(T.WEIGHTS, [self._weights_row(manifest, directory)])
        parts = ((T.TRAJECTORIES, traj), (T.GRADIENT_STEPS, steps), (T.WEIGHTS, weights))
        for name, table in parts:
            self.tables[name].append_once(table, app_id=self.cfg.app_id, version=manifest.version)
            self.on_stage(f"after_delta_{name}")
        if self.producer is not None and not ck.events_done(directory):
            step_events = [self._step_event(row) for row in steps.to_pylist()]
            for event in step_events:
                self.producer.send(names.GRADIENT_STEPS, event, key=self.cfg.policy)
            self.producer.send(
                names.WEIGHTS,
                self._weights_event(manifest, directory, [e.event_id for e in step_events]),
                key=self.cfg.policy,
            )
            self.producer.flush()
            ck.mark_events_done(directory)
        self.on_stage("after_events")
        if self.gate is not None and core is not None:
            self._verdict(directory, manifest, core, traj)
        if self.commit_offsets is not None:
            self.commit_offsets(manifest.offsets())
        self.on_stage("after_offsets")
        return manifest

    def _verdict(
        self, directory: Path, manifest: ck.Manifest, core: TrainerCore, traj: Any
    ) -> None:
        """Step 3g: evaluate once (or reuse the stored verdict), append it, send it."""
        gate = self.gate
        assert gate is not None
        if gate.seeded_upto is None or gate.seeded_upto < manifest.version:
            if gate.seeded_upto is None:  # a publisher used without recovery (tests)
                gate.seed(core, manifest.version - 1)
            gate.add(traj.select([*G._COLUMNS, "status"]).to_pylist())
            gate.seeded_upto = manifest.version
        verdict = G.read_verdict(directory)
        if verdict is None:
            if self.progress is not None:
                self.progress.judging(manifest.version)
            t0 = time.perf_counter()
            result = gate.evaluate(core, manifest.version)
            self.last_gate_s = time.perf_counter() - t0
            if result is None:  # too few held-out turns: the version stays a candidate
                if self.progress is not None:
                    self.progress.judged(manifest.version, None, gate.skipped)
                return
            verdict = {**result, "version": manifest.version, "ts_ms": now_ms()}
            G.write_verdict(directory, verdict)
            if self.progress is not None:
                self.progress.judged(manifest.version, verdict, None)
        self.on_stage("after_verdict_file")
        candidate = self._weights_event(manifest, directory, []).event_id
        votes = [
            (self._vote_event(manifest, candidate, v, verdict), v) for v in verdict.get("votes", [])
        ]
        if votes:
            rows = [
                T.gate_vote_row(
                    e, v.get("candidate_answer", ""), v.get("live_answer", ""), v.get("session_id")
                )
                for e, v in votes
            ]
            self.tables[T.GATE_VOTES].append_once(
                T.to_table(T.GATE_VOTES, rows),
                app_id=f"{self.cfg.app_id}/gate-votes",
                version=manifest.version,
            )
        self.on_stage("after_delta_votes")
        if verdict["status"] == "promoted" and gate.baseline_version < manifest.version:
            gate.promote(core, manifest.version)
        self.verdicts[manifest.version] = verdict["status"]
        row = self._weights_row(
            manifest, directory, verdict["status"], verdict["metrics"], verdict["ts_ms"]
        )
        self.tables[T.WEIGHTS].append_once(
            T.to_table(T.WEIGHTS, [row]),
            app_id=f"{self.cfg.app_id}/gate",
            version=manifest.version,
        )
        self.on_stage("after_delta_verdict")
        done = directory / ck.TRAINER_DIR / G.VERDICT_DONE
        if self.producer is not None and not done.exists():
            for vote_event, _ in votes:
                self.producer.send(names.GATE_VOTES, vote_event, key=self.cfg.policy)
            event = self._weights_event(
                manifest,
                directory,
                [candidate],
                status=verdict["status"],
                metrics=verdict["metrics"],
                ts_ms=verdict["ts_ms"],
            )
            self.producer.send(names.WEIGHTS, event, key=self.cfg.policy)
            self.producer.flush()
            done.write_bytes(b"")
            fsync_path(done.parent)
        self.on_stage("after_verdict_event")

    def _vote_event(
        self, m: ck.Manifest, candidate: str, vote: dict[str, Any], verdict: dict[str, Any]
    ) -> GateVote:
        """One vote of the verdict as an event; its id derives from the candidate's
        announcement, the prompt (and its source) and the judge, so a re-sent verdict re-sends
        the same ids."""
        live = int(verdict.get("metrics", {}).get("gate_live_version", 0))
        return GateVote(
            event_id=derive_event_id(
                "gate_vote",
                [candidate],
                self.cfg.config_version,
                m.policy_id,
                m.version,
                vote["source"],
                vote["prompt_id"],
                vote["judge"],
            ),
            ts_ms=int(verdict["ts_ms"]),
            producer=self.producer_id,
            parents=[candidate],
            policy_id=m.policy_id,
            version=m.version,
            live_version=live,
            prompt_id=vote["prompt_id"],
            source=vote["source"],
            judge=vote["judge"],
            vote=int(vote["vote"]),
            candidate_score=vote.get("candidate_score"),
            live_score=vote.get("live_score"),
            detail={"abstained": bool(vote.get("abstained", False)), **vote.get("detail", {})},
        )  # the answers (about a user's prompt) stay in the lake, where forget reaches them

    def _weights_row(
        self,
        m: ck.Manifest,
        directory: Path,
        status: str = "candidate",
        metrics: dict[str, Any] | None = None,
        ts_ms: int | None = None,
    ) -> dict[str, Any]:
        return {
            "policy_id": m.policy_id,
            "version": m.version,
            "parent": m.parent,
            "step": m.step,
            "uri": directory.resolve().as_uri() + "/",
            "status": status,
            "files": _json(m.files),
            "consumed_offsets": _json(m.consumed_offsets),
            "input_topic": m.input_topic,
            "method": m.method,
            "metrics": _json(m.metrics if metrics is None else metrics),
            "ts_ms": m.created_ms if ts_ms is None else ts_ms,
        }

    def _step_event(self, row: dict[str, Any]) -> GradientStep:
        losses = {"total": row["loss"], **dict(row["losses"])}
        return GradientStep(
            event_id=derive_event_id(
                "gradient_step", [], self.cfg.config_version, self.cfg.policy, row["step"]
            ),
            ts_ms=row["ts_ms"],
            producer=self.producer_id,
            policy_id=self.cfg.policy,
            step=row["step"],
            losses=losses,
            kl=row["kl"],
            clip_fraction=row["clip_fraction"],
            grad_norm=row["grad_norm"],
            consumed_offsets=orjson.loads(row["consumed_offsets"]),
            samples=row["samples"],
            tokens=row["tokens"],
            weight_version=row["weight_version"],
        )

    def _weights_event(
        self,
        m: ck.Manifest,
        directory: Path,
        parents: list[str],
        *,
        status: WeightsStatus = "candidate",
        metrics: dict[str, Any] | None = None,
        ts_ms: int | None = None,
    ) -> WeightsPublished:
        """The candidate announcement, or (``status`` promoted/rejected) the gate's verdict on
        the same version, whose id derives from the candidate's. The event that makes the
        version servable (the promoted verdict, or the candidate when the gate is off) carries
        ``canary_share``: the gateways serve it to that share of users first."""
        if status == "candidate":
            event_id = derive_event_id(
                "weights", [], self.cfg.config_version, m.policy_id, m.version
            )
        else:
            event_id = derive_event_id(
                "weights_verdict", parents, self.cfg.config_version, m.policy_id, m.version
            )
        return WeightsPublished(
            event_id=event_id,
            ts_ms=m.created_ms if ts_ms is None else ts_ms,
            producer=self.producer_id,
            parents=parents,
            policy_id=m.policy_id,
            version=m.version,
            parent=m.parent,
            uri=directory.resolve().as_uri() + "/",
            files=[
                {"path": f["path"], "sha256": f["sha256"], "bytes": f["bytes"]} for f in m.files
            ],
            step=m.step,
            status=status,
            consumed_offsets=m.consumed_offsets,
            metrics=m.metrics if metrics is None else metrics,
            canary_share=self._canary_share(status),
        )

    def _canary_share(self, status: WeightsStatus) -> float | None:
        servable = "promoted" if self.gate is not None else "candidate"
        share = self.cfg.canary_share
        return share if status == servable and share > 0 else None
