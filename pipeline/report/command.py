"""``liverl report``: one PNG and a short text summary of training, read from the Delta
lake, and an HTML page beside it."""

from __future__ import annotations

from pathlib import Path

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
    if no_html:
        return
    settings = (ctx.find_root().obj or {}).get("settings")
    if lag and settings is None:
        from pipeline.settings import Settings

        settings = Settings()
    page = build_page(lake, summary.policy, lag=lag_reader(settings) if lag else None)
    for j in page.judges:
        click.echo(f"judge {j['judge_id']} ({j['judge_version']}): consistency "
                   f"{j['consistency']:.3f} ({j['agree']} agree, {j['disagree']} disagree, "
                   f"{j['abstain']} abstain)" + (f", flagged {j['flags']}x" if j["flags"] else ""))
    target = render_html(page, html_out or out.with_suffix(".html"), png=out)
    click.echo(f"html: {target}")


if __name__ == "__main__":  # pragma: no cover
    report()
