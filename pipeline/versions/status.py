"""Each policy's state for ``liverl status``: the version that serves by the folded weights log
(the gateways' rule: pinned? withdrawn versions?) and what its trainer is doing (the newest
``trainer_status`` event: training, judging vN with its ETA, paused while pinned). Pure
formatting over folded logs; :func:`policy_states` reads them. The command stays thin."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from pipeline import events

from .table import VersionLog


def _ago(ms: int | None, now_ms: int) -> str:
    if ms is None:
        return "never"
    s = max(0.0, (now_ms - ms) / 1000)
    if s < 120:
        return f"{s:.0f} s ago"
    if s < 7200:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.1f} h ago"


def _clock(ms: int) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ms / 1000)) + " UTC"


def _versions(vs: Iterable[int]) -> str:
    return ", ".join(f"v{v}" for v in sorted(vs))


def serving_line(log: VersionLog, require_promoted: bool) -> str:
    """Which version serves, and why (pin, rollback), by the gateways' own fold."""
    live = log.live(require_promoted)
    now = f"v{live}" if live is not None else "the base model"
    parts = [f"policy {log.policy_id}: {now} serves"]
    if log.pinned is not None:
        pin = next((a for a in reversed(log.actions) if a.kind == "pin"), None)
        by = f" by {pin.by}" if pin is not None else ""
        parts.append(f"pinned{by}")
    if log.withdrawn:
        parts.append(f"withdrawn {_versions(log.withdrawn)}")
    if log.manifests:
        newest = max(log.manifests)
        if newest != live:
            parts.append(f"newest v{newest} ({log.status.get(newest, 'candidate')})")
    if log.actions:
        a = log.actions[-1]
        parts.append(f"last action {a.kind} v{a.version} by {a.by}")
    return parts[0] + (" (" + "; ".join(parts[1:]) + ")" if parts[1:] else "")


def canary_line(
    log: VersionLog, require_promoted: bool, now_ms: int, figures: Mapping[str, Any] | None = None
) -> str | None:
    """The canary rollout's state: "canary vN at 10 % since …, waiting behind it: …", then
    each arm's sessions and outcome rate and the decider's probability (``figures``: what
    :meth:`Decider.evaluate` would decide now; None when not computed). None: no canary."""
    arm = log.canary(require_promoted)
    if arm is None:
        return None
    version, share = arm
    since = log.servable_since(version, require_promoted)
    waiting = [
        v
        for v in sorted(log.manifests)
        if v > version and log.servable(v, require_promoted) and log.pending(v, require_promoted)
    ]
    line = (
        f"  canary: v{version} at {share:.0%} of users since {_clock(since)} "
        f"({_ago(since, now_ms)})"
    )
    if waiting:
        line += f"; waiting behind it: {_versions(waiting)}"
    if figures:

        def arm_text(name: str) -> str:
            n, passed, rate = (
                figures.get(f"{name}_sessions"),
                figures.get(f"{name}_passed"),
                figures.get(f"{name}_rate"),
            )
            return f"{name} {passed}/{n}" + (f" ({rate:.0%})" if rate is not None else "")

        line += (
            f"; sessions with outcomes: {arm_text('canary')}, {arm_text('stable')}, "
            f"P(canary worse) {figures.get('p_worse', float('nan')):.2f}, "
            f"{figures.get('rule', '?')}"
        )
    return line


def canary_figures(
    connection: Any, log: VersionLog, cfg: Any, require_promoted: bool
) -> dict[str, Any] | None:
    """What the canary decider would decide now for ``log``'s canary (reads the samples
    topic: only called when there is a canary). None without a canary."""
    if log.canary(require_promoted) is None:
        return None
    from pipeline.kafka.reader import read_to_end

    from .runner import CanaryRunner

    runner = CanaryRunner(
        connection, cfg, policy_id=log.policy_id, require_promoted=require_promoted
    )
    for ev in log.events:  # the log shown, already read
        runner.decider.add_weights(ev)
    # the samples, folded by the decider's own reader
    read_to_end(connection, [runner.samples_topic], runner.handle, group_prefix="liverl-status-")
    step = runner.decider.evaluate()
    return dict(step.verdict.figures) if step.verdict is not None else None


def trainer_line(status: events.TrainerStatus | None, now_ms: int) -> str:
    """What the policy's trainer said last, and how long ago."""
    if status is None:
        return "  trainer: no status yet (liverl train sends it on liverl.trainer_status.v1)"
    heard = f"heard {_ago(status.ts_ms, now_ms)}"
    if status.state == "judging" and status.judging_version is not None:
        since = status.judging_since_ms or status.ts_ms
        progress = (
            f", prompt {status.prompts_done} of {status.prompts_total}"
            if status.prompts_total
            else ""
        )
        eta = f", ETA {status.eta_s:.0f} s" if status.eta_s is not None else ""
        return (
            f"  trainer: judging v{status.judging_version} since {_clock(since)} "
            f"({_ago(since, now_ms)}){progress}{eta}; on v{status.version}, step "
            f"{status.step} ({heard})"
        )
    if status.state == "paused":
        return (
            f"  trainer: paused while v{status.pinned_version} is pinned; on "
            f"v{status.version}, step {status.step} ({heard})"
        )
    if status.state == "stopped":
        return (
            f"  trainer: stopped at v{status.version}, step {status.step}, "
            f"{status.samples} samples trained ({heard})"
        )
    loss = f", loss {status.loss:.4f}" if status.loss is not None else ""
    return (
        f"  trainer: training on v{status.version}, step {status.step}, last step "
        f"{_ago(status.last_step_ms, now_ms)}{loss}, {status.samples} samples since start "
        f"({heard})"
    )


def policy_lines(
    log: VersionLog,
    status: events.TrainerStatus | None,
    *,
    require_promoted: bool,
    now_ms: int,
    canary: Mapping[str, Any] | None = None,
) -> list[str]:
    """One policy: what serves, the canary (``canary``: the decider's figures), the trainer,
    and the trainer's last word (the verdict or the operator action it followed)."""
    lines = [serving_line(log, require_promoted)]
    said = canary_line(log, require_promoted, now_ms, canary)
    if said is not None:
        lines.append(said)
    lines.append(trainer_line(status, now_ms))
    if status is not None and status.detail and status.state != "stopped":
        lines.append(f"    {status.detail}")
    return lines


def newest_by_policy(statuses: Iterable[events.TrainerStatus]) -> dict[str, events.TrainerStatus]:
    """policy -> its newest status in log order (the topic is compacted by policy)."""
    out: dict[str, events.TrainerStatus] = {}
    for s in statuses:
        out[s.policy_id] = s
    return out


def policy_states(
    connection: Any, *, require_promoted: bool, now_ms: int | None = None, canary_cfg: Any = None
) -> list[str]:
    """Every policy seen on the weights or trainer_status topics, folded and formatted
    (``canary_cfg``: the ``[canary]`` settings, to show a running canary's figures)."""
    from . import reading

    logs = reading.weights_logs(connection)
    trainers = newest_by_policy(reading.trainer_statuses(connection))
    now = events.now_ms() if now_ms is None else now_ms
    out: list[str] = []
    for policy in sorted(set(logs) | set(trainers)):
        log = logs.get(policy) or VersionLog(policy)
        figures = (
            canary_figures(connection, log, canary_cfg, require_promoted)
            if canary_cfg is not None
            else None
        )
        out += policy_lines(
            log, trainers.get(policy), require_promoted=require_promoted, now_ms=now, canary=figures
        )
    return out
