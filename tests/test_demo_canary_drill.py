"""The canary drill end to end: ``liverl up`` with two gateway replicas and its canary decider,
simulated users who want English. A good version reaches everyone through its canary; a
harmful one (it answers in French), let through by the most permissive gate (off), is
withdrawn by the decider before more than its canary share of sessions met it; each decision
is one event on the weights topic. Then an operator promotes, rolls back, pins and unpins on
the same loop, and the sessions follow each command. No request fails throughout (a failed
one raises in the drill).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from pipeline.demo.canary_drill import ENGLISH, FRENCH, DrillUsers, fit, loop_config, run_drill
from pipeline.demo.loop import running_loop
from pipeline.settings import Settings
from pipeline.sim import PREFERENCES
from pipeline.stack import free_port

SHARE = 0.2
MIN_SESSIONS = 8
REPLICAS = {"gateway-0", "gateway-1"}  # liverl up --gateways 2


def test_fit_makes_greedy_answers_the_targets() -> None:
    """The versions the drill publishes answer as it says (English v1, French v2 from v1)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.models.tiny import ensure_tiny_model

    path = ensure_tiny_model()
    tok: Any = AutoTokenizer.from_pretrained(path)
    model: Any = AutoModelForCausalLM.from_pretrained(path)

    def answers() -> dict[str, str]:
        out = {}
        for q in ENGLISH:
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": q}],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=False,
            )
            ids = model.generate(prompt, max_new_tokens=48, do_sample=False)
            out[q] = tok.decode(ids[0][prompt.shape[1] :], skip_special_tokens=True).strip()
        return out

    english = PREFERENCES["english"]
    assert not any(english.met(a) and a in ENGLISH.values() for a in answers().values())
    assert fit(model, tok, ENGLISH, seed=1) < 0.05
    assert answers() == ENGLISH and all(english.met(a) for a in ENGLISH.values())
    assert fit(model, tok, FRENCH, seed=2) < 0.05
    assert answers() == FRENCH and not any(english.met(a) for a in FRENCH.values())


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_good_version_rolls_out_and_a_french_one_is_withdrawn_within_its_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unique: str
) -> None:
    env = {
        "LIVERL_STATE_DIR": str(tmp_path / "state"),
        "LIVERL_BROKER_PORT": str(free_port()),
        "LIVERL_BROKER_CONTROLLER_PORT": str(free_port()),
        "LIVERL_PROCESSORS_WEB_PORT": str(free_port()),
        "LIVERL_TRAINER_GATE": "false",  # every candidate serves: the most permissive gate
        "LIVERL_CANARY_MIN_SESSIONS": str(MIN_SESSIONS),
    }
    for key in [k for k in os.environ if k.startswith("LIVERL_")]:
        monkeypatch.delenv(key)  # the session broker's bootstrap must not leak in
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    policy = f"drill-{unique}"
    metrics = free_port()  # the trainer's (left out); the canary decider's is the next
    cfg = loop_config(
        policy, tmp_path / "state", start_timeout_s=300, extra_args=("--metrics-port", str(metrics))
    )
    with running_loop(cfg) as loop:
        settings = Settings()
        trainer = settings.trainer.under_state_dir(Path(settings.state_dir))
        result = run_drill(
            settings,
            trainer,
            loop.url,
            policy,
            share=SHARE,
            rate=4.0,
            max_sessions=400,
        )
        operated = operate(settings, DrillUsers(loop.url, policy, rate=8.0, seed=1), policy)
        canary_log = (loop.logs / "canary.log").read_text(errors="replace")
        scraped = httpx.get(f"http://127.0.0.1:{metrics + 1}/metrics", timeout=10).text

    good, harmful = result.good, result.harmful
    # The base model's answers are noise and v1's plain English: its users are satisfied.
    assert good.satisfied.get(1, [0, 0])[0] == good.satisfied.get(1, [0, 0])[1] > 0, good
    assert good.satisfied.get(0, [0, 1])[0] == 0, good
    assert (good.decision, good.decided_by) == ("rollout", "canary"), (good, canary_log)
    assert good.after == {1: sum(good.after.values())}, good  # everyone on v1 afterwards
    assert set(good.after_replicas) == REPLICAS, good  # on both replicas
    # v2 answers in French: every user it met complained; it never reached everyone.
    assert harmful.satisfied.get(2, [1, 1])[0] == 0 and harmful.on_candidate > 0, harmful
    assert (harmful.decision, harmful.decided_by) == ("withdraw", "canary"), (harmful, canary_log)
    assert harmful.after == {1: sum(harmful.after.values())}, harmful  # back on v1
    assert set(harmful.after_replicas) == REPLICAS, harmful
    # Exposure: its share of sessions (routing by hash: about SHARE; 4 sd of slack, since the
    # decider stops on the canary's count, which biases the share up), and the decision needed
    # at least min_sessions of them.
    sd = (SHARE * (1 - SHARE) / max(1, harmful.sessions)) ** 0.5
    assert harmful.exposure <= SHARE + 4 * sd, harmful
    assert (
        harmful.figures is not None and harmful.figures.get("canary_sessions", 0) >= MIN_SESSIONS
    ), harmful.figures
    # Each decision once on the topic.
    assert result.actions[("rollout", 1)] == 1 and result.actions[("withdraw", 2)] == 1, (
        result.actions
    )
    # The operator on the same live loop: each command moves every session to its version
    # (sessions by hash reach both replicas), none failed (a failed request raises).
    assert operated == {"promote 2": 2, "rollback --to 1": 1, "pin 2": 2, "unpin": 1}
    # `up --metrics-port` put the decider's Prometheus metrics on the next port.
    for kind in ("rollout", "withdraw"):
        line = f'liverl_canary_decisions_total{{kind="{kind}",policy="{policy}"}} 1.0'
        assert line in scraped, scraped


def operate(settings: Settings, users: DrillUsers, policy: str) -> dict[str, int | None]:
    """promote the withdrawn v2, roll back to v1, pin v2, unpin. After each, sessions until 6
    in a row, answered by both replicas between them, were answered by the version it should
    serve (at most 80): per command, the version of those last 6 sessions (None: they were
    not all one version, or one replica answered none of them)."""
    from pipeline.versions.commands import versions

    steps = (
        (["promote", "2"], 2),
        (["rollback", "--to", "1"], 1),
        (["pin", "2"], 2),
        (["unpin"], 1),
    )
    seen: dict[str, int | None] = {}
    for command, expected in steps:
        out = CliRunner().invoke(
            versions, [*command, "--policy", policy, "--by", "test"], obj={"settings": settings}
        )
        assert out.exit_code == 0, out.output
        answered: list[tuple[int | None, frozenset[str]]] = []
        for _, version, _ in users.paced():
            answered.append((version, frozenset(users.last_replicas)))
            window = answered[-6:]
            last = {v for v, _ in window}
            both = set().union(*(r for _, r in window)) == REPLICAS
            settled = len(window) == 6 and both and last == {expected}
            if settled or len(answered) >= 80:
                break
        seen[" ".join(command)] = last.pop() if len(last) == 1 and both else None
    return seen
