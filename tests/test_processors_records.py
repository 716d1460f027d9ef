"""Table keys and kept records of the processors (records.py)."""

from __future__ import annotations

from types import SimpleNamespace

import orjson
import pytest

from pipeline import events
from pipeline.events import examples
from pipeline.processors import records


@pytest.mark.parametrize(
    ("key", "java_hash"),
    # Kafka's own murmur2 test vectors (UtilsTest), as Java's signed ints.
    [(b"21", -973932308), (b"foobar", -790332482), (b"abc", 479470107)],
)
def test_key_partition_is_kafkas_default_partitioner(key: bytes, java_hash: int) -> None:
    # Kafka: toPositive(murmur2(key)) % partitions, toPositive = hash & 0x7fffffff.
    for partitions in (1, 6, 7):
        assert records.key_partition(key, partitions) == (java_hash & 0x7FFFFFFF) % partitions


def test_composite_keys_place_by_their_session() -> None:
    assert records.token_key(b"s-1", 12) == b"s-1\x0012"
    assert records.parked_key(b"s-1", "n-9") == b"s-1\x00n-9"
    assert records.member_key(b"g", "s-1") == b"g\x00s-1"
    assert records.session_of(records.token_key(b"s-1", 3)) == b"s-1"
    assert records.session_of(b"plain") == b"plain"


def test_a_parked_record_keeps_its_value_bytes_and_coordinates() -> None:
    nxt = examples.examples()["next_state"]
    value = events.encode(nxt)  # a record's bytes, kept verbatim
    msg = SimpleNamespace(
        topic="liverl.next_states.v1",
        partition=4,
        offset=17,
        key=b"s\x00k",
        headers=[("liverl-type", b"next_state"), ("empty", None)],
        value=value,
    )
    kept = records.Parked(records.park(msg))
    assert (kept.topic, kept.partition, kept.offset, kept.key) == (
        "liverl.next_states.v1",
        4,
        17,
        b"s\x00k",
    )
    assert kept.headers == [("liverl-type", b"next_state"), ("empty", b"")]
    assert kept.value == value
    assert records.parked_next_state(records.park(msg)) == nxt
    keyless = SimpleNamespace(topic="t", partition=0, offset=0, key=None, headers=None, value=b"")
    assert records.Parked(records.park(keyless)).key is None


def test_touched_reads_the_write_time_or_zero() -> None:
    assert records.touched(orjson.dumps({"touched_ms": 1234, "x": 1})) == 1234
    assert records.touched(b"{}") == 0
    for bad in (b"not json", b"[1, 2]", b'{"touched_ms": "soon"}'):
        assert records.touched(bad) == 0


def test_held_samples_refuse_what_is_not_a_list_of_samples() -> None:
    sample = examples.examples()["sample"]
    doc = events.to_dict(sample)
    assert records.held_samples(orjson.dumps([doc, doc])) == [sample, sample]
    cases = {
        b"{": "not JSON",
        b"{}": "not a list",
        b"[1]": "int, not a dict",
        orjson.dumps([events.to_dict(examples.examples()["reward"])]): "a reward event",
    }
    for raw, why in cases.items():
        with pytest.raises(events.EventValidationError, match=why):
            records.held_samples(raw)
