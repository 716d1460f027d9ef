"""The HTML page ``liverl report`` writes next to its PNG.

The PNG answers "is training healthy"; the page answers the operator's questions that need
time on the x axis or a join across tables: how reward moved over time for each training
method and each judge, when each weight version was published and when a gateway started
serving it, how many samples per minute were trained, and how far behind each consumer
group is right now.

Sources, each optional except ``trajectories`` (a missing one becomes a note on the page,
never an error): the trainer's Delta tables (``trajectories``, ``gradient_steps``,
``weights``); the archive's ``events/prm_scores`` and ``events/serving_status`` tables
(``liverl archive``) for the judge of each turn and the time each version went live; the
broker, for consumer lag at report time. The page is one self-contained file (the PNG and
charts inline), rendered with an autoescaping Jinja2 template.
"""

from __future__ import annotations

import base64
import datetime as dt
import io
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.errors import ReportError
from pipeline.lake import tables as T
from pipeline.report.data import final_verdicts, read_columns

TRAJ_COLUMNS = ["policy_id", "session_id", "turn", "reward", "status", "step", "ts_ms"]
STEP_COLUMNS = ["policy_id", "step", "method", "samples", "ts_ms"]
WEIGHT_COLUMNS = ["policy_id", "version", "step", "status", "ts_ms"]
# Points on a reward-over-time line: trained samples are averaged in this many time buckets.
TIME_BUCKETS = 24


@dataclass
class VersionRow:
    version: int
    step: int | None
    published_ms: int | None
    verdict: str
    live_ms: int | None  # first serving_status ok=true for it (None: not seen / no archive)

    @property
    def live_after_s(self) -> float | None:
        if self.live_ms is None or self.published_ms is None:
            return None
        return (self.live_ms - self.published_ms) / 1000


@dataclass
class Series:
    """Mean reward of trained samples per time bucket, for one method or judge."""

    label: str
    x_ms: list[int]
    mean: list[float]
    n: list[int]


@dataclass
class Page:
    policy: str | None
    lake: Path
    generated_ms: int
    by_method: list[Series]
    by_judge: list[Series]
    versions: list[VersionRow]
    per_minute: list[tuple[int, int]]  # (minute start ms, trained samples)
    samples_per_s: float | None
    lag: list[dict[str, Any]] | None
    notes: list[str] = field(default_factory=list)
    judges: list[dict[str, Any]] = field(default_factory=list)  # judge_consistency(...)
    # pipeline.versions rows (liverl versions list's): the live outcome rate per version
    live_outcomes: list[dict[str, Any]] | None = None


# ---- reading --------------------------------------------------------------------------------


def _read(lake: Path, name: str, columns: list[str], policy: str | None) -> pa.Table | None:

    table, _missing = read_columns(T.LakeTables(lake).uri(name), name, columns)
    if table is not None and policy is not None:
        table = table.filter(pc.equal(table.column("policy_id"), policy))
    return table


def _archived(lake: Path, topic: str) -> list[dict[str, Any]] | None:
    """Decoded payloads of an archived topic (None: not archived)."""
    from deltalake import DeltaTable

    from pipeline.lake.reading import dataset

    uri = str(lake / "events" / topic)
    if not DeltaTable.is_deltatable(uri):
        return None
    payloads = dataset(uri).to_table(columns=["payload"]).column("payload")
    out = []
    for raw in payloads.to_pylist():
        try:
            value = orjson.loads(raw)
        except (orjson.JSONDecodeError, TypeError):
            continue  # a dead letter or garbage archived byte-exact: not an event
        if isinstance(value, dict):
            out.append(value)
    return out


# ---- aggregation ----------------------------------------------------------------------------


def reward_series(
    trained: pa.Table, label_of: Callable[[dict[str, Any]], str | None], buckets: int
) -> list[Series]:
    """Per label, mean reward of the rows in each of ``buckets`` equal time slices."""
    rows = trained.to_pylist()
    stamps = [r["ts_ms"] for r in rows if r["ts_ms"] is not None]
    if not stamps:
        return []
    first, last = min(stamps), max(stamps)
    width = max(1, math.ceil((last - first + 1) / buckets))
    sums: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        label = label_of(r)
        if label is None or r["ts_ms"] is None or r["reward"] is None:
            continue
        sums[label][(r["ts_ms"] - first) // width].append(r["reward"])
    series = []
    for label in sorted(sums):
        idx = sorted(sums[label])
        series.append(
            Series(
                label=label,
                x_ms=[first + i * width + width // 2 for i in idx],
                mean=[sum(sums[label][i]) / len(sums[label][i]) for i in idx],
                n=[len(sums[label][i]) for i in idx],
            )
        )
    return series


def judge_consistency(matches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (judge, version) its latest tally (the match with the most verdicts matched,
    contradicted ones included, then the most contradicted: a contradiction that takes a
    match back comes after it) and how often it was flagged, from archived
    ``judge_consistency`` events."""
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    flags: dict[tuple[str, str], int] = {}
    seen: set[str] = set()
    for m in matches:
        if m.get("type") != "judge_consistency" or m.get("event_id") in seen:
            continue
        seen.add(str(m.get("event_id")))
        key = (str(m["judge_id"]), str(m["judge_version"]))
        c = int(m.get("contradictions") or 0)
        n = int(m["agree"]) + int(m["disagree"]) + int(m["abstain"])
        old = latest.get(key)
        if old is None or (n + c, c) > (old["n"] + old["contradicted"], old["contradicted"]):
            latest[key] = {
                "judge_id": key[0],
                "judge_version": key[1],
                "n": n,
                "contradicted": c,
                "agree": m["agree"],
                "disagree": m["disagree"],
                "abstain": m["abstain"],
                "consistency": m["consistency"],
            }
        flags[key] = flags.get(key, 0) + bool(m.get("flagged"))
    return [{**row, "flags": flags[k]} for k, row in sorted(latest.items())]


def version_rows(weights: pa.Table, live: dict[int, int]) -> list[VersionRow]:

    verdicts = final_verdicts(weights)
    published: dict[int, tuple[int | None, int | None]] = {}
    for r in weights.to_pylist():
        if r["version"] is None:
            continue
        if r["status"] in (None, "candidate") or r["version"] not in published:
            old = published.get(r["version"])
            if old is None or (r["ts_ms"] is not None and (old[1] is None or r["ts_ms"] < old[1])):
                published[r["version"]] = (r["step"], r["ts_ms"])
    return [
        VersionRow(v, published[v][0], published[v][1], verdicts.get(v, "candidate"), live.get(v))
        for v in sorted(published)
    ]


def went_live(statuses: list[dict[str, Any]], policy: str | None) -> dict[int, int]:
    """Per version, the earliest time a gateway reported serving it (``ok`` reloads)."""
    live: dict[int, int] = {}
    for s in statuses:
        if not s.get("ok") or (policy is not None and s.get("policy_id") != policy):
            continue
        v, ts = s.get("version"), s.get("ts_ms")
        if isinstance(v, int) and isinstance(ts, int) and (v not in live or ts < live[v]):
            live[v] = ts
    return live


def per_minute(trained: pa.Table) -> list[tuple[int, int]]:
    counts: dict[int, int] = defaultdict(int)
    for ts in trained.column("ts_ms").to_pylist():
        if ts is not None:
            counts[ts - ts % 60_000] += 1
    if not counts:
        return []
    first, last = min(counts), max(counts)
    return [(m, counts.get(m, 0)) for m in range(first, last + 1, 60_000)]


def build_page(
    lake: Path,
    policy: str | None,
    *,
    lag: Callable[[], list[dict[str, Any]]] | None = None,
    buckets: int = TIME_BUCKETS,
) -> Page:
    """Everything the page shows; ``lag`` reads consumer lag (None: no broker to ask)."""
    notes: list[str] = []
    traj = _read(lake, T.TRAJECTORIES, TRAJ_COLUMNS, policy)
    if traj is None:
        raise ReportError(f"no trajectories yet at {lake}")
    steps = _read(lake, T.GRADIENT_STEPS, STEP_COLUMNS, policy)
    weights = _read(lake, T.WEIGHTS, WEIGHT_COLUMNS, policy)
    trained = traj.filter(
        pc.and_(
            pc.equal(pc.fill_null(traj.column("status"), "trained"), "trained"),
            pc.is_valid(traj.column("reward")),
        )
    )

    method_of_step: dict[int, str] = {}
    if steps is not None:
        for s in steps.to_pylist():
            if s["step"] is not None and s["method"]:
                method_of_step[s["step"]] = s["method"]
    else:
        notes.append("no gradient_steps table: rewards by method are unavailable")
    by_method = reward_series(trained, lambda r: method_of_step.get(r["step"]), buckets)

    scores = _archived(lake, "prm_scores")
    by_judge: list[Series] = []
    if scores is None:
        notes.append(
            "no archive of prm_scores (run `liverl archive`): rewards by judge are unavailable"
        )
    else:
        judge_of = {(s.get("session_id"), s.get("turn")): s.get("judge_id") for s in scores}
        by_judge = reward_series(
            trained, lambda r: judge_of.get((r["session_id"], r["turn"])), buckets
        )

    matches = _archived(lake, "judge_consistency")
    if matches is None:
        notes.append(
            "no archive of judge_consistency (run `liverl judges watch` and "
            "`liverl archive`): judges are not checked against outcomes"
        )
    judges = judge_consistency(matches or [])

    statuses = _archived(lake, "serving_status")
    if statuses is None:
        notes.append(
            "no archive of serving_status (run `liverl archive`): when each "
            "version went live is unknown"
        )
    live = went_live(statuses or [], policy)
    versions = version_rows(weights, live) if weights is not None else []

    minutes = per_minute(trained)
    stamps = [t for t in trained.column("ts_ms").to_pylist() if t is not None]
    rate = None
    if len(stamps) > 1 and max(stamps) > min(stamps):
        rate = len(stamps) / ((max(stamps) - min(stamps)) / 1000)

    lag_rows = None
    if lag is not None:
        try:
            lag_rows = lag()
        except Exception as exc:  # noqa: BLE001 - any broker failure is a note, not a crash
            notes.append(f"consumer lag unavailable: {exc}")
    return Page(
        policy,
        lake,
        int(dt.datetime.now(dt.UTC).timestamp() * 1000),
        by_method,
        by_judge,
        versions,
        minutes,
        rate,
        lag_rows,
        notes,
        judges,
    )


# ---- rendering ------------------------------------------------------------------------------


def _svg_lines(series: list[Series], ylabel: str) -> str:
    """A small inline SVG line chart (matplotlib Agg, no global state)."""
    from matplotlib.dates import DateFormatter
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3))
    ax = fig.subplots()
    for s in series:
        xs = [dt.datetime.fromtimestamp(x / 1000, dt.UTC) for x in s.x_ms]
        # matplotlib's types want numbers or arrays for x; its date converter takes datetimes.
        ax.plot(xs, s.mean, marker="o", markersize=3, label=f"{s.label} (n={sum(s.n)})")  # type: ignore[arg-type]
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_formatter(DateFormatter("%H:%M"))
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    svg = buf.getvalue()
    return svg[svg.index("<svg") :]


def _svg_bars(minutes: list[tuple[int, int]]) -> str:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 2.5))
    ax = fig.subplots()
    xs = [dt.datetime.fromtimestamp(m / 1000, dt.UTC) for m, _ in minutes]
    # datetimes for x, as in _svg_lines
    ax.bar(xs, [n for _, n in minutes], width=1 / 24 / 60 * 0.9, color="#2ca02c")  # type: ignore[arg-type]
    ax.set_ylabel("trained samples / min")
    ax.grid(alpha=0.3, axis="y")
    fig.autofmt_xdate()
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    svg = buf.getvalue()
    return svg[svg.index("<svg") :]


def _utc(ms: int | None) -> str:
    if ms is None:
        return "–"
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>liverl report: {{ page.policy or "all policies" }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border-bottom: 1px solid #ddd; padding: 4px 10px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.note { color: #8a5a00; } .muted { color: #777; }
.promoted { color: #2ca02c; } .rejected { color: #d62728; }
svg { max-width: 100%; height: auto; }
</style></head><body>
<h1>liverl report: {{ page.policy or "all policies" }}</h1>
<p class="muted">lake {{ page.lake }} · generated {{ utc(page.generated_ms) }} UTC</p>
{% for note in page.notes %}<p class="note">{{ note }}</p>{% endfor %}
{% if png %}<img alt="training panels" style="max-width:100%"
 src="data:image/png;base64,{{ png }}">{% endif %}

{% macro legend(series, what) %}<table><tr><th>{{ what }}</th><th>trained samples</th>
<th>mean reward, first bucket</th><th>mean reward, last bucket</th></tr>
{% for s in series %}<tr><td>{{ s.label }}</td><td>{{ s.n | sum }}</td>
<td>{{ "%.3f" % s.mean[0] }}</td><td>{{ "%.3f" % s.mean[-1] }}</td></tr>
{% endfor %}</table>{% endmacro %}
<h2>Reward over time by method</h2>
{% if page.by_method %}{{ method_svg | safe }}{{ legend(page.by_method, "method") }}
{% else %}<p class="muted">no trained samples with a known method yet</p>{% endif %}

<h2>Reward over time by judge</h2>
{% if page.by_judge %}{{ judge_svg | safe }}{{ legend(page.by_judge, "judge") }}
{% else %}<p class="muted">no trained samples with a known judge yet</p>{% endif %}

<h2>Judge consistency (verdicts checked against outcomes)</h2>
{% if page.judges %}<table><tr><th>judge</th><th>version</th><th>agree</th><th>disagree</th>
<th>abstain</th><th>consistency</th><th>flagged</th></tr>
{% for j in page.judges %}<tr><td>{{ j.judge_id }}</td><td>{{ j.judge_version }}</td>
<td>{{ j.agree }}</td><td>{{ j.disagree }}</td><td>{{ j.abstain }}</td>
<td>{{ "%.3f" % j.consistency }}</td><td class="{{ "rejected" if j.flags else "" }}">{{
 j.flags }}</td></tr>
{% endfor %}</table>{% else %}<p class="muted">no verdict has met an outcome yet</p>{% endif %}

<h2>Weight versions</h2>
{% if page.versions %}<table>
<tr><th>version</th><th>step</th><th>published (UTC)</th><th>verdict</th>
<th>first served (UTC)</th><th>publish → served</th></tr>
{% for v in page.versions %}<tr><td>v{{ v.version }}</td><td>{{ v.step if v.step is not none
 else "–" }}</td><td>{{ utc(v.published_ms) }}</td><td class="{{ v.verdict }}">{{ v.verdict
 }}</td><td>{{ utc(v.live_ms) }}</td><td>{{ "%.2f s" % v.live_after_s
 if v.live_after_s is not none else "–" }}</td></tr>
{% endfor %}</table>{% else %}<p class="muted">no weight versions yet</p>{% endif %}

<h2>Live outcome per version</h2>
{% if page.live_outcomes is none %}<p class="muted">not read (--no-outcomes)</p>
{% elif not page.live_outcomes %}<p class="muted">no version on the weights topic</p>
{% else %}<p class="muted">sessions each version answered that have a verified outcome
(a gate, a test run, feedback), each once, with the Wilson 95 % interval</p>
<table><tr><th>version</th><th>status</th><th>served since (UTC)</th><th>until</th>
<th>passed / sessions</th><th>rate</th><th>95 % interval</th></tr>
{% for r in page.live_outcomes %}{% set o = r.outcomes %}<tr><td>v{{ r.version }}{{
 " (live)" if r.live else "" }}{{ " (pinned)" if r.pinned else "" }}{{ " (withdrawn)"
 if r.withdrawn else "" }}</td><td class="{{ r.status }}">{{ r.status }}</td><td>{{
 utc(r.served_since_ms) }}</td><td>{{ utc(r.served_until_ms) if r.served_since_ms is not none
 else "–" }}</td>{% if o %}<td>{{ o.passed }} / {{ o.total }}</td><td>{{ "%.0f %%" % (100 *
 o.rate) }}</td><td>{{ "%.0f–%.0f %%" % (100 * o.ci95[0], 100 * o.ci95[1]) }}</td>{% else
 %}<td>–</td><td>unknown</td><td>–</td>{% endif %}</tr>
{% endfor %}</table>{% endif %}

<h2>Throughput</h2>
{% if page.per_minute %}<p>{{ page.per_minute | sum(attribute=1) }} trained samples{% if
 page.samples_per_s %}, {{ "%.2f" % page.samples_per_s }} samples/s from first to last{% endif
 %}.</p>{{ bars_svg | safe }}{% else %}<p class="muted">no trained samples yet</p>{% endif %}

<h2>Consumer lag (at report time)</h2>
{% if page.lag is none %}<p class="muted">not read (no broker)</p>
{% elif not page.lag %}<p class="muted">no consumer groups</p>
{% else %}<table><tr><th>group</th><th>state</th><th>lag</th><th>by topic</th></tr>
{% for g in page.lag %}<tr><td>{{ g.group }}</td><td>{{ g.state }}</td><td>{{ g.lag }}</td>
<td>{% for t, n in g.by_topic.items() %}{{ t }}: {{ n }}{% if not loop.last %}, {% endif
 %}{% endfor %}</td></tr>
{% endfor %}</table>{% endif %}
</body></html>
"""


def render_html(page: Page, out: Path, png: Path | None = None) -> Path:
    import jinja2

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    html = env.from_string(TEMPLATE).render(
        page=page,
        utc=_utc,
        png=base64.b64encode(png.read_bytes()).decode() if png and png.exists() else None,
        method_svg=_svg_lines(page.by_method, "mean reward") if page.by_method else "",
        judge_svg=_svg_lines(page.by_judge, "mean reward") if page.by_judge else "",
        bars_svg=_svg_bars(page.per_minute) if page.per_minute else "",
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    return out


def lag_reader(settings: Any, timeout: float = 3.0) -> Callable[[], list[dict[str, Any]]]:
    """Consumer lag from the broker in ``settings``, as plain rows for the page."""

    def read() -> list[dict[str, Any]]:
        from pipeline.kafka.inspect import consumer_lag

        return [
            {"group": g.group, "state": g.state, "lag": g.lag, "by_topic": g.by_topic}
            for g in consumer_lag(settings, timeout=timeout)
        ]

    return read
