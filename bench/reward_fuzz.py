"""Reward fuzzing (issue 38, item 3): hypothesis searches raw sessions, not abstract specs.

A generated session is real events: chat turns whose tool calls run shell commands from a
vocabulary that includes the known farming tricks (``echo pytest``, ``pytest && git commit -m
x``, ``python stepN.py`` failing then passing, ``pytest -k caseN`` failing again and again,
``git push --force``, read-only commands, failures reported without an exit code), exit codes
0/1/2/124/126/127 or none, GUI screens posted through the real gui source (repeated no-ops
included), thumbs through the real feedback builder, the harness hooks through the real hook
handlers, quality gates through ``outcomes.gate_event``, and a judge that raises, returns an
errored verdict or a vote out of range, says 0, or never answers. Each session is driven
through the real :class:`SessionStage` (pairing, path rules of ``DEFAULT_RULES``, inline
judging, assembly) as ``session_agent.py`` drives it, grouped sessions are z-scored by
``grouping.normalize``, and the advantages come from the trainer's own ``_prepare`` with its
per-row baselines, as ``tests/test_processors_rewards_properties.py`` takes them.

:func:`check` asserts, per generated set of sessions:

- ``bound``: the session's shaping terms F telescope within [phi_min, phi_max] after every
  evaluation (penalties.py), and the path parts its rewards carry sum within beta times that;
- ``shaping_alone``: a turn without a real signal (no verdict other than 0 or errored, no
  verified outcome) has no path part and is what it is without any rule (same reward, masks);
  a session without any real signal has no positive reward;
- ``failed``: a session whose outcome failed has no positive reward, nor a positive advantage
  in any batch composition (whole batch, its own samples, random sub-batches; both
  ``rl_baseline`` settings);
- ``finite``: every reward, baseline, advantage and loss is finite;
- ``outcome``: every sample carries the outcome the gates say (all must pass).

The test (``tests/test_processors_session_fuzz.py``) runs it with bounded examples; here it
runs for a budget::

    .venv/bin/python bench/reward_fuzz.py --budget-s 600
    .venv/bin/python bench/reward_fuzz.py --examples 2000 --seed 7

It prints the examples tried, how often each invariant was checked on a case that exercises
it, and any counter-example (minimised by hypothesis; shrinking may run minutes past the
budget). Figures only, no timed assertions. It imports the installed ``pipeline``: from
another worktree, put that one first (``PYTHONPATH=.``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from pipeline.events import Interaction, NextState, PathPenalty, PrmScore, Producer, Reward, Sample
from pipeline.processors import grouping, judging
from pipeline.processors.config import DEFAULT_RULES
from pipeline.processors.judges import RuleJudge, TurnContext, Verdict
from pipeline.processors.outcomes import GateResult, gate_event, outcome_event
from pipeline.processors.pairing import Pairer
from pipeline.processors.penalties import RuleSet, load_rules
from pipeline.processors.rewards import Assembler, is_no_verdict, token_payload
from pipeline.processors.session import SessionStage, SessionState, Step
from pipeline.serving.feedback import FeedbackRequest, feedback_event
from pipeline.serving.gui_source import GuiSource
from pipeline.serving.hooks import HookPayload, before_submit_prompt, stop
from pipeline.serving.sources import GuiOptions, SourceRequest
from pipeline.trainer import losses as L

T0 = 1_790_000_000_000
IDLE_MS = 60_000  # the session agent's idle timeout here
TOL = 1e-9  # each F is rounded to 1e-10 (penalties.PathResult)
GATEWAY = Producer(component="gateway", version="fuzz")
DEFAULT = load_rules(DEFAULT_RULES)
NO_RULES = RuleSet.from_dict({"version": "no-rules", "beta": DEFAULT.beta})
HOOK_STOP_SCORES = {"error": -1.0, "aborted": -1.0}  # serving settings' default

# ---- the session spec ----------------------------------------------------------------------

COMMANDS = (
    "echo pytest", "pytest && git commit -m x", "git commit -m x", "pytest", "pytest -x",
    "pytest -k case1", "pytest -k case2", "python step1.py", "python step2.py", "make test",
    "cd src && pytest", "git push --force", "git push --force-with-lease", "git stash",
    "rm -rf /", "ls", "cat README.md", "git status", "grep -rn foo .", "pytest | tee log",
    "edit_file",  # no shell command: a tool call whose arguments are a path
)  # fmt: skip
CODES: tuple[int | None, ...] = (0, 0, 1, 2, 124, 126, 127, None)
TEXTS = ("ok", "Traceback (most recent call last):\n  AssertionError", "error: no such file")
REPLIES = ("thanks, that works", "still broken", "ok", "try again", "what about the docs?")
JUDGE_MODES = ("rules", "rules", "rules", "raise", "error", "bad", "zero", "never")
ACTIONS = ("click:settings-link:", "click:search:", "type:search:settings", "key::Enter")
GOAL = "open the settings page"
_BASE = [{"id": "settings-link", "role": "link", "name": "Settings"},
         {"id": "search", "role": "textbox", "name": "Search"}]  # fmt: skip
SCREENS: dict[str, dict[str, Any]] = {
    "home": {"role": "window", "name": "App", "children": _BASE},
    "settings": {"role": "window", "name": "App",
                 "children": [*_BASE, {"role": "heading", "name": "Settings page"}]},
    "typed": {"role": "window", "name": "App", "children": [
        _BASE[0], {**_BASE[1], "value": "settings", "focused": True}]},
    "error": {"role": "window", "name": "App",
              "children": [*_BASE, {"role": "alert", "name": "Error: denied"}]},
}  # fmt: skip
STOP_STATUSES = ("completed", "error", "aborted")


@dataclass(frozen=True)
class Call:
    """A tool call and the result the next turn reveals: an exit code, or (``code`` None)
    the text ``text`` without one."""

    cmd: str
    code: int | None = 0
    text: str = "ok"


@dataclass(frozen=True)
class Extra:
    """A next state someone else posts for the turn: a GUI screen after an action (``a``
    the action key, ``b`` the screen), thumbs (``a`` up/down, ``b`` the caller's key) or the
    beforeSubmitPrompt hook (``a`` the prompt)."""

    kind: Literal["gui", "thumbs", "prompt"]
    a: str
    b: str = ""


@dataclass(frozen=True)
class TurnSpec:
    """One turn: the user message that opens it (None: only the previous turn's tool results
    come back), the answer's tool calls, what is posted for it, and how the judge behaves on
    its next states."""

    calls: tuple[Call, ...] = ()
    user: str | None = None
    extras: tuple[Extra, ...] = ()
    judge: str = "rules"


@dataclass(frozen=True)
class Gate:
    """A session outcome delivered before interaction ``at``: a gate command's exit code, or
    (``command`` "said") a person's pass (0) / fail (1)."""

    command: str
    code: int
    at: int = 0


@dataclass(frozen=True)
class SessionSpec:
    turns: tuple[TurnSpec, ...]
    gates: tuple[Gate, ...] = ()
    group: str | None = None
    end: Literal["done", "idle"] = "done"  # session_done on the last turn, or the idle timeout
    stop: str | None = None  # the stop hook's status, posted after the last turn


def expected_outcome(spec: SessionSpec) -> float | None:
    """What the gates say, computed here apart from the pipeline: each check's latest result
    (124/126/127 are none), all must pass: -1 when any failed, +1 when all passed."""
    latest: dict[str, float] = {}
    for g in sorted(spec.gates, key=lambda g: g.at):  # delivery order (stable within `at`)
        if g.command != "said" and g.code in (124, 126, 127):
            continue
        latest[g.command] = 1.0 if g.code == 0 else -1.0
    return min(latest.values()) if latest else None


# ---- strategies ----------------------------------------------------------------------------

CALL = st.builds(Call, st.sampled_from(COMMANDS), st.sampled_from(CODES), st.sampled_from(TEXTS))
EXTRA = st.one_of(
    st.builds(Extra, st.just("gui"), st.sampled_from(ACTIONS), st.sampled_from(list(SCREENS))),
    st.builds(Extra, st.just("thumbs"), st.sampled_from(["up", "down"]),
              st.sampled_from(["k1", "k2"])),
    st.builds(Extra, st.just("prompt"), st.sampled_from(REPLIES)),
)  # fmt: skip
MODE = st.sampled_from(JUDGE_MODES)
RANDOM_TURN = st.builds(
    TurnSpec, calls=st.lists(CALL, max_size=3).map(tuple),
    user=st.sampled_from([None, None, *REPLIES]), extras=st.lists(EXTRA, max_size=3).map(tuple),
    judge=MODE,
).map(lambda t: (t,))  # fmt: skip


def trick(name: str, n: int, mode: str, code: int | None) -> tuple[TurnSpec, ...]:
    """A farming trick as ``n`` turns or so (``code``: the exit code where the trick varies
    it). A session ends with a turn without calls, which brings the last results back."""
    if name == "echo_pytest":  # read-only: never a passing test run
        return tuple(TurnSpec((Call("echo pytest", 0),), judge=mode) for _ in range(n))
    if name == "test_and_commit":  # progress facts: once, not per repeat
        return tuple(TurnSpec((Call("pytest && git commit -m x", code),), judge=mode)
                     for _ in range(n))  # fmt: skip
    if name == "steps":  # python stepN.py failing, then passing: each N its own intent
        return tuple(TurnSpec((Call(f"python step{k}.py", 1), Call(f"python step{k}.py", 0)),
                              judge=mode) for k in range(n))  # fmt: skip
    if name == "cases":  # pytest -k caseN failing: one intent (pytest), penalised past 2
        return tuple(TurnSpec((Call(f"pytest -k case{k}", code if code else 1),), judge=mode)
                     for k in range(n))  # fmt: skip
    if name == "force_push":  # forbidden, then the compliant alternative (a refund)
        return (TurnSpec((Call("git push --force", 0),), judge=mode),
                *(TurnSpec((Call("git push --force-with-lease", code),), judge=mode)
                  for _ in range(n)))  # fmt: skip
    if name == "traceback":  # failures without an exit code (the judge sees no outcome)
        return (*(TurnSpec((Call("pytest", None, TEXTS[1]),), judge=mode) for _ in range(n)),
                TurnSpec((Call("pytest", 0),), judge="rules"))  # fmt: skip
    if name == "gui_noop":  # the same action changing nothing, again and again
        return (TurnSpec(extras=(Extra("gui", ACTIONS[0], "home"),)
                         + (Extra("gui", ACTIONS[0], "home"),) * n, judge=mode),)  # fmt: skip
    assert name == "read_only"
    return tuple(TurnSpec((Call("ls", 0), Call("git status", 0), Call("grep -rn foo .", 1)),
                          judge=mode) for _ in range(n))  # fmt: skip


TRICKS = ("echo_pytest", "test_and_commit", "steps", "cases", "force_push", "traceback",
          "gui_noop", "read_only")  # fmt: skip
TRICK = st.builds(trick, st.sampled_from(TRICKS), st.integers(1, 3), MODE,
                  st.sampled_from(CODES))  # fmt: skip


@st.composite
def sessions(draw: st.DrawFn) -> SessionSpec:
    """Turns from random turns and tricks (at most 11, the last one without calls so that
    every call's result comes back), gates at any point before the close."""
    turns: list[TurnSpec] = []
    for segment in draw(st.lists(st.one_of(RANDOM_TURN, TRICK), min_size=1, max_size=4)):
        turns += segment
    turns = [*turns[:10], TurnSpec(user=draw(st.sampled_from([None, *REPLIES])), judge=draw(MODE))]
    turns[0] = replace(turns[0], user=turns[0].user or "fix the failing test")
    n = len(turns)
    gates = draw(st.lists(st.builds(
        Gate, st.sampled_from(["pytest", "make test", "said"]),
        st.sampled_from([0, 0, 1, 2, 124, 127]), st.integers(0, n - 1),
    ), max_size=3))  # fmt: skip
    return SessionSpec(
        tuple(turns),
        tuple(gates),
        draw(st.sampled_from([None, None, "g", "h"])),
        draw(st.sampled_from(["done", "idle"])),
        draw(st.sampled_from([None, None, *STOP_STATUSES])),
    )


SESSIONS = st.lists(sessions(), min_size=1, max_size=4)

# ---- the events -------------------------------------------------------------------------------


def tool_call(t: int, k: int, call: Call) -> dict[str, Any]:
    if call.cmd == "edit_file":
        fn = {"name": "edit_file", "arguments": json.dumps({"path": "app.py"})}
    else:
        fn = {"name": "shell", "arguments": json.dumps({"cmd": call.cmd})}
    return {"id": f"c{t}_{k}", "type": "function", "function": fn}


def tool_result(t: int, k: int, call: Call) -> dict[str, Any]:
    content = (
        call.text
        if call.code is None
        else json.dumps(
            {"exit_code": call.code, "stdout": "1 passed" if call.code == 0 else "1 failed"}
        )
    )
    return {"role": "tool", "tool_call_id": f"c{t}_{k}", "content": content}


def interactions(sid: str, spec: SessionSpec) -> list[Interaction]:
    """The session's turns as the gateway records them: each prompt is the previous one plus
    the previous answer, its tool results and the user's message, if any."""
    out: list[Interaction] = []
    prompt: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for t, turn in enumerate(spec.turns):
        if t > 0:
            prev = spec.turns[t - 1]
            calls = [tool_call(t - 1, k, c) for k, c in enumerate(prev.calls)]
            prompt = [
                *prompt,
                {
                    "role": "assistant",
                    "content": "running it",
                    **({"tool_calls": calls} if calls else {}),
                },
                *(tool_result(t - 1, k, c) for k, c in enumerate(prev.calls)),
            ]
        if turn.user is not None:
            prompt = [*prompt, {"role": "user", "content": turn.user}]
        out.append(Interaction(
            event_id=f"{sid}-i{t}", ts_ms=T0 + 10_000 * t, producer=GATEWAY, session_id=sid,
            turn=t, policy_id="p", weight_version=1, messages=prompt,
            prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5],
            response_logprobs=[-0.5, -0.7], response_text="running it",
            finish_reason="tool_calls" if turn.calls else "stop", latency_ms=1.0,
            session_done=spec.end == "done" and t == len(spec.turns) - 1,
            tool_calls=[tool_call(t, k, c) for k, c in enumerate(turn.calls)],
            group_id=spec.group, user_id="u1",
        ))  # fmt: skip
    return out


def gateway_stub(sid: str, turn: int) -> Any:
    """What the hook handlers read of the gateway: the limits and the session's last turn."""
    cfg = SimpleNamespace(next_state_max_chars=4000, hook_stop_scores=HOOK_STOP_SCORES)
    return SimpleNamespace(cfg=cfg, sessions=SimpleNamespace(_turns={sid: turn + 1}))


def extra_event(sid: str, t: int, k: int, x: Extra, gui: GuiSource) -> NextState:
    """A posted next state, built by the gateway's own code (deterministic id and time)."""
    if x.kind == "gui":
        kind, target, text = x.a.split(":")
        body = {
            "session_id": sid,
            "turn": t,
            "goal": GOAL,
            "action": {"type": kind, "target": target, "text": text},
            "tree": SCREENS[x.b],
        }
        req = SourceRequest(body, None, "harness", 4000, lambda _sid: t)
        ns = gui.next_states(req)[0]
    elif x.kind == "thumbs":
        ns = feedback_event(FeedbackRequest(session_id=sid, turn=t, thumbs=x.a), t, x.b)  # type: ignore[arg-type]
    else:
        answer = before_submit_prompt(gateway_stub(sid, t), sid, HookPayload(prompt=x.a))
        assert answer.event is not None
        ns = answer.event
    return replace(ns, event_id=f"{sid}-x{t}-{k}")


def gate_outcome(sid: str, g: Gate, k: int) -> NextState:
    if g.command == "said":
        ns = outcome_event(sid, g.code == 0, source="reviewer")
    else:
        ns = gate_event(sid, g.command.split(), GateResult(g.code, "", "", g.code == 124, 0.1))
    return replace(ns, event_id=f"{sid}-o{k}")


# ---- the judge ----------------------------------------------------------------------------------


class FuzzJudge:
    """The rule judge, or per turn a failing one: ``raise`` raises, ``error`` returns an
    errored verdict, ``bad`` a vote out of range (judging.judge_one makes both no verdict),
    ``zero`` says 0 to everything. (``never``: the driver drops the work.)"""

    judge_id = "fuzz"
    version = "fuzz-1"

    def __init__(self, modes: dict[tuple[str, int], str]) -> None:
        self.modes = modes
        self.rules = RuleJudge()

    async def judge(self, ctx: TurnContext, state: NextState) -> Verdict:
        mode = self.modes.get((state.session_id, state.turn), "rules")
        if mode == "raise":
            raise TimeoutError("the judge timed out")
        if mode == "error":
            return Verdict(0, [], error="judge backend returned 503")
        if mode == "bad":
            return Verdict(2, [2])  # type: ignore[arg-type, list-item]  # out of range on purpose
        if mode == "zero":
            return Verdict(0, [0])
        return self.rules.verdict(state, ctx.request)


# ---- the driver ---------------------------------------------------------------------------------


@dataclass
class Run:
    """What driving one session produced."""

    sid: str
    samples: list[Sample] = field(default_factory=list)
    rewards: list[Reward] = field(default_factory=list)
    penalties: list[PathPenalty] = field(default_factory=list)  # in evaluation order
    verdicts: list[PrmScore] = field(default_factory=list)
    left_out: int = 0


async def drive(sid: str, spec: SessionSpec, rules: RuleSet = DEFAULT) -> Run:
    """Drive one session through the session stage as ``SessionAgent.handle`` does (one
    record at a time, the inline judge, assembly as soon as ready), then the sweep: the idle
    close, and assembly once the grace period is over."""
    stage = SessionStage(Pairer(rules), Assembler(), judge_inline=True)
    modes = {(sid, t): turn.judge for t, turn in enumerate(spec.turns)}
    judge = FuzzJudge(modes)
    state = SessionState()
    gui = GuiSource(GuiOptions())
    inters = interactions(sid, spec)
    by_id = {i.event_id: i for i in inters}
    parked: dict[str, NextState] = {}
    run = Run(sid)
    now = T0

    async def settle(step: Step, work: list[judging.JudgeWork]) -> None:
        run.penalties += step.penalties
        run.left_out += len(step.left_out)
        for w in work:
            if modes.get((sid, w.ctx.turn)) == "never":
                continue  # a judge that never answers: the grace period assembles without it
            res = await judging.judge_one(judge, w)
            run.verdicts.append(res.prm)
            stage.on_verdict(state, res.prm, res.hints, now)
        if stage.assembler.ready(state.assembly, now):
            kept = {t: by_id[info.interaction.event_id] for t, info in state.assembly.turns.items()
                    if info.interaction is not None}  # fmt: skip
            done = stage.assembler.complete(
                state.assembly, now, {t: token_payload(i) for t, i in kept.items()}
            )
            run.rewards += done.rewards
            run.samples += done.samples
            state.assembly = done.state

    async def next_state(ns: NextState) -> None:
        step = stage.on_next_state(state, ns, now)
        if not step.applied:
            return
        for p in step.parked:
            parked[p.event_id] = p
        await settle(step, step.work)

    for t, inter in enumerate(inters):
        for k, g in enumerate(spec.gates):
            if g.at == t:
                now += 100
                await next_state(replace(gate_outcome(sid, g, k), ts_ms=now))
        now += 1_000
        step = stage.on_interaction(state, inter, now)
        unparked = [w for nid in stage.ready_parked(state, t)
                    if (w := stage.take_parked(state, parked.pop(nid))) is not None]  # fmt: skip
        await settle(step, [*step.work, *unparked])
        for k, x in enumerate(spec.turns[t].extras):
            now += 100
            await next_state(replace(extra_event(sid, t, k, x, gui), ts_ms=now))
    if spec.stop is not None:
        last = len(inters) - 1
        answer = stop(gateway_stub(sid, last), sid, HookPayload(status=spec.stop))
        assert answer.event is not None
        now += 100
        await next_state(replace(answer.event, event_id=f"{sid}-stop", ts_ms=now))
    now += IDLE_MS + 1
    if not state.pairing.closed:
        step = stage.on_idle(state, now, IDLE_MS)
        await settle(step, step.work)
    now += stage.assembler.grace_ms + 1
    await settle(Step(), [])
    return run


_LOOP = asyncio.new_event_loop()  # one for every session: asyncio.run costs ~3 ms a call


def drive_one(spec: SessionSpec, rules: RuleSet = DEFAULT, sid: str = "s0") -> Run:
    """:func:`drive`, for callers without an event loop (the tests, :func:`check`)."""
    return _LOOP.run_until_complete(drive(sid, spec, rules))


def assemble(runs: list[Run], specs: list[SessionSpec]) -> list[Sample]:
    """Every session's samples; grouped sessions z-scored per group, as the group agent does
    once the group is complete."""
    out: list[Sample] = []
    groups: dict[str, dict[str, list[Sample]]] = defaultdict(dict)
    for run, spec in zip(runs, specs, strict=True):
        if spec.group is None:
            out += run.samples
        else:
            groups[spec.group][run.sid] = run.samples
    for g, members in sorted(groups.items()):
        out += grouping.normalize(g, members, "samples-3")
    return out


# ---- the invariants -----------------------------------------------------------------------------


def real_turns(run: Run, outcome: float | None) -> set[int] | None:
    """Turns that may carry a real signal (None: all, a verified outcome), else those with a
    verdict that is neither 0 nor errored. Conservative: a verdict replaced later counts."""
    if outcome is not None:
        return None
    return {p.turn for p in run.verdicts if p.score != 0 and not is_no_verdict(p)}


def check_batch(
    batch: list[Sample], cores: dict[str, Any], failed: set[tuple[str, int]], stats: Counter[str]
) -> None:
    """Advantages of ``batch`` by the trainer's own preparation: finite, and never positive
    for a failed session's sample."""
    if not batch:
        return
    for core in cores.values():
        b = core._prepare(batch, 0, None)
        adv = L.binary_rl_advantages(b.rewards, b.mask_rl, b.baseline)
        out = L.binary_rl_loss(b.behavior, b.behavior, b.rewards, b.mask_rl, baseline=b.baseline)
        assert bool(torch.isfinite(adv).all()), "finite: an advantage is not finite"
        assert bool(torch.isfinite(torch.as_tensor(b.baseline)).all()), "finite: baseline"
        assert bool(torch.isfinite(out.loss).all()), "finite: the loss is not finite"
        stats["finite"] += 1
        for i, s in enumerate(batch):
            if (s.session_id, s.turn) in failed:
                assert float(adv[i].max()) <= 0.0, (
                    f"failed: {s.session_id} turn {s.turn} gets advantage "
                    f"{float(adv[i].max())} in a batch of {len(batch)}"
                )
                stats["failed_batch"] += 1


def check(
    specs: list[SessionSpec],
    cores: dict[str, Any],
    rnd: random.Random,
    stats: Counter[str] | None = None,
) -> None:
    """Drive ``specs`` with the default rules and with none, and assert the invariants of the
    module docstring. ``stats`` counts the cases each invariant was checked on."""
    stats = stats if stats is not None else Counter()
    sids = [f"s{k}" for k in range(len(specs))]
    runs = [drive_one(spec, DEFAULT, sid) for sid, spec in zip(sids, specs, strict=True)]
    plain = [drive_one(spec, NO_RULES, sid) for sid, spec in zip(sids, specs, strict=True)]
    shaped_samples = assemble(runs, specs)
    plain_by_turn = {(s.session_id, s.turn): s for s in assemble(plain, specs)}
    lo, hi, beta = DEFAULT.phi_min, DEFAULT.phi_max, DEFAULT.beta
    failed: set[tuple[str, int]] = set()
    for sid, spec, run in zip(sids, specs, runs, strict=True):
        stats["sessions"] += 1
        # bound: Phi after every evaluation, the telescoped total, the rewards' path parts
        phi = 0.0
        for pen in run.penalties:
            phi += pen.penalty
            assert lo - TOL <= phi <= hi + TOL, f"bound: {sid} reaches Phi {phi}"
        path = sum(r.penalty for r in run.rewards)
        assert beta * lo - TOL <= path <= beta * hi + TOL, (
            f"bound: {sid}'s rewards carry a path part of {path}, outside {beta} * [{lo}, {hi}]"
        )
        stats["bound"] += 1
        stats["bound_violations"] += any(p.penalty < 0 for p in run.penalties)
        outcome = expected_outcome(spec)
        real = real_turns(run, outcome)
        mine = [s for s in shaped_samples if s.session_id == sid]
        for s in mine:
            assert math.isfinite(s.reward) and math.isfinite(s.penalty), f"finite: {s}"
            assert s.outcome == outcome, f"outcome: {sid} turn {s.turn}: {s.outcome} != {outcome}"
            if real is None or s.turn in real:
                continue
            p = plain_by_turn[(sid, s.turn)]
            assert s.penalty == 0.0, f"shaping_alone: {sid} turn {s.turn} path part {s.penalty}"
            # (equal to float precision: a group ranks reward - penalty, and the other
            # sessions' path parts leave ~1e-17 of it; a constant bucket's 1e-9 floor holds)
            assert math.isclose(s.reward, p.reward, rel_tol=1e-9, abs_tol=1e-12) and (
                list(s.loss_mask), s.masked) == (list(p.loss_mask), p.masked), (
                f"shaping_alone: {sid} turn {s.turn} is {s.reward}/{list(s.loss_mask)} with "
                f"the rules, {p.reward}/{list(p.loss_mask)} without")  # fmt: skip
            stats["shaping_alone"] += 1
        if real == set() and mine and spec.group is None:
            # (in a group a judged 0 is a value: ranked above a failed attempt, it is > 0,
            # with the rules or without, which the turns' comparison above checks)
            assert all(s.reward <= 0 for s in mine), f"shaping_alone: {sid} has a reward > 0"
            stats["no_signal_sessions"] += 1
        if outcome is not None and outcome < 0:
            for s in mine:
                assert s.reward <= 0.0, f"failed: {sid} turn {s.turn} reward {s.reward}"
                failed.add((sid, s.turn))
            stats["failed_sessions"] += 1
    for r in (*runs, *plain):
        for rw in r.rewards:
            assert math.isfinite(rw.total) and math.isfinite(rw.penalty), f"finite: {rw}"
    # batches: all, each session's own, random sub-batches in random order
    batch = list(shaped_samples)
    rnd.shuffle(batch)
    compositions = [batch, *([s for s in batch if s.session_id == sid] for sid in sids)]
    compositions += [rnd.sample(batch, rnd.randint(1, len(batch))) for _ in range(2) if batch]
    for comp in compositions:
        check_batch(comp, cores, failed, stats)


# ---- the trainer side ---------------------------------------------------------------------------


def load_cores(model_dir: Path) -> dict[str, Any]:
    """The trainer (tiny model, CPU) with either batch baseline: only its ``_prepare`` runs."""
    from pipeline.models.tiny import ensure_tiny_model
    from pipeline.trainer.config import TrainerSettings
    from pipeline.trainer.core import TrainerCore

    tiny = ensure_tiny_model(model_dir)
    return {
        mode: TrainerCore.load(TrainerSettings(model=str(tiny), device="cpu", method="rl",
                                               rl_baseline=mode))
        for mode in ("batch_mean", "none")
    }  # fmt: skip


# ---- the search ---------------------------------------------------------------------------------


def search(
    cores: dict[str, Any], examples: int, budget_s: float, first_seed: int, stats: Counter[str]
) -> str | None:
    """Run the property in chunks (a fresh seed each) until ``examples`` or ``budget_s`` is
    spent; the minimised counter-example's report, or None."""
    start = time.monotonic()
    chunk = 200 if budget_s > 0 else max(1, examples)
    k = 0
    while True:
        left = examples - stats["examples"] if examples > 0 else chunk

        @seed(first_seed + k)
        @settings(
            max_examples=max(1, min(chunk, left)),
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(SESSIONS, st.randoms(use_true_random=False))
        def prop(specs: list[SessionSpec], rnd: random.Random) -> None:
            stats["examples"] += 1
            check(specs, cores, rnd, stats)

        try:
            prop()
        except Exception:  # noqa: BLE001 - the counter-example is the result
            return traceback.format_exc(limit=3)
        k += 1
        if examples > 0 and stats["examples"] >= examples:
            return None
        if budget_s > 0 and time.monotonic() - start >= budget_s:
            return None
        if budget_s <= 0 and examples <= 0:
            return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=0.0, help="search until this is spent")
    ap.add_argument("--examples", type=int, default=0, help="examples to try (0: the budget)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default="", help="where the tiny model is (built if absent)")
    args = ap.parse_args()
    if args.budget_s <= 0 and args.examples <= 0:
        args.examples = 200
    model_dir = Path(args.model_dir) if args.model_dir else Path(tempfile.mkdtemp()) / "tiny"
    cores = load_cores(model_dir)
    stats: Counter[str] = Counter()
    t0 = time.monotonic()
    found = search(cores, args.examples, args.budget_s, args.seed, stats)
    spent = time.monotonic() - t0
    print(
        f"examples tried: {stats['examples']} in {spent:.1f} s "
        f"({stats['examples'] / max(spent, 1e-9):.1f}/s), seed {args.seed}"
    )
    for name in (
        "sessions",
        "bound",
        "bound_violations",
        "shaping_alone",
        "no_signal_sessions",
        "failed_sessions",
        "failed_batch",
        "finite",
    ):
        print(f"  {name:20s} {stats[name]}")
    if found is None:
        print("no counter-example found")
        return
    print("COUNTER-EXAMPLE (minimised; the 'Falsifying example' above is the input):")
    print(found)
    sys.exit(1)


if __name__ == "__main__":
    main()
