"""The real default model with LoRA: a training step moves only the adapter, a published
adapter hot-swaps into the hf backend, and served log-probs equal a direct peft forward."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from pipeline.events import Producer, Sample
from pipeline.models import store
from pipeline.serving.backends import lora
from pipeline.serving.backends.base import Done, Piece, SamplingParams
from pipeline.serving.backends.hf import HFBackend
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.core import TrainerCore


@pytest.fixture(scope="module")
def base() -> Path:
    return store.resolve(store.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def backend(base: Path) -> HFBackend:
    return HFBackend(base, policy_id="p", workers=4)


def prompt_ids(tokenizer: object, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])  # type: ignore[operator]


def generate(
    backend: HFBackend, ids: list[int], n: int = 12, **kw: object
) -> tuple[list[int], list[float], int]:
    async def run() -> tuple[list[int], list[float], int]:
        out: list[int] = []
        lps: list[float] = []
        version = -1
        params = SamplingParams(max_tokens=n, **{"temperature": 0.0, **kw})  # type: ignore[arg-type]
        async for item in backend.generate(ids, params):
            if isinstance(item, Piece):
                out += item.token_ids
                lps += item.logprobs
            elif isinstance(item, Done):
                version = item.weight_version
        return out, lps, version

    return asyncio.run(run())


def sample_of(ids: list[int], resp: list[int], lps: list[float], reward: float) -> Sample:
    return Sample(
        event_id="s0",
        producer=Producer(component="t", version="0"),
        session_id="x",
        turn=0,
        policy_id="p",
        prompt_token_ids=ids,
        response_token_ids=resp,
        loss_mask=[1] * len(resp),
        behavior_logprobs=lps,
        reward=reward,
        behavior_weight_version=0,
    )


def test_default_model_answers_in_plain_english(backend: HFBackend) -> None:
    ids = prompt_ids(backend.tokenizer, "What is the capital of France?")
    out, lps, version = generate(backend, ids, n=20)
    text = backend.tokenizer.decode(out, skip_special_tokens=True)
    assert "Paris" in text
    assert version == 0 and len(lps) == len(out) and all(lp <= 0 for lp in lps)
    assert backend.tokenizer.convert_ids_to_tokens(out[-1]) == "<|im_end|>"  # real end of turn


def test_lora_step_moves_only_the_adapter_and_the_version_serves_exactly(
    backend: HFBackend, tmp_path: Path
) -> None:
    # A = r and the full rate at once, so that one step on one sample moves the adapter
    cfg = TrainerSettings(device="cpu", method="rl", lr=5e-3, rl_baseline="none", lr_warmup_steps=0)
    core = TrainerCore.load(cfg)
    assert core.lora and cfg.uses_lora
    before = {n: p.detach().clone() for n, p in core.model.named_parameters()}
    ids = prompt_ids(core.tokenizer, "Give me a tip for sleeping better.")
    resp, lps, _ = generate(backend, ids, n=10)
    result = core.train_step([sample_of(ids, resp, lps, reward=1.0)], current_version=0)
    assert result.trained_tokens == len(resp)
    changed = {n for n, p in core.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed, "the step changed nothing"
    assert all("lora_" in n for n in changed), sorted(changed)[:5]
    assert any("lora_B" in n for n in changed)

    version = tmp_path / "v1"
    core.save_weights(version)
    files = sorted(p.name for p in version.iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    size = (version / "adapter_model.safetensors").stat().st_size
    assert size < 25_000_000  # the adapter only, not the 538 MB base
    manifest = {"base_model": core.base_model_info()}
    (version / "manifest.json").write_text(json.dumps(manifest))

    asyncio.run(backend.reload(version, 1))
    assert backend.version == 1
    out, served, v = generate(backend, ids, n=8)
    assert v == 1
    # Direct forward with the same adapter through peft itself (not the serving wrapper).
    core.model.eval()
    with torch.no_grad():
        full = torch.tensor([ids + out])
        logits = core.model(input_ids=full).logits[0, len(ids) - 1 : -1].float()
        direct = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(served), direct, atol=2e-4), (served, direct.tolist())
    # And the adapter matters: the base alone gives other log-probs for the same tokens.
    with torch.no_grad(), core.model.disable_adapter():
        logits = core.model(input_ids=full).logits[0, len(ids) - 1 : -1].float()
        base_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None])[:, 0]
    assert (base_lp - direct).abs().max() > 1e-3


def test_adapter_for_another_base_is_refused(backend: HFBackend, tmp_path: Path) -> None:
    live = backend.version
    cfg = TrainerSettings(device="cpu", method="rl")
    core = TrainerCore.load(cfg)
    d = tmp_path / "v9"
    core.save_weights(d)
    (d / "manifest.json").write_text(json.dumps({"base_model": {"fingerprint": "0" * 64}}))
    with pytest.raises(ValueError, match="another base model"):
        asyncio.run(backend.reload(d, live + 9))
    assert backend.version == live


def test_adapters_hot_swap_under_concurrent_load(backend: HFBackend, tmp_path: Path) -> None:
    """Five adapter versions while four clients generate: no request fails, every answer
    names a version that was live while it ran, and the versions only move forward."""
    cfg = TrainerSettings(device="cpu", method="rl")
    core = TrainerCore.load(cfg)
    start = backend.version
    dirs = []
    for k in range(5):
        with torch.no_grad():
            for n, p in core.model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.01 * (k + 1))
        d = tmp_path / f"v{start + k + 1}"
        core.save_weights(d)
        dirs.append(d)
    ids = prompt_ids(backend.tokenizer, "Say hi.")

    async def client(seen: list[int]) -> None:
        for _ in range(4):
            params = SamplingParams(max_tokens=4, temperature=1.0)
            last = -1
            async for item in backend.generate(ids, params):
                if isinstance(item, Done):
                    last = item.weight_version
            seen.append(last)

    async def swapper() -> None:
        for k, d in enumerate(dirs):
            await asyncio.sleep(0.05)
            await backend.reload(d, start + k + 1)

    async def main() -> list[list[int]]:
        seen: list[list[int]] = [[] for _ in range(4)]
        await asyncio.gather(*(client(s) for s in seen), swapper())
        return seen

    seen = asyncio.run(main())
    assert all(len(s) == 4 for s in seen)
    assert all(start <= v <= start + 5 for s in seen for v in s)
    assert all(s == sorted(s) for s in seen)  # each client only ever sees newer versions
    assert backend.version == start + 5


def test_lora_module_refuses_what_it_cannot_compute(tmp_path: Path) -> None:
    (tmp_path / lora.CONFIG_FILE).write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": True})
    )
    with pytest.raises(ValueError, match="DoRA"):
        lora.load_adapter(tmp_path, 1)
