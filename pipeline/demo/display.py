"""Live terminal view of a demo: sessions, moving satisfied share, live version, freshness,
and the capability probe before and after (a preference won by breaking answers shows).

A rich ``Live`` panel on a terminal; plain progress lines otherwise (logs, CI).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pipeline.demo.runner import Capability, DemoConfig, Evaluation, Session, moving_share

BARS = " ▁▂▃▄▅▆▇█"


def describe_capability(cap: Capability) -> str:
    """``v0: 17/20 correct (greedy), fluency -1.42`` (fluency: mean log-prob per token of
    sampled answers under the base model; nearer 0 is more fluent)."""
    r = cap.result
    flu = f"fluency {r.fluency:.2f}" if r.fluency is not None else "fluency n/a"
    return f"v{cap.version}: {r.correct}/{r.n} correct (greedy), {flu} (sampled, base-scored)"


def sparkline(values: list[float], width: int = 48) -> str:
    values = values[-width:]
    return "".join(BARS[min(len(BARS) - 1, int(v * (len(BARS) - 1) + 0.5))] for v in values)


@dataclass(eq=False)
class Display:
    """Receives the runner's progress callbacks and renders them."""

    cfg: DemoConfig
    policy: str
    console: Console = field(default_factory=Console)
    sessions: list[Session] = field(default_factory=list, init=False, repr=False)
    version: int | None = field(default=None, init=False)
    evals: dict[str, Evaluation] = field(default_factory=dict, init=False, repr=False)
    capabilities: dict[str, Capability] = field(default_factory=dict, init=False, repr=False)
    stage: str = field(default="starting", init=False)
    started: float = field(default_factory=time.monotonic, init=False)
    live: Live | None = field(default=None, init=False, repr=False)

    def __enter__(self) -> Display:
        if self.console.is_terminal:
            self.live = Live(self.render(), console=self.console, refresh_per_second=4)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.update(self.render())
            self.live.__exit__(None, None, None)

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "session":
            self.sessions.append(data["session"])
            self.stage = f"training round {data['session'].round + 1}/{self.cfg.rounds}"
        elif kind == "version":
            self.version = max(self.version or 0, data["version"])
        elif kind == "eval":
            self.evals[data["label"]] = data["eval"]
            ev = data["eval"]
            self._line(
                f"held-out {data['label']}: v{ev.version} {ev.satisfied:.0%} satisfied, "
                f"{ev.meets_preference:.0%} meet the preference, "
                f"{ev.quality_ok:.0%} answer the question (n={ev.n})"
            )
        elif kind == "capability":
            self.capabilities[data["label"]] = data["capability"]
            self._line(
                f"capability probe {data['label']}: {describe_capability(data['capability'])}"
            )
        elif kind == "note":
            self._line(data["text"])
        elif kind == "pace":
            self.stage = f"users wait for v{data['waiting_for']} (trained on their replies)"
        elif kind == "settle":
            self.stage = f"waiting for the last sessions to train ({data['trained']}/{data['of']})"
        if self.live is not None:
            self.live.update(self.render())
        elif kind == "session" and len(self.sessions) % self.cfg.users == 0:
            self._line(self._status())

    def _line(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def _status(self) -> str:
        flags = [s.satisfied for s in self.sessions]
        share = moving_share(flags, self.cfg.window)[-1] if flags else 0.0
        return (
            f"[{time.monotonic() - self.started:6.0f}s] sessions {len(self.sessions):3d}  "
            f"satisfied (last {self.cfg.window}) {share:4.0%}  live v{self.version or 0}"
        )

    def render(self) -> Group:
        flags = [s.satisfied for s in self.sessions]
        moving = moving_share(flags, self.cfg.window)
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        table.add_row(
            "policy",
            f"{self.policy} ({self.cfg.method}, preference "
            f"'{self.cfg.preference}', hint rate {self.cfg.hint_rate:g})",
        )
        table.add_row("stage", self.stage)
        table.add_row("elapsed", f"{time.monotonic() - self.started:.0f} s")
        table.add_row("sessions", str(len(self.sessions)))
        table.add_row("live weights", f"v{self.version or 0}")
        table.add_row(f"satisfied (last {self.cfg.window})", f"{moving[-1]:.0%}" if moving else "-")
        table.add_row("curve", sparkline(moving) or "-")
        for label, ev in self.evals.items():
            table.add_row(
                f"held-out {label}",
                f"v{ev.version}: {ev.satisfied:.0%} satisfied, {ev.quality_ok:.0%} on topic",
            )
        for label, cap in self.capabilities.items():
            table.add_row(f"probe {label}", describe_capability(cap))
        last = self.sessions[-1] if self.sessions else None
        tail = Text("")
        if last is not None:
            mark = "✓" if last.satisfied else "✗"
            tail = Text(
                f"{mark} Q: {last.question}\n  A: {last.answer[:160]!r}\n  user: {last.reply}",
                style="dim",
            )
        return Group(table, tail)
