"""The HTML page of ``liverl report``: hand-made lake and archive in, hand-computed figures out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from deltalake import write_deltalake

from pipeline.report.html import build_page, lag_reader, render_html
from tests.conftest import create_topic
from tests.test_report import BASE_MS, SEC, full_lake, run


def archive(lake: Path, topic: str, values: list[Any]) -> None:
    """An archived topic as the page reads it: byte-exact payloads in ``events/<topic>``."""
    payloads = [v if isinstance(v, bytes) else orjson.dumps(v) for v in values]
    write_deltalake(
        str(lake / "events" / topic),
        pa.table({"payload": pa.array(payloads, pa.binary())}),
        mode="append",
    )


def judged_lake(tmp_path: Path) -> Path:
    lake = full_lake(tmp_path / "lake")
    # Turns 0-5 judged by the rule judge, 6-11 by the reply judge; a dead letter in between.
    scores: list[Any] = [
        {"session_id": "s1", "turn": i, "judge_id": "rules" if i < 6 else "replies"}
        for i in range(12)
    ]
    archive(lake, "prm_scores", [*scores[:3], b"\xff not json", *scores[3:]])
    archive(
        lake,
        "serving_status",
        [
            {"policy_id": "p1", "version": 1, "ok": True, "ts_ms": BASE_MS + 60 * SEC},
            {"policy_id": "p1", "version": 2, "ok": False, "ts_ms": BASE_MS + 126 * SEC},
            {"policy_id": "p1", "version": 2, "ok": True, "ts_ms": BASE_MS + 130 * SEC},
            {"policy_id": "p1", "version": 2, "ok": True, "ts_ms": BASE_MS + 140 * SEC},
            {"policy_id": "other", "version": 3, "ok": True, "ts_ms": BASE_MS + 226 * SEC},
        ],
    )
    archive(lake, "judge_consistency", CONSISTENCY)
    return lake


def match(
    eid: str, judge: str, agree: int, disagree: int, abstain: int = 0, flagged: bool = False
) -> dict[str, Any]:
    return {
        "type": "judge_consistency",
        "event_id": eid,
        "judge_id": judge,
        "judge_version": "v1",
        "agree": agree,
        "disagree": disagree,
        "abstain": abstain,
        "consistency": (agree + 1) / (agree + disagree + 2),
        "flagged": flagged,
    }


# replies: three matches, the second archived twice (a re-sent match), out of order; the third
# flagged it. rules: one.
CONSISTENCY = [
    match("m2", "replies", 1, 1),
    match("m1", "replies", 1, 0),
    match("m2", "replies", 1, 1),
    match("m3", "replies", 1, 2, 1, flagged=True),
    match("r1", "rules", 0, 0, 1),
]


def test_judge_tally_is_the_contradiction_not_the_match_it_took_back() -> None:
    """A verdict whose turn's outcomes contradicted each other is taken back out of agree:
    the sum agree + disagree + abstain falls by one, and used to keep the taken-back match as
    the judge's newest (agree 2 here)."""
    from pipeline.report.html import judge_consistency

    back = {**match("back", "replies", 1, 0), "contradicted": True, "contradictions": 1}
    for order in (
        [match("m1", "replies", 1, 0), match("m2", "replies", 2, 0), back],
        [back, match("m2", "replies", 2, 0), match("m1", "replies", 1, 0)],
    ):
        (row,) = judge_consistency(order)
        assert row["agree"] == 1 and row["consistency"] == pytest.approx(2 / 3)
        assert row["contradicted"] == 1


def test_page_figures_match_hand_computation(tmp_path: Path) -> None:
    page = build_page(judged_lake(tmp_path), "p1", buckets=1)
    # Trained rewards (tests/test_report.py SAMPLES): 1, -1, 1 | 1, 1, 0, -1 | 0.5.
    [hybrid] = page.by_method
    assert (hybrid.label, hybrid.n, hybrid.mean) == ("hybrid", [8], [pytest.approx(2.5 / 8)])
    by_judge = {s.label: (s.n, s.mean) for s in page.by_judge}
    # Trained turns 0, 1, 2, 4, 5 (rules) and 6, 7, 10 (replies).
    assert by_judge == {
        "rules": ([5], [pytest.approx(3 / 5)]),
        "replies": ([3], [pytest.approx(-0.5 / 3)]),
    }
    rows = {v.version: (v.step, v.verdict, v.live_after_s) for v in page.versions}
    # v2 published at 125 s; its first ok reload at 130 s (the failed one at 126 s is not live).
    assert rows == {1: (1, "candidate", 5.0), 2: (2, "promoted", 5.0), 3: (3, "rejected", None)}
    start = BASE_MS
    assert page.per_minute == [
        (start, 3),
        (start + 60_000, 4),
        (start + 120_000, 0),
        (start + 180_000, 1),
    ]
    assert page.samples_per_s == pytest.approx(8 / 200)
    assert page.notes == []
    assert [
        (j["judge_id"], j["agree"], j["disagree"], j["abstain"], j["flags"]) for j in page.judges
    ] == [("replies", 1, 2, 1, 1), ("rules", 0, 0, 1, 0)]
    assert page.judges[0]["consistency"] == pytest.approx(2 / 5)  # (1 + 1) / (1 + 2 + 2)
    html = render_html(page, tmp_path / "r.html").read_text()
    assert "<td>replies</td><td>v1</td>\n<td>1</td><td>2</td><td>1</td>\n<td>0.400</td>" in html


def test_time_buckets_split_the_reward_line(tmp_path: Path) -> None:
    page = build_page(judged_lake(tmp_path), "p1", buckets=2)
    [hybrid] = page.by_method
    # 0..200 s in two buckets of 101 s: [1, -1, 1, 1, 1, 0, -1] and [0.5].
    assert hybrid.n == [7, 1]
    assert hybrid.mean == [pytest.approx(2 / 7), pytest.approx(0.5)]


def test_without_archive_the_page_says_what_is_missing(tmp_path: Path) -> None:
    page = build_page(full_lake(tmp_path / "lake"), "p1")
    assert page.by_judge == []
    assert all(v.live_ms is None for v in page.versions)
    assert any("prm_scores" in n and "liverl archive" in n for n in page.notes)
    assert any("serving_status" in n for n in page.notes)
    assert any("judge_consistency" in n and "liverl judges watch" in n for n in page.notes)
    html = render_html(page, tmp_path / "r.html").read_text()
    assert "run `liverl archive`" in html


def test_html_is_self_contained_and_escapes_event_text(tmp_path: Path) -> None:
    lake = full_lake(tmp_path / "lake")
    archive(lake, "prm_scores", [{"session_id": "s1", "turn": 0, "judge_id": "<script>x</script>"}])
    archive(
        lake,
        "serving_status",
        [{"policy_id": "p1", "version": 2, "ok": True, "ts_ms": BASE_MS + 130 * SEC}],
    )
    page = build_page(
        lake,
        "p1",
        lag=lambda: [{"group": "g<1>", "state": "STABLE", "lag": 7, "by_topic": {"t": 7}}],
    )
    png = tmp_path / "p.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\nfake")
    html = render_html(page, tmp_path / "r.html", png=png).read_text()
    assert "<script>" not in html
    assert "&lt;script&gt;" in html
    assert "data:image/png;base64," in html
    assert "<td>g&lt;1&gt;</td><td>STABLE</td><td>7</td>" in html
    assert html.count("<svg") == 3  # by method, by judge, per minute
    assert "<td>v2</td><td>2</td>" in html and "5.00 s" in html


def test_broken_lag_reader_becomes_a_note(tmp_path: Path) -> None:
    def down() -> list[dict[str, Any]]:
        raise RuntimeError("broker unreachable")

    page = build_page(judged_lake(tmp_path), "p1", lag=down)
    assert page.lag is None
    assert page.notes == ["consumer lag unavailable: broker unreachable"]


@pytest.mark.integration
def test_report_command_writes_page_with_real_consumer_lag(
    tmp_path: Path, kafka_settings: Any, admin: Any, unique: str
) -> None:
    topic, group = f"report-lag-{unique}", f"report-group-{unique}"
    create_topic(admin, topic)
    producer = Producer(kafka_settings.kafka_client_config())
    for i in range(5):
        producer.produce(topic, str(i).encode())
    assert producer.flush(30) == 0
    consumer = Consumer(kafka_settings.kafka_client_config(**{"group.id": group}))
    consumer.commit(offsets=[TopicPartition(topic, 0, 2)], asynchronous=False)
    consumer.close()

    lake = judged_lake(tmp_path)
    out = tmp_path / "report.png"
    result = run("--lake", str(lake), "--out", str(out), obj={"settings": kafka_settings})
    assert result.exit_code == 0, result.output
    html_path = out.with_suffix(".html")
    assert f"html: {html_path}" in result.output
    html = html_path.read_text()
    assert f"<td>{group}</td>" in html
    row = html[html.index(f"<td>{group}</td>") :].split("</tr>")[0]
    assert "<td>3</td>" in row and f"{topic}: 3" in row

    rows = lag_reader(kafka_settings)()
    [mine] = [r for r in rows if r["group"] == group]
    assert (mine["lag"], mine["by_topic"]) == (3, {topic: 3})
