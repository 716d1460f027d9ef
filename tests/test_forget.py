"""``liverl forget``: one session's or one user's rows leave every Delta table (older versions
included after a zero-retention vacuum), the trainer's version folders, the processors'
changelogs (tombstones) and stopped gateway spools; everything else stays; the forget log keeps
counts, never content. Also the gateway side: who a turn belongs to is recorded."""

from __future__ import annotations

import contextlib
import copy
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from deltalake import DeltaTable, write_deltalake
from jsonschema import Draft7Validator

from pipeline import events
from pipeline.cli import LiverlGroup
from pipeline.events import examples
from pipeline.forget import FORGET_LOG, forget, survey_delta
from pipeline.lake import tables as T
from pipeline.lake.archive import Archiver
from pipeline.lake.forget import erase as delete_rows
from pipeline.lake.forget import session_tables, vacuum
from pipeline.lake.sql import run_query
from pipeline.lake.writer import Appender
from pipeline.serving.app import Gateway, create_app
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.build import build_app
from pipeline.serving.recorder import frame
from pipeline.serving.settings import ServeSettings, hash_key
from pipeline.serving.spool import Spool
from pipeline.serving.threaded import running
from pipeline.settings import Settings
from pipeline.trainer import checkpoint as ck
from pipeline.trainer.publish import TRAJ_FILE

from .conftest import create_topic
from .test_report import traj_row

MODEL = "liverl-tiny-v1"
ALICE, BOB_KEY = "alice", "bob-key"
BOB = hash_key(BOB_KEY)[:16]  # the key id the gateway records when no X-Liverl-User is sent


# ---- the gateway records whose turn it is ----------------------------------------------------


class ListRecorder:
    backlog = 0

    def __init__(self) -> None:
        self.records: list[tuple[str, events.Event]] = []

    def record(self, topic: str, event: events.Event) -> None:
        self.records.append((topic, event))


@pytest.fixture(scope="module")
def tiny() -> HFBackend:
    from pipeline.models.tiny import ensure_tiny_model

    return HFBackend(ensure_tiny_model(), workers=1, context_length=64)


def _chat(c: Any, session: str, headers: dict[str, Any], base: str = "") -> httpx.Response:
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": f"private question of {session}"}],
    }
    return c.post(
        f"{base}/v1/chat/completions", json=body, headers={"X-Session-Id": session, **headers}
    )


@contextlib.contextmanager
def _gateway(tiny: HFBackend, rec: ListRecorder) -> Iterator[httpx.Client]:
    """A real server: header bytes reach the app as a client sends them (latin-1 over ASGI)."""
    app = create_app(Gateway(ServeSettings(reload=False), tiny, rec))  # type: ignore[arg-type]
    with running(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        yield c


def test_gateway_records_the_user_header_else_the_key_id(tiny: HFBackend) -> None:
    rec = ListRecorder()
    with _gateway(tiny, rec) as c:
        assert _chat(c, "u-1", {"X-Liverl-User": ALICE}).status_code == 200
        assert _chat(c, "u-2", {"Authorization": f"Bearer {BOB_KEY}"}).status_code == 200
        assert _chat(c, "u-3", {"X-Liverl-User": "ünïcode user".encode()}).status_code == 200
        assert _chat(c, "u-4", {}).status_code == 200
    got = {e.session_id: e.user_id for _, e in rec.records}  # type: ignore[attr-defined]
    assert got == {"u-1": ALICE, "u-2": BOB, "u-3": "ünïcode user", "u-4": "anonymous"}
    # and it survives the codec (the schema's optional property)
    ev = rec.records[0][1]
    assert events.decode(events.encode(ev)).user_id == ALICE  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "value",
    [
        "x" * 257,  # longer than session ids may be
        b"\xff\xfe",  # not UTF-8
        "",  # empty
        "a\u200bb".encode(),  # an invisible (non-printable) character
    ],
)
def test_bad_user_header_is_a_400_and_nothing_is_recorded(tiny: HFBackend, value: Any) -> None:
    rec = ListRecorder()
    with _gateway(tiny, rec) as c:
        resp = _chat(c, "bad-user", {"X-Liverl-User": value})
    assert resp.status_code == 400, resp.text
    body = resp.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["param"] == "X-Liverl-User" and body["type"] == "invalid_request_error"
    assert rec.records == []


def test_user_id_is_an_optional_bounded_property() -> None:
    schema = orjson.loads(events.schema_files()[("interaction", 1)].read_bytes())
    ref = Draft7Validator(schema)
    doc = events.to_dict(examples.interaction())
    assert "user_id" not in schema["required"]
    for value, ok in [(None, True), ("alice", True), ("", False), ("x" * 257, False), (7, False)]:
        d = copy.deepcopy(doc) | {"user_id": value}
        assert ref.is_valid(d) is ok, value
        if ok:
            assert events.decode(orjson.dumps(d)).user_id == value  # type: ignore[attr-defined]
        else:
            with pytest.raises(ValueError):
                events.decode(orjson.dumps(d))
    d = copy.deepcopy(doc)
    d.pop("user_id", None)  # events written before the field
    assert events.decode(orjson.dumps(d)).user_id is None  # type: ignore[attr-defined]


# ---- Delta predicates and vacuum, no broker ---------------------------------------------------


def test_delete_matches_quoted_ids_and_dead_letters_by_key_then_vacuum_drops_old_files(
    tmp_path: Path,
) -> None:
    path = tmp_path / "lake" / "events" / "dlq"
    rows = pa.table(
        {
            "session_id": ["o'x", "ünï", None, "keep", None],
            "key": [b"o'x", b"u", b"o'x", b"keep", b"keep"],
            "topic": ["t"] * 5,
            "timestamp_ms": [1, 2, 3, 4, 5],
            "day": ["d1", "d1", "d2", "d2", "d2"],
        }
    )
    write_deltalake(str(path), rows, partition_by=["day"])
    old = DeltaTable(str(path)).version()
    (hit,) = survey_delta(Settings(state_dir=tmp_path), tmp_path / "lake", ["o'x", "ünï"])
    assert (hit.label, hit.rows, hit.archive) == ("events/dlq", 3, True)
    assert delete_rows(hit, ["o'x", "ünï"]) == 3
    left = DeltaTable(str(path)).to_pyarrow_table().sort_by("timestamp_ms")
    assert left.column("key").to_pylist() == [b"keep", b"keep"]
    # filtered reads still work (DeltaTable.delete's view-typed files broke them)
    assert run_query(
        tmp_path / "lake", "SELECT count(*) FROM events_dlq WHERE session_id IN ('keep', 'other')"
    )[1] == [(1,)]
    assert DeltaTable(str(path), version=old).to_pyarrow_table().num_rows == 5  # time travel
    assert vacuum([path], 24) == 0  # removed just now: kept for the retention
    assert vacuum([path], 0) >= 1
    with pytest.raises(Exception, match="(?i)not found|no such file"):
        DeltaTable(str(path), version=old).to_pyarrow_table()


def test_vacuum_only_follows_the_retention_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lake = tmp_path / "lake"
    path = lake / "trajectories"
    rows = [_traj(s, i) for s in ("v-1", "v-2") for i in range(2)]
    Appender(str(path), ["day"]).append_once(
        T.to_table(T.TRAJECTORIES, rows), app_id="test", version=1
    )
    old = DeltaTable(str(path)).version()
    (hit,) = survey_delta(Settings(state_dir=tmp_path), lake, ["v-1"])
    assert delete_rows(hit, ["v-1"]) == 2
    settings = Settings(state_dir=tmp_path)
    out = _ok(_forget(settings, "--vacuum-only"))
    assert "0 file(s) removed at least 24 h ago deleted" in out
    assert DeltaTable(str(path), version=old).to_pyarrow_table().num_rows == 4
    monkeypatch.setenv("LIVERL_FORGET_VACUUM_RETENTION_HOURS", "0")  # read by the settings
    out = _ok(_forget(Settings(state_dir=tmp_path), "--vacuum-only"))
    assert "removed at least 0 h ago deleted" in out and " 0 file(s)" not in out
    with pytest.raises(Exception, match="(?i)not found|no such file"):
        DeltaTable(str(path), version=old).to_pyarrow_table()
    assert DeltaTable(str(path)).version() > old  # the table itself reads on
    assert sorted(DeltaTable(str(path)).to_pyarrow_table().column("session_id").to_pylist()) == [
        "v-2",
        "v-2",
    ]


# ---- the whole flow on the real broker --------------------------------------------------------


Record = tuple[str, int | None, bytes, bytes | None]  # topic, partition, key, value


def _produce(settings: Settings, records: list[Record]) -> None:
    p = Producer(settings.kafka_client_config(**{"acks": "all"}))
    for topic, partition, key, value in records:
        if partition is None:
            p.produce(topic, key=key, value=value)
        else:
            p.produce(topic, key=key, value=value, partition=partition)
    assert p.flush(30) == 0


def _read(settings: Settings, topic: str) -> list[tuple[int, bytes, bytes | None]]:
    """(partition, key, value) of every record of ``topic``, in offset order per partition."""
    c = Consumer(
        settings.kafka_client_config(
            **{
                "group.id": "forget-verify",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
            }
        )
    )
    meta = c.list_topics(topic, timeout=10).topics[topic]
    out: list[tuple[int, bytes, bytes | None]] = []
    for p in sorted(meta.partitions):
        low, high = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
        if high <= low:
            continue
        c.assign([TopicPartition(topic, p, low)])
        while True:
            (m,) = c.consume(1, timeout=10) or (None,)
            assert m is not None, f"{topic}[{p}] stalled"
            if m.error() is None:
                out.append((p, m.key(), m.value()))
            elif m.error().code() == KafkaError._PARTITION_EOF:  # past a commit marker
                break
            if m.offset() + 1 >= high:
                break
    c.close()
    return out


def _ends(settings: Settings, topics: list[str]) -> dict[tuple[str, int], int]:
    c = Consumer(settings.kafka_client_config(**{"group.id": "forget-verify"}))
    out = {}
    for t in topics:
        for p in c.list_topics(t, timeout=10).topics[t].partitions:
            out[(t, p)] = c.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1]
    c.close()
    return out


def _rows_of(lake: Path, session: str) -> dict[str, int]:
    """Rows of ``session`` per session-bearing table (archive tables: dead letters by key)."""
    out = {}
    for label, path in session_tables(lake).items():
        t = DeltaTable(str(path)).to_pyarrow_table()
        sids = t.column("session_id").to_pylist()
        keys = t.column("key").to_pylist() if "key" in t.column_names else [None] * len(sids)
        out[label] = sum(
            s == session or (s is None and k == session.encode())
            for s, k in zip(sids, keys, strict=True)
        )
    return out


def _traj(session: str, i: int) -> dict[str, Any]:
    row = traj_row(1, 1, "trained", 0.5, 10 + i, i=i)
    row.update(
        event_id=f"{session}-{i}", session_id=session, response_text=f"private answer of {session}"
    )
    return row


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


@pytest.fixture
def world(kafka_settings: Settings, admin: Any, unique: str, tmp_path: Path) -> Iterator[dict]:
    """Two users' sessions recorded through the real gateway, archived, in trajectories, in a
    trainer version folder and in the processors' changelogs."""
    from pipeline.processors.app import create_app as processors_app
    from pipeline.processors.internal_topics import ensure_internal_topics
    from pipeline.processors.records import key_partition

    inter, nexts, dlq = (f"forget-{unique}.{n}" for n in ("interactions", "next_states", "dlq"))
    for t in (inter, nexts):
        create_topic(admin, t, 6)
    create_topic(admin, dlq, 1)
    state = tmp_path / "state"
    settings = kafka_settings.model_copy(
        update={
            "state_dir": state,
            "serve": ServeSettings(interactions_topic=inter, next_states_topic=nexts),
            "processors": kafka_settings.processors.model_copy(
                update={"app_id": f"forget-{unique}", "web_enabled": False}
            ),
        }
    )
    lake = state / "lake"
    cfg = ServeSettings(
        model_path="tiny",
        spool_dir=state / "spool" / "gw-0",
        reload=False,
        interactions_topic=inter,
        next_states_topic=nexts,
    )
    sessions = {"f-a1": ALICE, "f-a2": ALICE, "f-b1": BOB}
    with running(build_app(cfg, settings)) as url, httpx.Client(timeout=60) as c:
        for sid, turns in (("f-a1", 2), ("f-a2", 1), ("f-b1", 2)):
            who = {"X-Liverl-User": ALICE} if sessions[sid] == ALICE else {}
            for _ in range(turns):
                resp = _chat(c, sid, {**who, "Authorization": f"Bearer {BOB_KEY}"}, url)
                assert resp.status_code == 200, resp.text
        for sid in ("f-a1", "f-b1"):
            assert (
                c.post(
                    f"{url}/v1/feedback",
                    json={"session_id": sid, "thumbs": "up"},
                    headers={"Authorization": f"Bearer {BOB_KEY}"},
                ).status_code
                == 200
            )
        deadline = time.monotonic() + 60
        while _metric(url, "liverl_gateway_record_backlog") > 0:
            assert time.monotonic() < deadline, "the gateway did not deliver its records"
            time.sleep(0.2)
    # dead letters keyed by session, without a decodable envelope (archive: session_id null)
    _produce(
        settings,
        [(dlq, None, b"f-a1", b"garbage of f-a1"), (dlq, None, b"f-b1", b"garbage of f-b1")],
    )
    Archiver(settings, [inter, nexts, dlq], lake).run()
    Appender(T.LakeTables(lake).uri(T.TRAJECTORIES), ["day"]).append_once(
        T.to_table(T.TRAJECTORIES, [_traj(s, i) for s in sessions for i in range(2)]),
        app_id="test",
        version=1,
    )
    weights = Path(settings.trainer.under_state_dir(state).weights_root)

    def files(tmp: Path) -> None:
        (tmp / "adapter.bin").write_bytes(b"weights")
        rows = [_traj(s, i) for s in ("f-a1", "f-b1") for i in range(2)]
        pq.write_table(T.to_table(T.TRAJECTORIES, rows), tmp / ck.TRAINER_DIR / TRAJ_FILE)

    manifest = ck.Manifest(
        policy_id="p1",
        version=1,
        parent=None,
        step=1,
        created_ms=0,
        input_topic=inter,
        consumed_offsets={},
        files=[],
    )
    version = ck.write_version(weights, manifest, files)
    app = processors_app(settings, settings.processors, settings.state_dir)
    changelogs = ensure_internal_topics(app, settings)
    app_id = settings.processors.app_id
    assert f"{app_id}-sessions-changelog" in changelogs
    table_records = []
    for sid in ("f-a1", "f-b1"):
        k = sid.encode()
        part = key_partition(k, 6)
        table_records += [
            (f"{app_id}-sessions-changelog", part, k, b'{"touched_ms": 1}'),
            (f"{app_id}-tokens-changelog", part, k + b"\x000", b'{"ids": [1, 2]}'),
            (f"{app_id}-parked-changelog", part, k + b"\x00ns-1", b"parked"),
            (f"{app_id}-parked-changelog", part, k + b"\x00ns-1", None),  # done already
            (
                f"{app_id}-group_members-changelog",
                key_partition(b"g1", 6),
                b"g1\x00" + k,
                b"[samples]",
            ),
        ]
    table_records.append(
        (
            f"{app_id}-groups-changelog",
            key_partition(b"g1", 6),
            b"g1",
            b'{"sessions": ["f-a1", "f-b1"]}',
        )
    )
    _produce(settings, table_records)
    yield {
        "settings": settings,
        "lake": lake,
        "version": version,
        "app_id": app_id,
        "spool": cfg.spool_dir,
        "topics": [inter, nexts, dlq],
    }


def _isolated(settings: Settings, state: Path, unique: str, interactions: str) -> Settings:
    """Own state dir, interactions topic and processors app id: the live topics and
    changelogs are never read."""
    return settings.model_copy(
        update={
            "state_dir": state,
            "serve": ServeSettings(interactions_topic=interactions),
            "processors": settings.processors.model_copy(update={"app_id": f"forget-{unique}"}),
        }
    )


def _forget(settings: Settings, *args: str) -> Result:
    """Through a group as ``liverl`` has it: domain errors become one line there."""
    group = LiverlGroup()
    group.add_command(forget)
    return CliRunner().invoke(group, ["forget", *args], obj={"settings": settings})


def _ok(res: Result) -> str:
    """The output of a run that must succeed; else the output and any traceback."""
    if res.exit_code != 0:
        trace = "".join(traceback.format_exception(*res.exc_info)) if res.exc_info else ""
        raise AssertionError(f"exit {res.exit_code}\n{res.output}\n{trace}")
    return res.output


def _changelog_state(settings: Settings, app_id: str) -> dict[tuple[str, bytes], list[Any]]:
    out: dict[tuple[str, bytes], list[Any]] = {}
    for table in ("sessions", "tokens", "parked", "group_members", "groups"):
        topic = f"{app_id}-{table}-changelog"
        for _p, key, value in _read(settings, topic):
            out.setdefault((table, key), []).append(value)
    return out


@pytest.mark.integration
def test_forget_a_session_then_a_user(world: dict) -> None:
    settings, lake, app_id = world["settings"], world["lake"], world["app_id"]
    before = {s: _rows_of(lake, s) for s in ("f-a1", "f-a2", "f-b1")}
    assert before["f-a1"]["trajectories"] == 2 and before["f-b1"]["trajectories"] == 2
    inter_table = next(t for t in before["f-a1"] if t.endswith("interactions"))
    assert before["f-a1"][inter_table] == 2 and before["f-a2"][inter_table] == 1
    assert before["f-a1"]["events/" + world["topics"][2]] == 1  # the dead letter, by key
    assert all(n > 0 for n in before["f-a1"].values()), before
    versions = {label: DeltaTable(str(p)).version() for label, p in session_tables(lake).items()}
    spool_files = {p: p.read_bytes() for p in Path(world["spool"]).glob("*.log")}
    assert any(b"f-a1" in data for data in spool_files.values())  # delivered, still on disk
    manifest = (world["version"] / ck.MANIFEST).read_bytes()
    changelog_ends = _ends(settings, [f"{app_id}-{t}-changelog" for t in ("sessions", "tokens")])

    # A dry run reports and changes nothing, the log included.
    dry = _ok(_forget(settings, "--session", "f-a1", "--dry-run"))
    assert "dry run" in dry and "trajectories: would remove 2 row(s)" in dry
    assert f"{app_id}-sessions-changelog: would remove 1 key(s)" in dry
    assert "liverl.interactions" not in dry and world["topics"][0] in dry
    assert {s: _rows_of(lake, s) for s in before} == before
    assert {
        label: DeltaTable(str(p)).version() for label, p in session_tables(lake).items()
    } == versions
    assert {p: p.read_bytes() for p in spool_files} == spool_files
    assert (world["version"] / ck.MANIFEST).read_bytes() == manifest
    assert _ends(settings, list({t for t, _ in changelog_ends})) == changelog_ends
    assert not (lake / FORGET_LOG).exists()

    # Forget one session, vacuuming now.
    old_traj = DeltaTable(str(lake / "trajectories")).version()
    _ok(_forget(settings, "--session", "f-a1", "--vacuum-now"))
    after = {s: _rows_of(lake, s) for s in before}
    assert set(after["f-a1"].values()) == {0}, after["f-a1"]
    assert after["f-a2"] == before["f-a2"] and after["f-b1"] == before["f-b1"]
    cols, rows = run_query(
        lake, "SELECT session_id, count(*) FROM trajectories GROUP BY 1 ORDER BY 1"
    )
    assert rows == [("f-a2", 2), ("f-b1", 2)]
    with pytest.raises(Exception, match="(?i)not found|no such file"):
        DeltaTable(str(lake / "trajectories"), version=old_traj).to_pyarrow_table()
    # the trainer's version folder: rows gone, still a valid version
    assert ck.verify_version(world["version"]).version == 1
    kept = pq.read_table(world["version"] / ck.TRAINER_DIR / TRAJ_FILE)
    assert sorted(set(kept.column("session_id").to_pylist())) == ["f-b1"]
    # the stopped gateway's spool: the session's delivered frames blanked, the others kept
    data = b"".join(p.read_bytes() for p in Path(world["spool"]).glob("*.log"))
    assert b"f-a1" not in data and b"private question of f-b1" in data
    spool = Spool(Path(world["spool"]))
    assert spool.pending == 0 and spool.peek(100)[0] == []  # nothing re-sent
    spool.close()
    # changelogs: a tombstone per live key of the session; others untouched
    state = _changelog_state(settings, app_id)
    for key in [("sessions", b"f-a1"), ("tokens", b"f-a1\x000"), ("group_members", b"g1\x00f-a1")]:
        assert state[key][-1] is None, key
    assert state[("parked", b"f-a1\x00ns-1")] == [b"parked", None]  # not tombstoned twice
    for key in [("sessions", b"f-b1"), ("tokens", b"f-b1\x000"), ("group_members", b"g1\x00f-b1")]:
        assert state[key] == [state[key][0]] and state[key][0] is not None, key
    assert len(state[("groups", b"g1")]) == 1
    # the log: counts, who and when; no content
    log = DeltaTable(str(lake / FORGET_LOG)).to_pyarrow_table().to_pylist()
    assert len(log) == 1
    entry = log[0]
    assert entry["target"] == "session" and entry["sessions"] == ["f-a1"]
    assert entry["user_sha256"] is None and entry["operator"] and entry["vacuumed_files"] > 0
    removed = orjson.loads(entry["removed"])
    assert removed["delta"] == before["f-a1"]
    assert removed["changelogs"] == {
        f"{app_id}-sessions-changelog": 1,
        f"{app_id}-tokens-changelog": 1,
        f"{app_id}-group_members-changelog": 1,
    }
    assert removed["versions"] == {str(world["version"]): 2}
    assert sum(removed["spools"].values()) == 3  # two turns and a feedback, delivered
    kafka = orjson.loads(entry["kept"])["kafka"]
    assert kafka[world["topics"][0]]["records"] == 2 and "gone_by" in kafka[world["topics"][0]]
    text = orjson.dumps(entry).decode()
    assert "private" not in text and "garbage" not in text

    # Forget a user: alice's other session goes too (f-a1 is still on the interactions topic
    # until its retention, so it is found and forgotten again); bob keeps everything.
    out = _ok(_forget(settings, "--user", ALICE, "--vacuum-now"))
    assert "session f-a1" in out and "session f-a2" in out
    assert set(_rows_of(lake, "f-a2").values()) == {0}
    assert _rows_of(lake, "f-b1") == before["f-b1"]
    log = DeltaTable(str(lake / FORGET_LOG)).to_pyarrow_table().sort_by("ts_ms").to_pylist()
    assert [e["target"] for e in log] == ["session", "user"]
    assert log[1]["sessions"] == ["f-a1", "f-a2"]
    assert ALICE not in orjson.dumps(log[1]).decode()  # a hash of the user id only
    assert len(log[1]["user_sha256"]) == 64

    # Nothing more to find: unknown, a clear usage error.
    res = _forget(settings, "--user", "nobody")
    assert res.exit_code == 2 and "unknown user 'nobody'" in res.output


@pytest.mark.integration
def test_arguments_and_unknown_targets_are_usage_errors(
    kafka_settings: Settings, tmp_path: Path, unique: str
) -> None:
    settings = _isolated(kafka_settings, tmp_path, unique, f"forget-{unique}.none")
    for args, message in [
        ([], "exactly one of --session S or --user U"),
        (["--session", "a", "--user", "b"], "exactly one of --session S or --user U"),
        (["--session", ""], "printable id of 1 to 256"),
        (["--user", "x" * 300], "printable id of 1 to 256"),
        (["--vacuum-only", "--session", "a"], "--vacuum-only takes no --session"),
        (["--session", "never-seen"], "unknown session 'never-seen'"),
        (["--session", "never-seen", "--dry-run"], "unknown session 'never-seen'"),
    ]:
        res = _forget(settings, *args)
        assert res.exit_code == 2, (args, res.output)
        assert message in res.output, (args, res.output)
        assert "Traceback" not in res.output
    assert not (tmp_path / "lake" / FORGET_LOG).exists()


@pytest.mark.integration
def test_live_spool_with_undelivered_frames_is_refused_then_rewritten_once_stopped(
    kafka_settings: Settings, tmp_path: Path, unique: str
) -> None:
    topic = f"forget-{unique}.interactions"  # never created: only the spool holds them
    settings = _isolated(kafka_settings, tmp_path, unique, topic)

    def turn(session: str, user: str, n: int) -> bytes:
        ev = examples.interaction()
        ev.event_id, ev.session_id, ev.turn, ev.user_id = f"{session}-{n}", session, n, user
        ev.response_text = f"secret of {session}"
        return frame(topic, ev)

    spool_dir = tmp_path / "spool" / "gw-1"
    spool = Spool(spool_dir)  # what a running gateway holds
    spool.append([turn("s-x", "carol", 0), turn("s-y", "dave", 0)])
    frames, cursor = spool.peek(2)
    spool.ack(cursor)  # delivered
    spool.append([turn("s-x", "carol", 1), turn("s-y", "dave", 1), turn("s-x", "carol", 2)])

    res = _forget(settings, "--session", "s-x")
    assert res.exit_code == 1, res.output
    assert "2 undelivered frame(s)" in res.output and str(spool_dir) in res.output
    assert "held by a running gateway" in res.output
    dry = _ok(_forget(settings, "--user", "carol", "--dry-run"))  # found through the spool
    assert "session s-x" in dry
    assert not (tmp_path / "lake" / FORGET_LOG).exists()

    spool.close()  # the gateway stopped
    _ok(_forget(settings, "--session", "s-x"))
    data = b"".join(p.read_bytes() for p in spool_dir.glob("*.log"))
    assert b"s-x" not in data and b"secret of s-y" in data
    reopened = Spool(spool_dir)
    assert reopened.pending == 1
    left, _ = reopened.peek(10)
    assert [orjson.loads(orjson.loads(f)["v"])["event_id"] for f in left] == ["s-y-1"]
    reopened.close()
    (entry,) = DeltaTable(str(tmp_path / "lake" / FORGET_LOG)).to_pyarrow_table().to_pylist()
    assert orjson.loads(entry["removed"])["spools"] == {str(spool_dir): 3}
