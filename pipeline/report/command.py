"""``liverl report``: one PNG and a short text summary of training, read from the Delta
lake, and an HTML page beside it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from pipeline.report.data import Summary, load, summarize, summary_lines
from pipeline.report.html import build_page, lag_reader, render_html
from pipeline.report.png import render


def build_report(
    lake: Path,
    out: Path,
    *,
    policy: str | None = None,
    since_version: int | None = None,
    default_policy: str | None = None,
) -> tuple[Summary, list[str]]:
    """Read the lake, write the PNG, return the summary and its text lines."""
    data = load(lake, policy, since_version, default_policy)
    summary = summarize(data)
    summary.size = render(data, summary, out)
    summary.out = out
    return summary, summary_lines(summary, data.missing, data.absent_tables)


@dataclass
class LiveOutcomes:
    """Per version, the live outcome rate since it served, read from the broker as
    ``liverl versions list`` reads it (pipeline/versions/reading.py, same rows)."""

    policy: str
    rows: list[dict[str, Any]]
    lines: list[str]
    note: str | None = None  # why there are none (the broker did not answer)


def live_outcomes(settings: Any, policy: str, timeout_s: float = 5.0) -> LiveOutcomes:
    """Never raises: a broker that does not answer within ``timeout_s`` is a note."""
    from pipeline.versions.outcomes import outcome_lines
    from pipeline.versions.reading import version_rows
    from pipeline.versions.rule import require_promoted

    try:
        _log, rows = version_rows(
            settings, policy, require_promoted=require_promoted(settings), timeout_s=timeout_s
        )
    except Exception as exc:  # noqa: BLE001 - the report is the lake's; the broker is extra
        return LiveOutcomes(policy, [], [], f"live outcomes unavailable (broker: {exc})")
    return LiveOutcomes(policy, rows, outcome_lines(rows))


# ---- command --------------------------------------------------------------------------------


@click.command("report")
@click.option(
    "--lake",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Lake folder holding the Delta tables (default: <state_dir>/lake).",
)
@click.option(
    "--policy",
    default=None,
    help="Policy to report (default: the only one in the lake, else [trainer] policy).",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("report.png"),
    show_default=True,
    help="PNG file to write.",
)
@click.option(
    "--html",
    "html_out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="HTML page to write (default: the PNG's path with .html); see --no-html.",
)
@click.option("--no-html", is_flag=True, help="Write only the PNG.")
@click.option(
    "--lag/--no-lag",
    default=True,
    show_default=True,
    help="Ask the broker for consumer lag for the HTML page (3 s timeout).",
)
@click.option(
    "--outcomes/--no-outcomes",
    default=True,
    show_default=True,
    help="Read the broker for each version's live outcome rate since it served (the "
    "samples' verified outcomes, Wilson 95 % interval; as liverl versions list).",
)
@click.option(
    "--since-version",
    type=click.IntRange(min=0),
    default=None,
    help="Only weight versions >= N (and the steps that published them).",
)
@click.pass_context
def report(
    ctx: click.Context,
    lake: Path | None,
    policy: str | None,
    out: Path,
    html_out: Path | None,
    no_html: bool,
    lag: bool,
    outcomes: bool,
    since_version: int | None,
) -> None:
    """Plot training from the Delta lake into one PNG and an HTML page; print a summary.

    PNG panels: mean reward of trained samples per weight version (with counts), losses by
    part, KL and clip fraction, and grad norm per optimizer step, share of samples by
    status per version, and weight versions with their promotion verdicts.

    The HTML page (self-contained, the PNG inline) adds reward over time by method and by
    judge, each weight version with when it was published and first served, trained
    samples per minute, and consumer lag per group. Judges and serving times come from the
    archive (`liverl archive`); without it the page says what is missing.
    """
    from pipeline.lake.commands import trainer_paths

    paths = trainer_paths(ctx)
    default_policy = paths.policy
    lake = lake if lake is not None else Path(paths.lake_root)
    summary, lines = build_report(
        lake,
        out,
        policy=policy,
        since_version=since_version,
        default_policy=default_policy,
    )
    for line in lines:
        click.echo(line)
    settings = (ctx.find_root().obj or {}).get("settings")
    if (lag or outcomes) and settings is None:
        from pipeline.settings import Settings

        settings = Settings()
    live = live_outcomes(settings, summary.policy or default_policy) if outcomes else None
    if live is not None:
        click.echo(
            f"live outcome per version ({live.policy}; sessions it answered with a "
            "verified outcome, Wilson 95 % interval):"
        )
        for line in live.lines or [live.note or "no version published yet"]:
            click.echo(f"  {line}")
    if no_html:
        return
    page = build_page(lake, summary.policy, lag=lag_reader(settings) if lag else None)
    if live is not None:
        page.live_outcomes = live.rows
        if live.note:
            page.notes.append(live.note)
    for j in page.judges:
        click.echo(
            f"judge {j['judge_id']} ({j['judge_version']}): consistency "
            f"{j['consistency']:.3f} ({j['agree']} agree, {j['disagree']} disagree, "
            f"{j['abstain']} abstain)" + (f", flagged {j['flags']}x" if j["flags"] else "")
        )
    target = render_html(page, html_out or out.with_suffix(".html"), png=out)
    click.echo(f"html: {target}")


if __name__ == "__main__":  # pragma: no cover
    report()
