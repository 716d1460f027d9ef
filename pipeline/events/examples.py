"""Realistic, deterministic example events: one per type, for tests and benchmarks (the
contract test runs each against its JSON Schema)."""

from __future__ import annotations

import random
from typing import Any

from pipeline.events.ids import derive_event_id
from pipeline.events.types import (
    EVENT_TYPES,
    DeadLetter,
    Event,
    GateVote,
    GradientStep,
    Hint,
    Interaction,
    JudgeConsistency,
    NextState,
    PathPenalty,
    PrmScore,
    Producer,
    Reward,
    Sample,
    ServingStatus,
    TrainerStatus,
    VerifiedTask,
    WeightsPublished,
)

_TS = 1_790_000_000_000
_SESSION = "sess-7f3a9c"
_GATEWAY = Producer(component="gateway", version="0.1.0")
_INTERACTION_ID = "c0ffee00c0ffee00c0ffee00c0ffee00"

_SYSTEM = (
    "You are a coding agent working in a Linux shell. Use the provided tools to inspect and edit "
    "files, run tests, and explain briefly what you changed. Prefer small, verifiable steps. "
)
_USER = (
    "The CI job `unit` fails on main since yesterday with `ImportError: cannot import name "
    "'parse_config' from 'app.settings'`. Please find the cause and fix it, then run the tests. "
)
_TOOL_OUTPUT = (
    "app/settings.py:12:def load_config(path: str) -> Config:\n"
    "app/cli.py:3:from app.settings import parse_config\n"
    "tests/test_cli.py:5:from app.settings import parse_config\n"
)


def interaction(
    prompt_tokens: int = 256, response_tokens: int = 64, text_repeat: int = 1
) -> Interaction:
    """An agent turn with tool use; sizes are adjustable (bench: 2,048 / 512 / 5 = ~31 KB)."""
    rng = random.Random(prompt_tokens * 7919 + response_tokens)
    response_text = (
        "The function was renamed from `parse_config` to `load_config` in app/settings.py but two "
        "importers were not updated. I will update app/cli.py and tests/test_cli.py, then run "
        "pytest. "
    ) * text_repeat
    return Interaction(
        event_id=_INTERACTION_ID,
        ts_ms=_TS,
        producer=_GATEWAY,
        session_id=_SESSION,
        turn=3,
        policy_id="qwen3-4b-agent",
        weight_version=12,
        messages=[
            {"role": "system", "content": _SYSTEM * text_repeat},
            {"role": "user", "content": _USER * text_repeat},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "shell",
                            "arguments": '{"cmd": "grep -rn parse_config ."}',
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": _TOOL_OUTPUT * text_repeat},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "shell",
                    "description": "Run a shell command and return its output.",
                    "parameters": {
                        "type": "object",
                        "properties": {"cmd": {"type": "string"}},
                        "required": ["cmd"],
                    },
                },
            }
        ],
        prompt_token_ids=[rng.randrange(151_936) for _ in range(prompt_tokens)],
        response_token_ids=[rng.randrange(151_936) for _ in range(response_tokens)],
        response_logprobs=[-rng.expovariate(2.0) for _ in range(response_tokens)],
        response_text=response_text,
        sampling={
            "temperature": 0.7,
            "top_p": 0.95,
            "max_tokens": 1024,
            "stop": None,
            "seed": None,
        },
        finish_reason="stop",
        latency_ms=412.7,
        train=True,
        group_id=None,
    )


def examples() -> dict[str, Event]:
    """One realistic instance of every event type, keyed by type name."""
    inter = interaction()
    judge = Producer(component="judge", version="prm-2")
    ns_id = derive_event_id("next_state", [inter.event_id], "pairing-1", "user_reply")
    prm_id = derive_event_id("prm_score", [inter.event_id, ns_id], judge.version)
    pen_id = derive_event_id("path_penalty", [inter.event_id], "rules-1")
    rew_id = derive_event_id("reward", [prm_id, pen_id], "reward-1")
    turn: dict[str, Any] = {"session_id": _SESSION, "turn": inter.turn, "ts_ms": _TS + 5_000}
    trainer = Producer(component="trainer", version="0.1.0")
    offsets = {"0": 1_204, "1": 1_188, "2": 1_250, "3": 1_197}
    events: list[Event] = [
        inter,
        NextState(
            event_id=ns_id,
            producer=Producer(component="next_state", version="pairing-1"),
            parents=[inter.event_id],
            kind="user_reply",
            role="user",
            content="Thanks, but the tests still fail: tests/test_cli.py imports it too.",
            source="pairing",
            scope="turn",
            **turn,
        ),
        PrmScore(
            event_id=prm_id,
            producer=judge,
            parents=[inter.event_id, ns_id],
            score=-1,
            votes=[-1, -1, None],
            judge_id="qwen3-32b-judge",
            judge_version="prm-2",
            rationale="The user reports the fix was incomplete.",
            **turn,
        ),
        Hint(
            event_id=derive_event_id("hint", [inter.event_id, ns_id], "hint-1", 0),
            producer=judge,
            parents=[inter.event_id, ns_id],
            hint="Update every importer found by grep, including tests/, before running pytest.",
            judge_id="qwen3-32b-judge",
            rank=0,
            **turn,
        ),
        PathPenalty(
            event_id=pen_id,
            producer=Producer(component="penalties", version="rules-1"),
            parents=[inter.event_id],
            rule_ids=["no-force-push", "ran-tests"],
            penalty=-0.3,
            compliance_bonus=0.1,
            beta=0.5,
            hits=[
                {"rule_id": "no-force-push", "detail": "git push --force on main"},
                {"rule_id": "ran-tests", "detail": "pytest -q"},
            ],
            **turn,
        ),
        Reward(
            event_id=rew_id,
            producer=Producer(component="rewards", version="reward-1"),
            parents=[prm_id, pen_id],
            outcome=0.0,
            prm=-1.0,
            penalty=-0.1,
            total=-1.1,
            formula_version="reward-1",
            **turn,
        ),
        Sample(
            event_id=derive_event_id("sample", [inter.event_id, rew_id], "samples-1"),
            producer=Producer(component="samples", version="samples-1"),
            parents=[inter.event_id, rew_id],
            policy_id=inter.policy_id,
            prompt_token_ids=inter.prompt_token_ids,
            response_token_ids=inter.response_token_ids,
            loss_mask=[1] * len(inter.response_token_ids),
            behavior_logprobs=inter.response_logprobs,
            reward=-1.1,
            hints=["Update every importer found by grep, including tests/, before running pytest."],
            behavior_weight_version=inter.weight_version,
            masked=False,
            group_id=None,
            step_index=3,
            opd_mask=[1] * len(inter.response_token_ids),
            **turn,
        ),
        GradientStep(
            event_id=derive_event_id("gradient_step", [], "trainer-1", "qwen3-4b-agent", 481),
            ts_ms=_TS + 60_000,
            producer=trainer,
            policy_id="qwen3-4b-agent",
            step=481,
            losses={"rl": 0.0213, "opd": 0.1874, "total": 0.2087},
            kl=0.0041,
            clip_fraction=0.037,
            grad_norm=0.83,
            consumed_offsets=offsets,
            samples=64,
            tokens=97_213,
            weight_version=12,
        ),
        WeightsPublished(
            event_id=derive_event_id("weights", [], "trainer-1", "qwen3-4b-agent", 13),
            ts_ms=_TS + 61_000,
            producer=trainer,
            policy_id="qwen3-4b-agent",
            version=13,
            parent=12,
            uri="file:///var/lib/liverl/weights/qwen3-4b-agent/v13/",
            files=[
                {"path": "model.safetensors", "sha256": "a" * 64, "bytes": 8_044_936_192},
                {"path": "config.json", "sha256": "0123456789abcdef" * 4, "bytes": 1_387},
            ],
            step=481,
            status="candidate",
            consumed_offsets=offsets,
            metrics={"reward_mean": -0.12},
        ),
        ServingStatus(
            event_id=derive_event_id("serving_status", [], "serving-1", "replica-0", 13),
            ts_ms=_TS + 63_000,
            producer=Producer(component="reloader", version="0.1.0"),
            replica_id="replica-0",
            policy_id="qwen3-4b-agent",
            version=13,
            reload_ms=1_840.5,
            ok=True,
        ),
        TrainerStatus(
            event_id="5d1e0c7a9b2f4e6d8c0a1b3d5f7e9c2a",
            ts_ms=_TS + 62_500,
            producer=Producer(component="trainer", version="0.1.0"),
            policy_id="qwen3-4b-agent",
            state="judging",
            version=12,
            step=481,
            samples=3_120,
            last_step_ms=_TS + 61_000,
            loss=0.0734,
            judging_version=13,
            judging_since_ms=_TS + 61_200,
            prompts_done=14,
            prompts_total=36,
            eta_s=41.5,
            detail="gate v13: prompt 14 of 36 (candidate)",
        ),
        GateVote(
            event_id=derive_event_id(
                "gate_vote", [], "gate-1", "qwen3-4b-agent", 13, "9f2c4e1a7b3d5f60", "fluency"
            ),
            ts_ms=_TS + 62_000,
            producer=Producer(component="gate", version="gate-1"),
            policy_id="qwen3-4b-agent",
            version=13,
            live_version=12,
            prompt_id="9f2c4e1a7b3d5f60",
            source="held_out",
            judge="fluency",
            vote=1,
            candidate_score=-1.92,
            live_score=-2.31,
            detail={"metric": "mean_nll", "tokens": 187},
        ),
        JudgeConsistency(
            event_id=derive_event_id("judge_consistency", ["prm-1", "ns-gate-1"], "consistency-1"),
            ts_ms=_TS + 64_000,
            producer=Producer(component="consistency", version="consistency-1"),
            parents=["prm-1", "ns-gate-1"],
            judge_id="replies",
            judge_version="replies-judge-2/replies-3",
            verdict=1,
            outcome=-1,
            verdict_id="prm-1",
            outcome_id="ns-gate-1",
            agree=41,
            disagree=9,
            abstain=12,
            consistency=0.8076923076923077,
        ),
        VerifiedTask(
            event_id=derive_event_id("verified_task", [_INTERACTION_ID, "ns-gate-1"], "tasks-1"),
            ts_ms=_TS + 65_000,
            producer=Producer(component="task_pool", version="tasks-1"),
            parents=[_INTERACTION_ID, "ns-gate-1"],
            task_id="task-5d1e0c7a9b2f4e68",
            status="accepted",
            k=3,
            prompt=_USER,
            answer="Renamed the import to `load_config`; `pytest -q` passes.",
            messages=[{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _USER}],
            checker={
                "kind": "command",
                "command": "pytest -q",
                "exit_code": 0,
                "score": 1.0,
                "source": "record-outcome",
                "content": "$ pytest -q\n42 passed",
                "producer": "record-outcome",
            },
            provenance={
                "session_id": _SESSION,
                "outcome_id": "ns-gate-1",
                "outcome_at": {"topic": "liverl.next_states.v1", "partition": 2, "offset": 90_305},
                "interactions": [
                    {
                        "event_id": _INTERACTION_ID,
                        "turn": 3,
                        "topic": "liverl.interactions.v1",
                        "partition": 2,
                        "offset": 90_211,
                    }
                ],
            },
            votes=[
                {
                    "judge_id": "rules",
                    "judge_version": "rules-judge-2",
                    "vote": 1,
                    "rationale": "exit code 0",
                },
                {
                    "judge_id": "replies",
                    "judge_version": "replies-judge-2/replies-3",
                    "vote": 1,
                    "rationale": "exit code 0",
                },
                {
                    "judge_id": "llm",
                    "judge_version": "llm-judge-1/judge",
                    "vote": -1,
                    "rationale": "the fix renames the caller, not the function",
                },
            ],
        ),
        DeadLetter.wrap(
            b'{"type": "interaction", "turn": "three"',
            topic="liverl.interactions.v1",
            partition=2,
            offset=90_210,
            error="malformed JSON: unexpected end of data",
            producer=Producer(component="next_state", version="pairing-1"),
            key=_SESSION.encode(),
            headers=[("liverl-type", b"interaction"), ("liverl-schema-version", b"1")],
        ),
    ]
    written = {e.type: e for e in events}
    # A type added since (its dataclass and schema): a minimal instance from its schema, so
    # every example-driven test covers it before anyone writes a realistic one.
    return {t: written.get(t) or synthesized(t) for t in EVENT_TYPES}


def synthesized(type_: str) -> Event:
    """The smallest valid ``type_`` event its schema allows, decoded (hence validated) as on
    the wire: required fields only, each the first value its schema accepts."""
    import orjson

    from pipeline.events.codec import decode
    from pipeline.events.validation import load_schema

    doc = _instance(load_schema(type_, 1))
    doc["event_id"] = derive_event_id(type_, [], "synthesized")
    return decode(orjson.dumps(doc), type_)


def _instance(schema: dict[str, Any]) -> Any:
    """A value ``schema`` accepts (the subset of JSON Schema that schemas/ uses)."""
    import re

    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    for branch in ("anyOf", "oneOf"):
        if branch in schema:
            return _instance(schema[branch][0])
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = next(k for k in kind if k != "null") if kind != ["null"] else "null"
    if kind == "object":
        props = schema.get("properties", {})
        return {k: _instance(props.get(k, {})) for k in schema.get("required", [])}
    if kind == "array":
        return [_instance(schema.get("items", {})) for _ in range(schema.get("minItems", 0))]
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum", -1) + 1)
        return max(0, low) if "maximum" not in schema else min(max(0, low), schema["maximum"])
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    size = schema.get("minLength", 0)
    pattern = re.compile(schema.get("pattern", ""))
    return next(
        c
        for c in ("x" * max(size, 1), "0" * max(size, 64), "")
        if len(c) >= size and pattern.search(c)
    )
