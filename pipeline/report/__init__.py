"""``liverl report``: training read from the Delta lake, as a PNG, a text summary and an
HTML page. ``data`` reads and aggregates, ``png`` and ``html`` draw, ``command`` is the CLI."""

from pipeline.report.command import build_report, report
from pipeline.report.data import LakeData, Summary, load, summarize
from pipeline.report.html import build_page, render_html
from pipeline.report.png import PNG_SIZE, render

__all__ = [
    "PNG_SIZE",
    "LakeData",
    "Summary",
    "build_page",
    "build_report",
    "load",
    "render",
    "render_html",
    "report",
    "summarize",
]
