"""Trainer core units: sample checks, batch bounds, teacher prompts, method options."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.events import Producer, Sample
from pipeline.kafka import Record
from pipeline.models.tiny import ensure_tiny_model
from pipeline.trainer.batching import Batcher, check_sample
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.core import TrainerCore
from pipeline.trainer.prompts import ChatMarkers, teacher_prompt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def sample(i: int = 0, prompt: int = 4, response: int = 3, **kw: object) -> Sample:
    fields: dict[str, object] = dict(
        event_id=f"s{i}",
        producer=Producer(component="t", version="0"),
        session_id="x",
        turn=i,
        policy_id="p",
        prompt_token_ids=[1] + [40 + j for j in range(prompt - 1)],
        response_token_ids=[100 + j for j in range(response)],
        loss_mask=[1] * response,
        behavior_logprobs=[-5.0] * response,
        reward=1.0,
        behavior_weight_version=0,
    )
    fields.update(kw)
    return Sample(**fields)  # type: ignore[arg-type]


def rec(s: Sample, partition: int, offset: int) -> Record:
    return Record("in", partition, offset, None, 0, s)


def test_check_sample_reasons() -> None:
    assert check_sample(sample(), 512, 100) is None
    assert "exceeds the vocabulary" in check_sample(
        sample(response_token_ids=[1, 2, 600]), 512, 100
    )  # type: ignore[operator]
    assert "lengths disagree" in check_sample(sample(loss_mask=[1]), 512, 100)  # type: ignore[operator]
    assert "lengths disagree" in check_sample(sample(behavior_logprobs=[0.0]), 512, 100)  # type: ignore[operator]
    assert "exceeds the batch token bound" in check_sample(sample(prompt=98), 512, 100)  # type: ignore[operator]
    assert "empty response" in check_sample(sample(response=0), 512, 100)  # type: ignore[operator]


def test_batches_respect_sample_and_padded_token_bounds() -> None:
    now = [0.0]
    b = Batcher(max_samples=3, max_tokens=40, max_wait_s=5.0, clock=lambda: now[0])
    lengths = [10, 10, 10, 10, 20, 5, 5]
    for i, n in enumerate(lengths):
        b.add(rec(sample(i, prompt=n - 3), partition=i % 2, offset=i // 2))
    assert b.ready()
    taken = []
    while b:
        if not b.ready():
            now[0] += 10  # only the wait bound releases a partial batch
        batch = b.take()
        longest = max(len(r.event.prompt_token_ids) + 3 for r in batch)  # type: ignore[attr-defined]
        assert len(batch) <= 3 and longest * len(batch) <= 40
        taken.append([r.event.event_id for r in batch])
    assert taken == [["s0", "s1", "s2"], ["s3", "s4"], ["s5", "s6"]]


def test_next_offsets_stop_at_first_buffered_record() -> None:
    b = Batcher(max_samples=2, max_tokens=1000, max_wait_s=0)
    for i in range(4):
        b.add(rec(sample(i), partition=0, offset=i))
    b.add(rec(sample(9), partition=1, offset=7))
    b.take()
    # partition 0: offsets 2, 3 still buffered; partition 1: 7 buffered; partition 2: polled to 5
    assert b.next_offsets({0: 4, 1: 8, 2: 5}) == {0: 2, 1: 7, 2: 5}
    b.take()
    b.take()
    assert b.next_offsets({0: 4, 1: 8, 2: 5}) == {0: 4, 1: 8, 2: 5}


def test_hint_is_spliced_into_the_last_user_message(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second"},
    ]

    def render(m: list[dict]) -> list[int]:  # type: ignore[type-arg]
        out = tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    prompt = render(msgs)
    spliced = teacher_prompt(prompt, "run the tests", tok, ChatMarkers.from_tokenizer(tok))
    text = tok.decode(spliced)
    assert text.endswith(
        "second\n\n[user's hint / instruction]\nrun the tests<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text.count("[user's hint") == 1 and "first<|im_end|>" in text


def make_core(tiny: Path, **kw: object) -> TrainerCore:
    return TrainerCore.load(TrainerSettings(model=str(tiny), device="cpu", lr=1e-2, **kw))  # type: ignore[arg-type]


def test_stale_and_masked_samples_get_no_gradient(tiny: Path) -> None:
    core = make_core(tiny, max_staleness=1)
    before = [p.detach().clone() for p in core.model.parameters()]
    batch = [
        sample(0, behavior_weight_version=3),
        sample(1, masked=True),
        sample(2, loss_mask=[0, 0, 0]),
    ]
    result = core.train_step(batch, current_version=5)
    assert [o.status for o in result.outcomes] == ["stale_dropped", "masked", "masked"]
    assert result.dropped_stale == 1 and result.trained_tokens == 0
    assert all(torch.equal(a, b) for a, b in zip(before, core.model.parameters(), strict=True))
    result = core.train_step([sample(0, behavior_weight_version=4)], current_version=5)
    assert result.outcomes[0].status == "trained" and result.trained_tokens == 3


def test_tis_keeps_stale_samples_with_truncated_weights(tiny: Path) -> None:
    core = make_core(tiny, staleness="tis", max_staleness=0)
    result = core.train_step([sample(0, behavior_weight_version=0)], current_version=4)
    assert result.outcomes[0].status == "trained" and result.outcomes[0].staleness == 4
    assert result.trained_tokens == 3 and result.grad_norm and result.grad_norm > 0


@pytest.mark.parametrize(
    ("loss", "selection", "subset"),
    [
        ("token", "sequence", "student"),
        ("topk", "token", "overlap"),
        ("topk", "shortest", "teacher"),
    ],
)
def test_opd_variants_select_a_hint_and_step(
    tiny: Path, loss: str, selection: str, subset: str
) -> None:
    core = make_core(
        tiny, method="opd", opd_loss=loss, hint_selection=selection, topk_subset=subset
    )
    hints = ["use the grep output first", "run pytest", "a much longer hint about the tests"]
    batch = [sample(0, hints=hints), sample(1)]
    result = core.train_step(batch, current_version=0)
    assert result.outcomes[0].selected_hint in hints
    assert result.outcomes[1].status == "no_hint"
    assert result.trained_tokens == 3
    if selection == "shortest":
        assert result.outcomes[0].selected_hint == "run pytest"
    assert set(result.losses) == {"opd", "total"}


def test_hybrid_reports_both_parts_and_gradient_checkpointing_runs(tiny: Path) -> None:
    core = make_core(tiny, method="hybrid", gradient_checkpointing=True, w_opd=0.5)
    result = core.train_step([sample(0, hints=["run pytest"]), sample(1)], current_version=0)
    assert set(result.losses) == {"rl", "opd", "total"}
    assert result.losses["total"] == pytest.approx(
        result.losses["rl"] + 0.5 * result.losses["opd"], abs=1e-5
    )
