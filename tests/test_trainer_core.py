"""Trainer core units: sample checks, batch bounds, teacher prompts, method options."""

from __future__ import annotations

import dataclasses
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


def test_idle_input_releases_a_partial_batch_but_steady_input_fills_it() -> None:
    now = [0.0]
    b = Batcher(max_samples=4, max_tokens=1000, max_wait_s=2.0, clock=lambda: now[0], idle_s=0.3)
    b.add(rec(sample(0), partition=0, offset=0))
    now[0] = 0.2
    b.add(rec(sample(1), partition=0, offset=1))
    now[0] = 0.45  # 0.25 s since the last arrival: still within the idle gap
    assert not b.ready()
    now[0] = 0.5  # 0.3 s without input: train the two now, not at the 2 s wait bound
    assert b.ready() and [r.offset for r in b.take()] == [0, 1]
    # Under load a sample arrives every 0.1 s: never idle, so the batch fills to 4.
    for i in range(2, 6):
        now[0] += 0.1
        b.add(rec(sample(i), partition=0, offset=i))
        assert b.ready() == (i == 5)
    assert len(b.take()) == 4
    # While the publish budget holds the next version back, idleness releases nothing early:
    # only a full batch or the wait bound.
    b.add(rec(sample(6), partition=0, offset=6))
    now[0] += 0.5
    assert not b.ready(publish_now=False) and b.ready(publish_now=True)
    now[0] += 1.5  # 2.0 s since it arrived: the wait bound applies whatever the budget
    assert b.ready(publish_now=False)
    b.take()
    off = Batcher(max_samples=4, max_tokens=1000, max_wait_s=2.0, clock=lambda: now[0])
    off.add(rec(sample(9), partition=0, offset=9))
    now[0] += 1.0
    assert not off.ready()  # idle_s = 0: only a full batch or the wait bound


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
    # written for Binary RL and one update per batch (the old defaults): pinned here
    kw.setdefault("method", "rl")
    kw.setdefault("ppo_epochs", 1)
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
    # one sample: its own batch-mean baseline would zero the advantage, so A = r here
    core = make_core(tiny, staleness="tis", max_staleness=0, rl_baseline="none")
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


def test_opd_only_sample_trains_in_opd_and_hybrid_but_not_in_rl(tiny: Path) -> None:
    # A hinted turn with a zero score: no RL tokens, every token in the OPD mask.
    opd_only = sample(0, reward=0.0, loss_mask=[0, 0, 0], opd_mask=[1, 1, 1], hints=["run pytest"])
    runs = (("opd", "trained", 3), ("hybrid", "trained", 3), ("rl", "masked", 0))
    for method, status, tokens in runs:
        # ratio reference = the trainer's own log-probs: ρ = 1, so no token is clipped away
        core = make_core(tiny, method=method, old_logprobs="trainer")
        before = [p.detach().clone() for p in core.model.parameters()]
        result = core.train_step([opd_only], current_version=0)
        assert (result.outcomes[0].status, result.trained_tokens) == (status, tokens), method
        changed = any(
            not torch.equal(a, b) for a, b in zip(before, core.model.parameters(), strict=True)
        )
        assert changed == (method != "rl"), method
    # An older event without opd_mask: OPD follows the (zero) loss mask, as before.
    legacy = sample(0, reward=0.0, loss_mask=[0, 0, 0], hints=["run pytest"])
    result = make_core(tiny, method="opd").train_step([legacy], current_version=0)
    assert result.outcomes[0].status == "masked" and result.trained_tokens == 0


def test_hybrid_averages_opd_over_the_batch_and_opd_over_hinted_rows(tiny: Path) -> None:
    # Teacher = frozen copy of the same weights and ratio reference = the trainer's own
    # log-probs, so the OPD row's per-row mean is the same under both methods; hybrid divides
    # it by the 2 rows of the batch, opd by its 1 hinted row (the reference's OPD batches hold
    # hinted turns only).
    batch = [
        sample(0, reward=0.0, loss_mask=[0, 0, 0], opd_mask=[1, 1, 1], hints=["run pytest"]),
        sample(1, reward=1.0, opd_mask=[0, 0, 0]),
    ]
    opd = make_core(tiny, method="opd", old_logprobs="trainer").train_step(batch, 0)
    hybrid = make_core(tiny, method="hybrid", old_logprobs="trainer").train_step(batch, 0)
    assert opd.losses["opd"] != 0.0
    assert hybrid.losses["opd"] == pytest.approx(opd.losses["opd"] / 2, rel=1e-5)
    assert [o.status for o in opd.outcomes] == ["trained", "no_hint"]


def _own_logprobs(core: TrainerCore, batch: list[Sample]) -> list[list[float]]:
    """Behaviour log-probs as the trainer's own forward pass computes them (same batch)."""
    from pipeline.trainer import losses as L

    with torch.no_grad():
        logits = core._response_logits(
            core.model, [s.prompt_token_ids for s in batch], [s.response_token_ids for s in batch]
        )
        rmax = max(len(s.response_token_ids) for s in batch)
        ids = torch.tensor(
            [s.response_token_ids + [0] * (rmax - len(s.response_token_ids)) for s in batch]
        )
        logp = L.token_logprobs(logits, ids)
    return [logp[b, : len(s.response_token_ids)].tolist() for b, s in enumerate(batch)]


def test_logprob_drift_is_zero_with_the_same_weights_and_not_after_a_step(tiny: Path) -> None:
    core = make_core(tiny)
    batch = [sample(0, response=5), sample(1, prompt=6, response=3, reward=-1.0)]
    batch = [
        dataclasses.replace(s, behavior_logprobs=lp)
        for s, lp in zip(batch, _own_logprobs(core, batch), strict=True)
    ]
    first = core.train_step(batch, current_version=0)
    assert first.metrics["logprob_drift_mean"] == 0.0
    assert first.metrics["logprob_drift_max"] == 0.0
    assert first.metrics["logprob_drift_tokens"] == 8.0
    assert first.metrics["policy_lag_steps"] == 0.0
    # A second step at the same version (several steps share one version under the publish
    # budget): the weights moved (lr 1e-2), so the difference would be learning, not the
    # engine. Before (issue 23) this reported mean 0.68 / max 1.29 with no engine involved.
    second = core.train_step(batch, current_version=0)
    assert "logprob_drift_mean" not in second.metrics
    assert second.metrics["policy_lag_steps"] == 1.0
    # stale samples are not at the behaviour version: no drift figure from them
    third = core.train_step(batch, current_version=1)
    assert "logprob_drift_mean" not in third.metrics and third.metrics["policy_lag_steps"] == 0
    # samples of version 1 as the trainer's weights are now (as if just published): 0 again
    fresh = [
        dataclasses.replace(s, behavior_logprobs=lp, behavior_weight_version=2)
        for s, lp in zip(batch, _own_logprobs(core, batch), strict=True)
    ]
    fourth = core.train_step(fresh, current_version=2)
    assert fourth.metrics["logprob_drift_max"] == pytest.approx(0.0, abs=1e-6)
    assert fourth.metrics["logprob_drift_tokens"] == 8.0


def test_old_logprobs_trainer_makes_the_ratio_one(tiny: Path) -> None:
    # behaviour log-probs far from the model's: with the engine reference every token is
    # clipped away (ρ ≫ 1.28, A > 0), with the trainer's own recomputation ρ = 1 and it trains.
    batch = [sample(0, behavior_logprobs=[-30.0] * 3)]
    engine = make_core(tiny, rl_baseline="none").train_step(batch, 0)
    trainer = make_core(tiny, old_logprobs="trainer", rl_baseline="none").train_step(batch, 0)
    assert engine.clip_fraction == 1.0 and engine.grad_norm == 0.0
    assert trainer.clip_fraction == 0.0 and trainer.kl == 0.0 and trainer.grad_norm


def test_hf_backend_logprob_drift(tiny: Path) -> None:
    """Engine (hf backend, token by token with a KV cache) vs trainer (one padded forward):
    the figure docs/benchmarks.md quotes."""
    import asyncio

    from pipeline.serving.backends.base import Done, SamplingParams
    from pipeline.serving.backends.hf import HFBackend

    backend = HFBackend(tiny, workers=1)

    async def gen(prompt: list[int], seed: int) -> tuple[list[int], list[float]]:
        ids: list[int] = []
        lps: list[float] = []
        async for item in backend.generate(prompt, SamplingParams(max_tokens=32, seed=seed)):
            if not isinstance(item, Done):
                ids += item.token_ids
                lps += item.logprobs
        return ids, lps

    batch = []
    for i in range(8):
        prompt = [1] + [40 + (7 * i + j) % 300 for j in range(16 + 4 * i)]
        ids, lps = asyncio.run(gen(prompt, seed=i))
        batch.append(
            sample(
                i,
                prompt_token_ids=prompt,
                response_token_ids=ids,
                loss_mask=[1] * len(ids),
                behavior_logprobs=lps,
            )
        )
    asyncio.run(backend.close())
    m = make_core(tiny).train_step(batch, current_version=0).metrics
    n = m["logprob_drift_tokens"]
    print(
        f"hf backend vs trainer log-prob drift (tiny model, fp32 CPU, {n:.0f} tokens): "
        f"mean {m['logprob_drift_mean']:.2e}, max {m['logprob_drift_max']:.2e}"
    )
    assert m["logprob_drift_max"] < 1e-3


def test_rows_with_nothing_to_train_skip_the_forward_pass_but_count(tiny: Path) -> None:
    """A masked closing turn costs no forward pass, yet still counts as a batch row: with
    slime's per-sample mean, [a, masked] gives half the loss of [a] alone."""
    alone = make_core(tiny).train_step([sample(0, reward=1.0)], current_version=0)
    core = make_core(tiny)
    seen: list[int] = []
    real = core._response_logits

    def spy(model: object, prompts: list, responses: list) -> torch.Tensor:  # type: ignore[type-arg]
        seen.append(len(prompts))
        return real(model, prompts, responses)

    core._response_logits = spy  # type: ignore[method-assign]
    mixed = core.train_step([sample(0, reward=1.0), sample(1, masked=True)], current_version=0)
    assert seen == [1]  # only the active row went through the model
    assert mixed.losses["total"] == pytest.approx(alone.losses["total"] / 2, rel=1e-5)
    assert [o.status for o in mixed.outcomes] == ["trained", "masked"]
    idle = make_core(tiny)
    before = [p.detach().clone() for p in idle.model.parameters()]
    nothing = idle.train_step([sample(1, masked=True)], current_version=0)
    assert nothing.trained_tokens == 0 and nothing.losses["total"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, idle.model.parameters(), strict=True))


def test_kl_to_reference_is_zero_at_the_reference_then_positive(tiny: Path) -> None:
    core = make_core(tiny, kl_coef=0.5, rl_baseline="none")  # one sample: A = r
    assert core.reference is not None  # a frozen copy is kept for the KL term
    first = core.train_step([sample(0, reward=1.0)], current_version=0)
    assert first.metrics["kl_ref"] == pytest.approx(0.0, abs=1e-7)
    second = core.train_step([sample(1, reward=1.0)], current_version=0)
    assert second.metrics["kl_ref"] > 0
    assert second.losses["total"] == pytest.approx(
        second.losses["rl"] + 0.5 * second.losses["kl"], rel=1e-5
    )


def test_all_negative_batch_gives_no_push_away_with_the_batch_baseline(tiny: Path) -> None:
    """A = r − mean(r): a batch rewarded −1 throughout has nothing to push away from (zero
    gradient, no KL term); the old A = r moves the weights."""
    batch = [sample(0, reward=-1.0), sample(1, reward=-1.0)]
    default = make_core(tiny, old_logprobs="trainer").train_step(batch, 0)
    assert default.metrics["baseline"] == -1.0 and default.grad_norm == 0.0
    plain = make_core(tiny, rl_baseline="none", old_logprobs="trainer").train_step(batch, 0)
    assert plain.grad_norm and plain.grad_norm > 0


def test_ppo_epochs_take_several_updates_on_one_batch(tiny: Path) -> None:
    """Two epochs: two Adam updates on one batch, the ratio taken against the sampling
    log-probs in both (the second epoch sees ρ ≠ 1); the step reports its first epoch."""
    batch = [sample(0, reward=1.0, behavior_logprobs=[-4.6] * 3), sample(1, reward=-1.0)]
    core = make_core(
        tiny, ppo_epochs=2, lr_warmup_steps=0, rl_baseline="none", old_logprobs="trainer"
    )
    result = core.train_step(batch, 0)
    assert core.updates_done() == 2 and core.step == 1
    assert result.metrics["epochs"] == 2.0
    assert result.kl == pytest.approx(0.0, abs=1e-7)  # epoch 0: ρ = 1
    assert result.metrics["approx_kl_last"] > 0  # epoch 1: the first update moved ρ


def test_lr_warm_up_scales_the_first_updates(tiny: Path) -> None:
    core = TrainerCore.load(
        TrainerSettings(
            model=str(tiny),
            device="cpu",
            lr=1e-4,
            method="rl",
            ppo_epochs=1,
            lr_warmup_steps=4,
            rl_baseline="none",
            old_logprobs="trainer",
        )
    )
    lrs = []
    for v in range(5):
        result = core.train_step([sample(0, reward=1.0, behavior_weight_version=v)], v)
        assert result.grad_norm
        lrs.append(core.optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([1e-4 * f for f in (0.25, 0.5, 0.75, 1.0, 1.0)])


# ---- issue 38: the batch baseline neither re-centres group advantages nor lifts a failure ----


def _rl_advantages(core: TrainerCore, batch: list[Sample]) -> list[float]:
    """Each row's Binary-RL advantage A = r − b on its first token, as the step computes it."""
    from pipeline.trainer import losses as L

    b = core._prepare(batch, 0, None)
    return L.binary_rl_advantages(b.rewards, b.mask_rl, b.baseline)[:, 0].tolist()


def test_a_failed_turn_gets_no_positive_advantage_from_the_batch_mean(tiny: Path) -> None:
    """Issue 38 repro: a judged −1 turn and a failed turn whose reward outcome_bound clamped
    to 0. The batch mean b = (−1 + 0) / 2 = −0.5 gave the failed turn A = 0 + 0.5 = +0.5 (and
    one step raised its log-prob by about +0.45). Now A = min(0 − (−0.5), 0) = 0; the judged
    turn keeps A = −1 − (−0.5) = −0.5. Measured on the tiny model, one step (lr 1e-2) raised
    the sum of the failed turn's 3 token log-probs by +1.86 before; now +0.13, what
    rl_baseline = "none" gives too (A = 0: only the shared weights' side effect)."""
    judged = sample(0, reward=-1.0)
    failed = sample(1, prompt=6, reward=0.0, outcome=-1.0,
                    response_token_ids=[200, 201, 202])  # fmt: skip
    batch = [judged, failed]
    core = make_core(tiny, old_logprobs="trainer")
    assert _rl_advantages(core, batch) == pytest.approx([-0.5, 0.0])
    before = sum(_own_logprobs(core, [failed])[0])
    core.train_step(batch, 0)
    assert sum(_own_logprobs(core, [failed])[0]) - before < 0.5


def test_group_normalised_rewards_are_not_re_centred_by_the_batch(tiny: Path) -> None:
    """Two z-scored attempts of a group (A = −1, +1: already centred in their group) and two
    ungrouped judged −1 turns. Before: b = (−1 + 1 − 1 − 1) / 4 = −0.5 for every row, so the
    group's advantages became −0.5 and +1.5. Now a normalised row takes b = 0 (A = −1, +1)
    and the ungrouped ones the mean of the ungrouped rows, b = −1 (A = 0, 0)."""
    g = dict(group_id="g", step_index=0, normalized=True)
    batch = [sample(0, reward=-1.0, **g), sample(1, reward=1.0, **g),
             sample(2, reward=-1.0), sample(3, reward=-1.0)]  # fmt: skip
    core = make_core(tiny)
    assert _rl_advantages(core, batch) == pytest.approx([-1.0, 1.0, 0.0, 0.0])
    result = core.train_step(batch, 0)
    assert result.metrics["baseline"] == pytest.approx(-1.0)  # the ungrouped rows' mean
    # with rl_baseline = "none" only the failure bound remains: A = r, a failure at most 0
    plain = make_core(tiny, rl_baseline="none")
    lifted = [sample(0, reward=0.5, outcome=-1.0), sample(1, reward=-1.0)]  # an old record
    assert _rl_advantages(plain, lifted) == pytest.approx([0.0, -1.0])
