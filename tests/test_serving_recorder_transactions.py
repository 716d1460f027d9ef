"""The recorder's transaction protocol (issue 25, item 2) against a scripted producer: a batch
is committed only when every record was confirmed, a failed one is aborted and sent whole
again, a commit whose outcome is unknown is retried on the same producer (never re-sent by a
new one), and only a fatal error replaces the producer. The real broker's side is
``tests/test_broker_cluster.py`` (a failover longer than the delivery timeout)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from pipeline.events import examples
from pipeline.kafka import names
from pipeline.serving.recorder import Recorder
from pipeline.serving.spool import Spool
from pipeline.settings import Settings


class Raw:
    """The confluent-kafka side: transaction calls logged, errors scripted per call."""

    def __init__(self, log: list[str], script: dict[str, list[KafkaError]]) -> None:
        self.log, self.script = log, script

    def _call(self, what: str) -> None:
        self.log.append(what)
        errors = self.script.get(what)
        if errors:
            raise KafkaException(errors.pop(0))

    def init_transactions(self, timeout: float) -> None:
        self._call("init")

    def begin_transaction(self) -> None:
        self._call("begin")

    def commit_transaction(self, timeout: float) -> None:
        self._call("commit")

    def abort_transaction(self, timeout: float) -> None:
        self._call("abort")

    def list_topics(self, timeout: float) -> None:
        return None


class FakeProducer:
    """What the recorder uses of EventProducer; ``fail_sends`` rounds report timeouts."""

    def __init__(self, n: int, log: list[str], script: dict[str, list[KafkaError]],
                 fail_rounds: list[int]) -> None:  # fmt: skip
        self.n, self.raw, self.log, self.fail_rounds = n, Raw(log, script), log, fail_rounds
        self.pending: list[Callable[[], None]] = []
        self.sent = 0

    def send_raw(self, topic: str, value: bytes, *, key: Any, headers: Any,
                 on_delivery: Callable[[KafkaError | None, Any], None]) -> None:  # fmt: skip
        self.sent += 1
        failing = bool(self.fail_rounds and self.fail_rounds[0] > 0)
        err = KafkaError(KafkaError._MSG_TIMED_OUT, "timed out") if failing else None
        self.pending.append(lambda: on_delivery(err, None))

    def poll(self, timeout: float) -> int:
        if self.pending and self.fail_rounds and self.fail_rounds[0] > 0:
            self.fail_rounds[0] -= 1
            if self.fail_rounds[0] == 0:
                self.fail_rounds.pop(0)
        for report in self.pending:
            report()
        self.log.append(f"sent:{len(self.pending)}")
        self.pending = []
        return 0

    def flush(self, timeout: float) -> None:
        self.poll(0)


def run(tmp_path: Path, script: dict[str, list[KafkaError]], fail_rounds: list[int],
        events_n: int = 3) -> tuple[Recorder, list[str], list[FakeProducer]]:  # fmt: skip
    log: list[str] = []
    made: list[FakeProducer] = []
    rec = Recorder(Settings(state_dir=tmp_path), Spool(tmp_path / "spool"),
                   delivery_timeout_s=1.0, transactional_id="liverl-recorder-test")  # fmt: skip

    def new_producer(client_id: str, *, transactional: bool = False) -> FakeProducer:
        assert transactional, "a transactional id makes a transactional producer"
        made.append(FakeProducer(len(made), log, script, fail_rounds))
        log.append(f"producer:{len(made) - 1}")
        return made[-1]

    rec._new_producer = new_producer  # type: ignore[method-assign,assignment]
    rec._stop.wait = lambda _t=None: False  # type: ignore[method-assign,assignment]
    base = examples.interaction(prompt_tokens=4, response_tokens=2)
    for i in range(events_n):
        rec.record(names.INTERACTIONS, dataclasses.replace(base, event_id=f"e{i}", turn=i))
    rec.linger_s = 0.05
    rec.start()
    deadline = time.monotonic() + 20
    while rec.delivered < events_n and time.monotonic() < deadline:
        time.sleep(0.02)
    rec.close(timeout=2)
    return rec, [x for x in log if x != "sent:0"], made


def err(code: int, **kind: bool) -> KafkaError:
    return KafkaError(code, "scripted", **kind)


def test_a_batch_is_one_committed_transaction(tmp_path: Path) -> None:
    rec, log, made = run(tmp_path, {}, [])
    assert rec.delivered == 3 and rec.redelivered == 0 and rec.backlog == 0
    assert log[:5] == ["producer:0", "init", "begin", "sent:3", "commit"]
    assert len(made) == 1


def test_an_undelivered_batch_is_aborted_and_sent_whole_again(tmp_path: Path) -> None:
    """The first round's three reports are timeouts: abort, then the same producer sends all
    three again in a new transaction (nothing of the aborted one is read_committed)."""
    rec, log, made = run(tmp_path, {}, [1])
    assert log[:9] == ["producer:0", "init", "begin", "sent:3", "abort",
                       "begin", "sent:3", "commit"][:9]  # fmt: skip
    assert rec.delivered == 3 and rec.redelivered == 3 and len(made) == 1


def test_a_commit_with_an_unknown_outcome_is_retried_on_the_same_producer(tmp_path: Path) -> None:
    """A retriable commit error (coordinator unreachable): commit again, never abort and
    re-send, which could double a batch the broker had committed."""
    timed_out = err(KafkaError._TIMED_OUT, retriable=True)
    rec, log, made = run(tmp_path, {"commit": [timed_out, timed_out]}, [])
    assert log[:7] == ["producer:0", "init", "begin", "sent:3", "commit", "commit", "commit"]
    assert "abort" not in log and len(made) == 1
    assert rec.delivered == 3 and rec.redelivered == 0


def test_an_abortable_commit_is_aborted_and_the_batch_sent_again(tmp_path: Path) -> None:
    abortable = err(KafkaError._STATE, txn_requires_abort=True)
    rec, log, made = run(tmp_path, {"commit": [abortable]}, [])
    assert log[:8] == ["producer:0", "init", "begin", "sent:3", "commit", "abort", "begin",
                       "sent:3"]  # fmt: skip
    assert rec.delivered == 3 and rec.redelivered == 3 and len(made) == 1


def test_a_fatal_error_replaces_the_producer_which_fences_the_old_one(tmp_path: Path) -> None:
    """Fatal on abort (the coordinator had timed the transaction out): a new producer with
    the same transactional id initialises (fencing the old one) and sends the batch."""
    fatal = err(KafkaError.INVALID_TXN_STATE, fatal=True)
    rec, log, made = run(tmp_path, {"abort": [fatal]}, [1])
    assert log[:9] == ["producer:0", "init", "begin", "sent:3", "abort", "producer:1", "init",
                       "begin", "sent:3"]  # fmt: skip
    assert rec.delivered == 3 and len(made) == 2 and made[1].sent == 3
    assert rec.lost == 0 and rec.dead_lettered == 0


def test_kafka_unreachable_at_start_waits_for_init(tmp_path: Path) -> None:
    timed_out = err(KafkaError._TIMED_OUT, retriable=True)
    rec, log, made = run(tmp_path, {"init": [timed_out, timed_out]}, [])
    assert log[:6] == ["producer:0", "init", "init", "init", "begin", "sent:3"]
    assert rec.delivered == 3 and len(made) == 1
