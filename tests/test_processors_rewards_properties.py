"""Reward assembly invariants, searched by hypothesis over generated sessions and batches
(issue 38): shaping alone never makes a reward or a trainable sample, a failed outcome never
yields a positive advantage whatever the batch holds, and NaN/inf never reach an advantage.

Sessions are assembled by the real :class:`Assembler`, grouped ones normalised by
``grouping.normalize``, and the batch's advantages taken from the trainer's own ``_prepare``
(per-row baselines) with both ``rl_baseline`` settings. Bounded examples here; a longer search
is a matter of ``--hypothesis-profile`` or raising ``max_examples``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.events import PathPenalty, PrmScore, Producer, Sample, examples
from pipeline.processors import grouping
from pipeline.processors.outcomes import outcome_event
from pipeline.processors.rewards import Assembler
from pipeline.trainer import losses as L
from pipeline.trainer.core import TrainerCore
from tests import bench_module

P = Producer(component="t", version="1")
HUGE = [1e308, -1e308, 1e39, -1e39]  # overflow beta * Phi, or float32 in the trainer

Verdict = int | str | None  # a score, "error" (the judge failed), None (never answered)


@dataclass(frozen=True)
class TurnSpec:
    verdict: Verdict
    phi: float
    beta: float
    actions: tuple[float, ...]  # GUI actions' Phi (beta 0.5 each)


@dataclass(frozen=True)
class SessionSpec:
    turns: tuple[TurnSpec, ...]
    group: str | None
    outcome: bool | float | None  # a pass/fail, or an explicit score (inf/NaN included)


PHI = st.one_of(st.floats(-2.0, 2.0, allow_nan=False), st.sampled_from([0.0, *HUGE]))
TURN = st.builds(
    TurnSpec,
    verdict=st.sampled_from([None, "error", -1, 0, 0, 1]),
    phi=PHI,
    beta=st.sampled_from([0.5, 1.0, 10.0]),
    actions=st.lists(PHI, max_size=2).map(tuple),
)
OUTCOME = st.one_of(
    st.none(), st.booleans(),
    st.floats(-1.0, 1.0), st.sampled_from([math.inf, -math.inf, math.nan, 1e308, -1e308]),
)  # fmt: skip
SESSION = st.builds(
    SessionSpec,
    turns=st.lists(TURN, min_size=1, max_size=3).map(tuple),
    group=st.sampled_from([None, None, "g", "h"]),
    outcome=OUTCOME,
)
SESSIONS = st.lists(SESSION, min_size=1, max_size=5)


def expected_outcome(o: bool | float | None) -> float | None:
    """What the session's outcome value must be (outcome_value): the explicit score, its sign
    when infinite, the exit code (here 0: passed) when NaN."""
    if o is None:
        return None
    if isinstance(o, bool):
        return 1.0 if o else -1.0
    if math.isnan(o):
        return 1.0
    return o if math.isfinite(o) else math.copysign(1.0, o)


def real_signal(spec: SessionSpec, turn: TurnSpec) -> bool:
    """A verified outcome, or a verdict that is neither 0 nor failed (one verdict per turn)."""
    return spec.outcome is not None or turn.verdict in (-1, 1)


def build(sid: str, spec: SessionSpec, shaping: bool) -> list[Sample]:
    """The session's samples as the session agent assembles them (``shaping``: the path
    penalties as generated, else all Phi 0)."""
    asm = Assembler()
    state = None
    base = examples.interaction(prompt_tokens=3, response_tokens=2)
    for t, turn in enumerate(spec.turns):
        ids = (f"{sid}-i{t}", f"{sid}-n{t}")
        inter = dataclasses.replace(base, event_id=ids[0], session_id=sid, turn=t,
                                    group_id=spec.group)  # fmt: skip
        state = asm.on_interaction(state, inter)
        kind = "session_end" if t == len(spec.turns) - 1 else "user_reply"
        ns = dataclasses.replace(examples.examples()["next_state"], event_id=ids[1],
                                 session_id=sid, turn=t, kind=kind)  # fmt: skip
        state = asm.on_next_state(state, ns, 0)
        if turn.verdict is not None:
            failed = turn.verdict == "error"
            score = 0 if failed else turn.verdict
            state = asm.on_prm(state, PrmScore(
                event_id=f"{sid}-p{t}", producer=P, parents=list(ids), session_id=sid, turn=t,
                score=score, votes=[] if failed else [score], judge_id="j", judge_version="1",
                error="judge raised TimeoutError" if failed else None,
            ))  # type: ignore[arg-type]  # fmt: skip
        state = asm.on_penalty(state, PathPenalty(
            event_id=f"{sid}-x{t}", producer=P, parents=[ids[0]], session_id=sid, turn=t,
            rule_ids=[], penalty=turn.phi if shaping else 0.0, compliance_bonus=0.0,
            beta=turn.beta,
        ))  # fmt: skip
        for k, phi in enumerate(turn.actions):
            state = asm.on_action_penalty(state, PathPenalty(
                event_id=f"{sid}-a{t}-{k}", producer=P, parents=[ids[1]], session_id=sid,
                turn=t, rule_ids=[], penalty=phi if shaping else 0.0, compliance_bonus=0.0,
                beta=0.5,
            ))  # fmt: skip
    if spec.outcome is not None:
        o = outcome_event(sid, spec.outcome is not False, ts_ms=5)
        if not isinstance(spec.outcome, bool):
            o = dataclasses.replace(o, score=spec.outcome)
        state = asm.on_next_state(state, dataclasses.replace(o, event_id=f"{sid}-o"), 10)
    assert state is not None
    return asm.complete(state, 11).samples


def assemble(specs: list[SessionSpec], shaping: bool = True) -> list[Sample]:
    """Every session's samples; grouped sessions normalised per group, as the group agent
    does once the group is complete."""
    out: list[Sample] = []
    groups: dict[str, dict[str, list[Sample]]] = defaultdict(dict)
    for k, spec in enumerate(specs):
        samples = build(f"s{k}", spec, shaping)
        if spec.group is None:
            out += samples
        else:
            groups[spec.group][f"s{k}"] = samples
    for g, members in sorted(groups.items()):
        out += grouping.normalize(g, members, "samples-3")
    return out


def by_turn(samples: list[Sample]) -> dict[tuple[str, int], Sample]:
    return {(s.session_id, s.turn): s for s in samples}


@settings(max_examples=300, deadline=None)
@given(SESSIONS)
def test_assembly_invariants(specs: list[SessionSpec]) -> None:
    shaped = by_turn(assemble(specs))
    plain = by_turn(assemble(specs, shaping=False))
    realistic = all(abs(x.beta * x.phi) < 1e6 and all(abs(a) < 1e6 for a in x.actions)
                    for spec in specs for x in spec.turns)  # fmt: skip
    for k, spec in enumerate(specs):
        sid = f"s{k}"
        trainable = [t for t in range(len(spec.turns)) if shaped[(sid, t)].rl_trainable()]
        for t, turn in enumerate(spec.turns):
            s = shaped[(sid, t)]
            # finite whatever beta * Phi or the outcome score overflowed to
            assert math.isfinite(s.reward) and math.isfinite(s.penalty)
            assert s.outcome == expected_outcome(spec.outcome)
            if s.outcome is not None and s.outcome < 0:
                assert s.reward <= 0  # a failed session is never encouraged
            if turn.verdict in (None, "error") and spec.outcome is None:
                assert not s.rl_trainable()  # nothing known: never trained, never ranked
            if real_signal(spec, turn):
                continue
            # shaping alone: no path part, and the sample is what it is without shaping (when
            # no beta * Phi reaches 1e6, beyond which reward - penalty loses the other
            # turns' outcome+PRM part to float precision: no validated rule set gets there)
            assert s.penalty == 0.0
            p = plain[(sid, t)]
            if realistic:
                assert (s.reward, list(s.loss_mask), s.masked) == (
                    p.reward,
                    list(p.loss_mask),
                    p.masked,
                )
            if spec.group is None:
                assert s.reward == 0.0
                # trainable only as the session's one kept (last judged) turn, at 0
                assert not s.rl_trainable() or (trainable == [t] and turn.verdict == 0)


# ---- the batch: per-row baselines --------------------------------------------------------


@pytest.fixture(scope="module")
def cores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TrainerCore]:
    """The trainer with either batch baseline, as the reward fuzz loads it."""
    return bench_module.load("reward_fuzz").load_cores(tmp_path_factory.mktemp("model") / "tiny")


REWARD = st.one_of(st.floats(-3.0, 3.0), st.sampled_from([math.nan, math.inf, -math.inf, *HUGE]))
EXTRA = st.fixed_dictionaries({
    "reward": REWARD,
    "normalized": st.booleans(),
    "outcome": st.sampled_from([None, None, -1.0, -0.5, 1.0, math.nan]),
    "loss_mask": st.sampled_from([[1, 1], [0, 0], [1, 0]]),
    "masked": st.booleans(),
    "group_id": st.sampled_from([None, "g"]),
})  # fmt: skip


def extra_sample(i: int, kw: dict[str, Any]) -> Sample:
    """A hand-made sample (an older record, another producer): any flags, any reward."""
    return dataclasses.replace(examples.examples()["sample"], event_id=f"e{i}", turn=i,
                               response_token_ids=[1, 2], behavior_logprobs=[-1.0, -1.0],
                               opd_mask=[], hints=[], **kw)  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SESSIONS, st.lists(EXTRA, max_size=4), st.randoms(use_true_random=False))
def test_a_failed_outcome_never_gets_a_positive_advantage_in_any_batch(
    cores: dict[str, TrainerCore],
    specs: list[SessionSpec],
    extras: list[dict[str, Any]],
    rnd: Any,
) -> None:
    batch = assemble(specs) + [extra_sample(i, kw) for i, kw in enumerate(extras)]
    rnd.shuffle(batch)
    for core in cores.values():
        b = core._prepare(batch, 0, None)
        adv = L.binary_rl_advantages(b.rewards, b.mask_rl, b.baseline)
        assert bool(torch.isfinite(adv).all())  # NaN/inf never reach an advantage
        assert math.isfinite(float(torch.as_tensor(b.baseline).sum()))
        for i, s in enumerate(batch):
            if s.outcome_failed():
                assert float(adv[i].max()) <= 0.0  # whatever the batch holds
            elif s.normalized and bool(b.mask_rl[i].any()):
                # a group's advantage is not re-centred by the batch: A = r on its tokens
                trained = b.mask_rl[i] > 0
                assert torch.equal(adv[i][trained], b.rewards[i].expand_as(adv[i][trained]))
