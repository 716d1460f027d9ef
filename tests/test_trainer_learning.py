"""Learning test: on a verifiable toy task the trainer core raises the reward of fresh
generations from the tiny model (CPU, in-process, no Kafka)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.events import Producer, Sample
from pipeline.models.tiny import ensure_tiny_model
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.core import TrainerCore

RESPONSE_TOKENS = 4
BATCH = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def digit_ids(tokenizer) -> set[int]:  # type: ignore[no-untyped-def]
    return {i for i in range(len(tokenizer)) if tokenizer.decode([i]).strip().isdigit()}


def prompt_ids(tokenizer) -> list[int]:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "Count from one to five:"}]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@torch.no_grad()
def generate(model, prompt: list[int], n: int, gen: torch.Generator):  # type: ignore[no-untyped-def]
    """Sample n responses with their behavior log-probs (temperature 1, full vocabulary)."""
    ids = torch.tensor([prompt] * n)
    out_tokens, out_logp = [], []
    for _ in range(RESPONSE_TOKENS):
        logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)
        out_tokens.append(nxt)
        out_logp.append(logp.gather(-1, nxt))
        ids = torch.cat([ids, nxt], dim=1)
    return torch.cat(out_tokens, 1).tolist(), torch.cat(out_logp, 1).tolist()


def reward(response: list[int], digits: set[int]) -> float:
    """Verifier: +1 when every token is a number, -1 when none is (linear in between)."""
    return 2.0 * sum(t in digits for t in response) / len(response) - 1.0


def make_samples(core: TrainerCore, prompt: list[int], digits: set[int], gen, hints=()):  # type: ignore[no-untyped-def]
    responses, logps = generate(core.model, prompt, BATCH, gen)
    samples = [
        Sample(
            event_id=f"s{i}",
            producer=Producer(component="test", version="0"),
            session_id=f"sess{i}",
            turn=0,
            policy_id="toy",
            prompt_token_ids=prompt,
            response_token_ids=r,
            loss_mask=[1] * len(r),
            behavior_logprobs=lp,
            reward=reward(r, digits),
            hints=list(hints),
            behavior_weight_version=0,
        )
        for i, (r, lp) in enumerate(zip(responses, logps, strict=True))
    ]
    return samples


def run_training(tiny: Path, method: str, steps: int, hints=(), **cfg_kw) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    cfg = TrainerSettings(model=str(tiny), method=method, lr=2e-2, device="cpu", **cfg_kw)
    core = TrainerCore.load(cfg)
    digits = digit_ids(core.tokenizer)
    prompt = prompt_ids(core.tokenizer)
    gen = torch.Generator().manual_seed(1)

    def mean_reward() -> float:
        core.model.eval()
        rewards = [s.reward for _ in range(4) for s in make_samples(core, prompt, digits, gen)]
        core.model.train()
        return sum(rewards) / len(rewards)

    before = mean_reward()
    for _ in range(steps):
        core.model.eval()
        batch = make_samples(core, prompt, digits, gen, hints)
        core.model.train()
        result = core.train_step(batch, current_version=0)
        assert result.trained_tokens > 0
    return before, mean_reward()


def test_binary_rl_raises_reward(tiny: Path) -> None:
    before, after = run_training(tiny, "rl", steps=30)
    print(f"rl: mean reward {before:.3f} -> {after:.3f}")
    assert before < -0.6
    assert after > before + 0.5


def test_hybrid_raises_reward(tiny: Path) -> None:
    # The teacher is the current policy seeing the hint: a random frozen reference would
    # only pull the policy back to its own (random) distribution.
    hints = ["Answer with numbers: 1 2 3", "Use digits only, like 4 5."]
    before, after = run_training(tiny, "hybrid", steps=30, hints=hints, teacher="policy")
    print(f"hybrid: mean reward {before:.3f} -> {after:.3f}")
    assert after > before + 0.5
