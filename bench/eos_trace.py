"""A debug trace for soak workers (``bench/eos_soak.py --trace DIR``): executed in a worker
before it starts, it wraps Faust's recovery, the memory store, the sessions table's changelog
writes, the session agent and the transaction's commit, and writes one JSON line per event to
``DIR/trace-<pid>.jsonl``. ``bench/eos_trace_report.py``-style reading: every line has ``t``
(wall time), ``pid`` and ``ev``. The bench's instrument, never the product's."""

# ruff: noqa
import json
import os
import time

from faust.stores import memory as _memory
from faust.tables import base as _tbase
from faust.tables import recovery as _recovery

from pipeline.processors import session as _session
from pipeline.processors import session_agent as _agent
from pipeline.processors import transactions as _txn
from pipeline.processors.records import key_partition as _key_partition

_DIR = os.environ["LIVERL_SOAK_TRACE"]
_FH = open(os.path.join(_DIR, f"trace-{os.getpid()}.jsonl"), "a", buffering=1)
_APP = None


def _log(ev, **kw):
    try:
        kw.update(t=round(time.time(), 4), pid=os.getpid(), ev=ev)
        _FH.write(json.dumps(kw, default=str) + "\n")
    except Exception as exc:
        _FH.write(json.dumps({"ev": "trace_error", "error": repr(exc)}) + "\n")


def _short(topic):
    if topic.endswith("-changelog"):
        return topic.split("-")[-2]
    parts = topic.split(".")
    return parts[-2] if len(parts) > 1 else topic


def _tps(tps):
    return sorted(
        f"{_short(tp.topic)}:{tp.partition}"
        for tp in tps
        if _short(tp.topic) in ("sessions", "interactions")
    )


def _owned():
    try:
        return sorted(
            {
                tp.partition
                for tp in _APP.consumer.assignment()
                if tp.topic.endswith("interactions.v1")
            }
        )
    except Exception:
        return None


def _summary(raw):
    if raw is None:
        return None
    try:
        st = _session.load(raw)
        return {
            "turns": sorted(st.assembly.turns),
            "closed": st.pairing.closed,
            "done": st.assembly.done,
        }
    except Exception as exc:
        return repr(exc)


_on_rebalance = _recovery.Recovery.on_rebalance


async def on_rebalance(self, assigned, revoked, newly_assigned, generation_id=0):
    global _APP
    _APP = self.app
    try:
        _log(
            "rebalance",
            gen=generation_id,
            app_gen=self.app.consumer_generation_id,
            assigned=_tps(assigned),
            revoked=_tps(revoked),
            new=_tps(newly_assigned),
            offsets_before={
                str(k.partition): v
                for k, v in self.active_offsets.items()
                if k.topic.endswith("sessions-changelog")
            },
        )
    except Exception as exc:
        _log("trace_error", error=repr(exc))
    await _on_rebalance(self, assigned, revoked, newly_assigned, generation_id)
    try:
        _log(
            "rebalance_set",
            offsets={
                str(k.partition): v
                for k, v in self.active_offsets.items()
                if k.topic.endswith("sessions-changelog")
            },
        )
    except Exception as exc:
        _log("trace_error", error=repr(exc))


_recovery.Recovery.on_rebalance = on_rebalance

_build_offsets = _recovery.Recovery._build_offsets


async def build_offsets(self, consumer, tps, destination, title):
    await _build_offsets(self, consumer, tps, destination, title)
    try:
        _log(
            "build_offsets",
            title=title,
            offsets={
                str(k.partition): v
                for k, v in destination.items()
                if k.topic.endswith("sessions-changelog")
            },
            highwaters={
                str(k.partition): v
                for k, v in self.active_highwaters.items()
                if k.topic.endswith("sessions-changelog")
            },
        )
    except Exception as exc:
        _log("trace_error", error=repr(exc))


_recovery.Recovery._build_offsets = build_offsets

_rec_done = _recovery.Recovery.on_recovery_completed


async def rec_done(self, generation_id=0):
    try:
        _log(
            "recovery_completed",
            gen=generation_id,
            offsets={
                str(k.partition): v
                for k, v in self.active_offsets.items()
                if k.topic.endswith("sessions-changelog")
            },
            owned=_owned(),
        )
    except Exception as exc:
        _log("trace_error", error=repr(exc))
    await _rec_done(self, generation_id)


_recovery.Recovery.on_recovery_completed = rec_done

_apply = _memory.Store.apply_changelog_batch


def apply_changelog_batch(self, batch, to_key, to_value):
    batch = list(batch)
    if str(getattr(self, "table_name", "")).endswith("sessions"):
        try:
            _log(
                "changelog_apply",
                recs=[
                    (
                        e.message.partition,
                        e.message.offset,
                        e.message.key.decode(errors="replace"),
                        _summary(e.message.value),
                    )
                    for e in batch
                ],
            )
        except Exception as exc:
            _log("trace_error", error=repr(exc))
    return _apply(self, batch, to_key, to_value)


_memory.Store.apply_changelog_batch = apply_changelog_batch

_purge = _memory.Store.on_recovery_completed


async def purge(self, active_tps, standby_tps):
    if str(getattr(self, "table_name", "")).endswith("sessions"):
        try:
            parts = {p for _, p in active_tps}
            stale = [
                k.decode(errors="replace")
                for k in self.data
                if k not in self._key_partition and _key_partition(k, 6) not in parts
            ]
            _log(
                "store_purge",
                active=sorted(parts),
                recovered_elsewhere=sum(1 for p in self._key_partition.values() if p not in parts),
                live_stale=stale,
            )
        except Exception as exc:
            _log("trace_error", error=repr(exc))
    await _purge(self, active_tps, standby_tps)


_memory.Store.on_recovery_completed = purge

_send_cl = _tbase.Collection.send_changelog


def send_changelog(self, partition, key, value, key_serializer=None, value_serializer=None):
    if self.name.endswith("sessions"):
        from faust.streams import current_event

        ev = current_event()
        try:
            _log(
                "state_write",
                key=key.decode(errors="replace"),
                part=_key_partition(key, 6),
                owned=_owned(),
                state=_summary(value),
                by=None
                if ev is None
                else (_short(ev.message.topic), ev.message.partition, ev.message.offset),
            )
        except Exception as exc:
            _log("trace_error", error=repr(exc))
    return _send_cl(self, partition, key, value, key_serializer, value_serializer)


_tbase.Collection.send_changelog = send_changelog

_agent_apply = _agent.SessionAgent.apply


async def agent_apply(self, records, held):
    try:
        recs = [
            (
                _short(r.message.topic),
                r.message.partition,
                r.message.offset,
                (r.message.key or b"").decode(errors="replace"),
            )
            for r in records
        ]
        key = records[0].message.key if records else None
        before = None
        if key is not None:
            before = _summary(self.sessions.get(key))
        _log("apply", recs=recs, before=before, owned=_owned())
    except Exception as exc:
        _log("trace_error", error=repr(exc))
    await _agent_apply(self, records, held)


_agent.SessionAgent.apply = agent_apply

_commit = _txn.Transaction.commit


async def commit(self, offsets):
    await _commit(self, offsets)
    try:
        _log(
            "commit",
            n=self.commits,
            offsets={f"{_short(tp.topic)}:{tp.partition}": o for tp, o in offsets.items()},
        )
    except Exception as exc:
        _log("trace_error", error=repr(exc))


_txn.Transaction.commit = commit
_log("start")

from pipeline.processors import ledger_consumer as _lc  # noqa: E402

_seek_now = _lc.LedgerConsumer._seek_now


def seek_now(self, tp, offset):
    try:
        import inspect

        _log(
            "seek",
            tp=f"{_short(tp.topic)}:{tp.partition}",
            offset=offset,
            by=inspect.stack()[1].function,
        )
    except Exception as exc:
        _log("trace_error", error=repr(exc))
    return _seek_now(self, tp, offset)


_lc.LedgerConsumer._seek_now = seek_now
