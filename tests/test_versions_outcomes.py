"""Each version's live outcome rate in words (pipeline/versions/outcomes.py), as ``liverl
versions`` and ``liverl report`` print it, over hand-built rows; the report's page and its
note when the broker does not answer."""

from __future__ import annotations

from pathlib import Path

from pipeline.report.command import live_outcomes
from pipeline.report.html import build_page, render_html
from pipeline.settings import Settings
from pipeline.versions.outcomes import outcome_lines, rate_text
from pipeline.versions.table import OutcomeRate, fold, rows, served

from .test_report import full_lake
from .test_versions import POLICY, act, status, weights


def table() -> list[dict]:  # type: ignore[type-arg]
    log = fold(
        POLICY, [weights(1), weights(1, "promoted"), weights(2), weights(2, "promoted"), weights(3)]
    )
    act(log, "rollback", 1, by="ops")
    reports = served(
        POLICY,
        [
            status("r0", 1, 1_767_225_600_000),
            status("r0", 2, 1_767_225_660_000),
            status("r0", 1, 1_767_225_720_000),
        ],
    )
    return rows(log, reports, {1: OutcomeRate(5, 10), 2: OutcomeRate(0, 10)}, require_promoted=True)


def test_rate_text_by_hand() -> None:
    # 5/10: Wilson 95 % [0.2366, 0.7634] (tests/test_versions.py works it out)
    assert (
        rate_text({"passed": 5, "total": 10, "rate": 0.5, "ci95": [0.236592, 0.763408]})
        == "5/10 50% [24%, 76%]"
    )
    assert rate_text(None) == "unknown"


def test_one_line_per_version_with_its_interval() -> None:
    assert outcome_lines(table()) == [
        "v1 (promoted, live): served 2026-01-01 00:00:00 .. now; live outcome 5/10 50% [24%, 76%]",
        # 0/10: hi = 0.38415 / 1.38415 = 0.2775
        "v2 (promoted, withdrawn): served 2026-01-01 00:01:00 .. 2026-01-01 00:02:00; live "
        "outcome 0/10 0% [0%, 28%]",
        "v3 (candidate, withdrawn): never served; live outcome unknown",
    ]


def test_the_page_shows_each_versions_rate(tmp_path: Path) -> None:
    page = build_page(full_lake(tmp_path / "lake"), "p1")
    page.live_outcomes = table()
    html = render_html(page, tmp_path / "r.html").read_text()
    section = html[html.index("Live outcome per version") : html.index("Throughput")]
    assert "<td>v1 (live)</td>" in section and "<td>5 / 10</td><td>50 %</td>" in section
    assert "<td>24–76 %</td>" in section and "<td>0–28 %</td>" in section
    assert "<td>v3 (withdrawn)</td>" in section and "<td>unknown</td>" in section


def test_a_broker_that_does_not_answer_is_a_note() -> None:
    nowhere = Settings(kafka={"bootstrap": "127.0.0.1:1"})  # nothing listens on port 1
    got = live_outcomes(nowhere, "p1", timeout_s=1.0)
    assert got.rows == [] and got.note is not None
    assert got.note.startswith("live outcomes unavailable (broker: ")
