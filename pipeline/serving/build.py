"""Assemble backend, recorder, reloader and app from ServeSettings (used by CLI and tests)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

from fastapi import FastAPI

from pipeline.kafka.connection import Connectable

from .app import Gateway, create_app
from .backends.base import Backend
from .recorder import Recorder, spooled_values
from .reloader import Reloader
from .settings import ServeSettings
from .spool import Spool

log = logging.getLogger(__name__)


def build_backend(cfg: ServeSettings) -> Backend:
    from pipeline.models.store import resolve

    path = resolve(cfg.model_path, report=lambda msg: log.info("model store: %s", msg))
    if cfg.backend == "sglang":
        from .backends.sglang import SGLangBackend

        return SGLangBackend(
            cfg.sglang_url,
            path,
            policy_id=cfg.policy_id or path.name,
            version=cfg.weight_version,
            context_length=cfg.context_length or 32768,
            timeout_s=cfg.sglang_timeout_s,
            stream=cfg.sglang_stream,
        )
    from .backends.hf import HFBackend

    return HFBackend(
        path,
        policy_id=cfg.policy_id,
        version=cfg.weight_version,
        device=cfg.device,
        dtype=cfg.dtype,
        workers=cfg.workers,
        context_length=cfg.context_length,
    )


def recover_turns(
    cfg: ServeSettings, kafka: Connectable, recorder: Recorder, gateway: Gateway
) -> None:
    """Seed session turn counters from the log and the unsent spool; never fails start-up."""
    from .turns import TurnLedger, read_recent

    try:
        ledger = read_recent(kafka, cfg.interactions_topic, cfg.turn_recovery_s)
    except Exception as exc:  # noqa: BLE001 - Kafka down must not stop serving
        log.warning("turn recovery from Kafka skipped (%s); spooled events only", exc)
        ledger = TurnLedger()
    frames, _cursor = recorder.spool.peek(recorder.spool.pending)
    ledger.add_values(spooled_values(frames))
    recovered = ledger.open_sessions()
    gateway.sessions.seed(recovered, ledger.owners)
    if recovered:
        log.info("continuing turn numbering of %d open session(s)", len(recovered))


def build_app(cfg: ServeSettings, kafka: Connectable, backend: Backend | None = None) -> FastAPI:
    """The whole gateway; Kafka-side threads start with the app and stop with it.

    ``cfg.require_promoted`` None loads promoted versions only (the promotion gate is on by
    default); ``liverl serve`` resolves it from ``trainer.gate`` before it gets here."""
    backend = backend or build_backend(cfg)
    recorder = None
    if cfg.record:
        recorder = Recorder(
            kafka,
            Spool(cfg.spool_dir, cfg.spool_segment_bytes),
            delivery_timeout_s=cfg.delivery_timeout_s,
            client_id=f"liverl-{cfg.replica_id}",
            linger_s=cfg.record_linger_ms / 1000,
            transactional_id=recorder_transactional_id(cfg)
            if cfg.transactional_recording
            else None,
        )
    gateway = Gateway(cfg, backend, recorder)
    reloader: list[Reloader] = []

    async def startup() -> None:
        if recorder is not None:
            if cfg.turn_recovery_s > 0:
                await asyncio.to_thread(recover_turns, cfg, kafka, recorder, gateway)
            recorder.start()
        if cfg.reload:
            r = Reloader(
                kafka,
                backend,
                asyncio.get_running_loop(),
                replica_id=cfg.replica_id,
                require_promoted=cfg.require_promoted is not False,
                emit=recorder.record if recorder is not None else None,
                on_result=lambda ok: gateway.metrics.reloads.labels(str(ok).lower()).inc(),
                on_action=lambda kind: gateway.metrics.actions.labels(kind).inc(),
            )
            r.start()
            reloader.append(r)

    async def shutdown() -> None:
        for r in reloader:
            await asyncio.to_thread(r.close)
        if recorder is not None:
            await asyncio.to_thread(recorder.close)
        await backend.close()

    app = create_app(gateway, startup, shutdown)
    app.state.recorder = recorder
    app.state.reloader = reloader
    return app


def recorder_transactional_id(cfg: ServeSettings) -> str:
    """Stable per replica and spool: a restart on the same spool fences what its killed
    predecessor left open (read_committed consumers wait for no timeout), and two gateways
    that share a replica id on different spools do not fence each other."""
    where = hashlib.sha256(str(Path(cfg.spool_dir).resolve()).encode()).hexdigest()[:12]
    return f"liverl-recorder-{cfg.replica_id}-{where}"
