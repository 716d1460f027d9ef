"""Hand-checked values for pipeline.trainer.losses (CPU, tiny tensors).

Reference numbers used below (ε = 0.2, ε_hi = 0.28 → clip range [0.8, 1.28]):

    e^{0.1}  = 1.105171   inside [0.8, 1.28]
    e^{0.5}  = 1.648721   above 1.28
    e^{-0.5} = 0.606531   below 0.8
    k3(Δ) = e^Δ − 1 − Δ:  k3(0.1) = 0.005171, k3(0.5) = 0.148721, k3(−0.5) = 0.106531
"""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.trainer.losses import (
    Aggregate,
    LossOutput,
    batch_mean_baseline,
    binary_rl_advantages,
    binary_rl_loss,
    hybrid_advantage_loss,
    hybrid_advantages,
    hybrid_loss,
    kl_to_reference,
    masked_aggregate,
    opd_advantages,
    opd_loss,
    ppo_clip_loss,
    row_baselines,
    staleness_keep_mask,
    tis_weights,
    token_logprobs,
    topk_logprobs,
    topk_opd_loss,
    warmup_factor,
)

E01, E05, EM05 = math.exp(0.1), math.exp(0.5), math.exp(-0.5)


def k3(d: float) -> float:
    return math.exp(d) - 1.0 - d


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# Two sequences, three tokens each; ℓ_old = 0 so ℓ_cur − ℓ_old = Δ.
DELTA = [[0.1, 0.5, -0.5], [-0.5, 0.5, 0.1]]
REWARDS = [1.0, -1.0]
# Per-token losses by hand, l = max(−ρA, −clip(ρ)·A):
#  seq0, A = +1:
#   Δ=0.1:  ρ=1.105171 in range          → l = −1.105171             (unclipped)
#   Δ=0.5:  ρ=1.648721 > 1.28: max(−1.648721, −1.28) = −1.28         (CLIPPED)
#   Δ=−0.5: ρ=0.606531 < 0.8:  max(−0.606531, −0.8)  = −0.606531     (unclipped, pessimistic)
#  seq1, A = −1:
#   Δ=−0.5: ρ=0.606531 < 0.8:  max(0.606531, 0.8)    = 0.8           (CLIPPED)
#   Δ=0.5:  ρ=1.648721 > 1.28: max(1.648721, 1.28)   = 1.648721      (unclipped)
#   Δ=0.1:  ρ=1.105171 in range          → l = 1.105171              (unclipped)
L_HAND = [[-E01, -1.28, -EM05], [0.8, E05, E01]]


def _binary(mask: list, aggregate: Aggregate = "token_mean") -> tuple[LossOutput, torch.Tensor]:
    logp_cur = t(DELTA).requires_grad_(True)
    out = binary_rl_loss(
        logp_cur, torch.zeros(2, 3, dtype=torch.float64), t(REWARDS), t(mask), aggregate=aggregate
    )
    return out, logp_cur


def test_token_logprobs_gathers_log_softmax() -> None:
    # logits [0, ln 3]: p = [1/4, 3/4]
    logits = t([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    got = token_logprobs(logits, torch.tensor([[1, 0]]))
    assert got.shape == (1, 2)
    assert got[0, 0].item() == pytest.approx(math.log(0.75))
    assert got[0, 1].item() == pytest.approx(math.log(0.25))


def test_topk_logprobs_values_and_indices() -> None:
    logits = t([[1.0, 3.0, 2.0, 0.0]])
    z = math.log(math.e**1 + math.e**3 + math.e**2 + math.e**0)
    values, indices = topk_logprobs(logits, k=2)
    assert indices.tolist() == [[1, 2]]
    assert values[0].tolist() == pytest.approx([3.0 - z, 2.0 - z])


def test_binary_rl_advantages_are_reward_on_every_unmasked_token() -> None:
    adv = binary_rl_advantages(t([0.5, -1.0]), t([[1, 1, 0], [0, 1, 1]]))
    assert adv.tolist() == [[0.5, 0.5, 0.0], [0.0, -1.0, -1.0]]


def test_binary_rl_both_clip_branches_and_metrics() -> None:
    out, logp_cur = _binary([[1, 1, 1], [1, 1, 1]])
    expected = sum(sum(row) for row in L_HAND) / 6  # = 0.56219 / 6 = 0.093698
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.metrics["loss"] == pytest.approx(expected, abs=1e-6)
    assert out.metrics["clip_fraction"] == pytest.approx(2 / 6)  # seq0 Δ=0.5 and seq1 Δ=−0.5
    # each Δ ∈ {0.1, 0.5, −0.5} appears twice
    assert out.metrics["approx_kl"] == pytest.approx((k3(0.1) + k3(0.5) + k3(-0.5)) / 3)
    assert out.metrics["mean_advantage"] == pytest.approx(0.0)  # three +1, three −1

    # gradient: unclipped token → dl/dℓ_cur = −ρ·A / N; clipped token → 0
    out.loss.backward()
    grad = logp_cur.grad
    assert grad is not None
    assert grad[0].tolist() == pytest.approx([-E01 / 6, 0.0, -EM05 / 6])
    assert grad[1].tolist() == pytest.approx([0.0, E05 / 6, E01 / 6])


def test_masked_tokens_do_not_count_token_vs_seq_mean() -> None:
    mask = [[1, 1, 0], [0, 0, 1]]
    out, logp_cur = _binary(mask, "token_mean")
    # token mean: (−1.105171 − 1.28 + 1.105171) / 3 = −0.426667
    assert out.loss.item() == pytest.approx((-E01 - 1.28 + E01) / 3)
    assert out.metrics["clip_fraction"] == pytest.approx(1 / 3)
    assert out.metrics["mean_advantage"] == pytest.approx((1 + 1 - 1) / 3)
    assert out.metrics["approx_kl"] == pytest.approx((k3(0.1) + k3(0.5) + k3(0.1)) / 3)
    out.loss.backward()
    assert logp_cur.grad is not None
    assert logp_cur.grad[0, 2].item() == 0.0 and logp_cur.grad[1, 0].item() == 0.0

    seq, _ = _binary(mask, "seq_mean")
    # seq mean: mean((−1.105171 − 1.28)/2, 1.105171/1) = mean(−1.192586, 1.105171) = −0.043707
    assert seq.loss.item() == pytest.approx(((-E01 - 1.28) / 2 + E01) / 2)


def test_seq_mean_skips_fully_masked_sequences_and_all_masked_is_zero() -> None:
    only_seq0, _ = _binary([[1, 1, 1], [0, 0, 0]], "seq_mean")
    assert only_seq0.loss.item() == pytest.approx((-E01 - 1.28 - EM05) / 3)
    aggs: list[Aggregate] = ["sample_mean", "token_mean", "seq_mean"]
    for agg in aggs:
        empty, logp_cur = _binary([[0, 0, 0], [0, 0, 0]], agg)
        assert empty.loss.item() == 0.0
        empty.loss.backward()
        assert logp_cur.grad is not None and torch.all(logp_cur.grad == 0)
    with pytest.raises(ValueError):
        masked_aggregate(t([[1.0]]), t([[1.0]]), "sum")  # type: ignore[arg-type]


# Ragged batch: row 0 has 3 tokens, row 1 has 1 (then padding), row 2 is fully masked.
RAGGED_X = [[1.0, 2.0, 3.0], [6.0, 100.0, 100.0], [5.0, 5.0, 5.0]]
RAGGED_M = [[1, 1, 1], [1, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize(
    ("agg", "value", "grad"),
    [
        # slime: per-row mean (2, 6, 0 for the masked row) averaged over all 3 rows = 8/3;
        # d/dx = 1/(3 rows · row count): row 0 → 1/9 per token, row 1 → 1/3
        ("sample_mean", 8 / 3, [[1 / 9] * 3, [1 / 3, 0, 0], [0, 0, 0]]),
        # token mean: (1 + 2 + 3 + 6) / 4 = 3; 1/4 on each unmasked token
        ("token_mean", 3.0, [[0.25] * 3, [0.25, 0, 0], [0, 0, 0]]),
        # seq mean leaves the masked row out: (2 + 6) / 2 = 4; row 0 → 1/6, row 1 → 1/2
        ("seq_mean", 4.0, [[1 / 6] * 3, [0.5, 0, 0], [0, 0, 0]]),
    ],
)
def test_aggregations_on_a_ragged_batch_with_a_fully_masked_row(
    agg: Aggregate, value: float, grad: list
) -> None:
    x = t(RAGGED_X).requires_grad_(True)
    out = masked_aggregate(x, t(RAGGED_M), agg)
    assert out.item() == pytest.approx(value)
    out.backward()
    assert x.grad is not None
    assert x.grad.tolist() == [pytest.approx(row) for row in grad]


def test_sample_mean_binary_rl_counts_a_fully_masked_row_as_zero() -> None:
    out, logp_cur = _binary([[1, 1, 0], [0, 0, 0]], "sample_mean")
    # row 0: (−1.105171 − 1.28) / 2 = −1.192586; row 1: 0 → mean over 2 rows = −0.596293
    assert out.loss.item() == pytest.approx((-E01 - 1.28) / 4)
    out.loss.backward()
    assert logp_cur.grad is not None
    # unclipped token 0 of row 0: −ρ·A / (2 tokens · 2 rows); the clipped token: 0
    assert logp_cur.grad[0].tolist() == pytest.approx([-E01 / 4, 0.0, 0.0])
    assert logp_cur.grad[1].tolist() == [0.0, 0.0, 0.0]


def test_norm_mask_shares_one_denominator_between_terms() -> None:
    # values count only where m = 1 (token 0 of row 0) but are divided by n's counts:
    # sample_mean: (1 / 3 + 0 + 0) / 3 rows = 1/9; token_mean: 1 / 4 tokens of n
    x, m = t(RAGGED_X), t([[1, 0, 0], [0, 0, 0], [0, 0, 0]])
    assert masked_aggregate(x, m, "sample_mean", t(RAGGED_M)).item() == pytest.approx(1 / 9)
    assert masked_aggregate(x, m, "token_mean", t(RAGGED_M)).item() == pytest.approx(1 / 4)


def test_opd_only_row_in_hybrid_is_averaged_over_the_batch() -> None:
    # Row 0: RL only (reward 1, Δ = [0.1, 0]); row 1: a hinted turn with reward 0, OPD only
    # (ρ = 1, teacher gap [0.5, −2.0] → A = [0.5, −1]). Both terms are normalised by the union
    # mask (all 4 tokens) and averaged over the 2 rows (slime's sample mean over the batch).
    logp_old = torch.zeros(2, 2, dtype=torch.float64)
    logp_cur = t([[0.1, 0.0], [0.0, 0.0]]).requires_grad_(True)
    mask_rl, mask_opd = t([[1, 1], [0, 0]]), t([[0, 0], [1, 1]])
    union = t([[1, 1], [1, 1]])
    rl = binary_rl_loss(
        logp_cur, logp_old, t([1.0, 0.0]), mask_rl, aggregate="sample_mean", norm_mask=union
    )
    opd = opd_loss(
        logp_cur,
        logp_old,
        t([[0.0, 0.0], [0.5, -2.0]]),
        mask_opd,
        aggregate="sample_mean",
        norm_mask=union,
    )
    # RL, row 0: (−e^{0.1} − 1) / 2 = −1.052585, row 1: 0 → / 2 rows = −0.526293
    assert rl.loss.item() == pytest.approx((-E01 - 1.0) / 4)
    # OPD, row 1: (−0.5 + 1) / 2 = 0.25, row 0: 0 → / 2 rows = 0.125
    assert opd.loss.item() == pytest.approx(0.125)
    opd.loss.backward()
    assert logp_cur.grad is not None
    # d/dℓ of the OPD-only row: −ρ·A / (2 tokens · 2 rows) = [−0.125, 0.25]; row 0 gets none
    assert logp_cur.grad.tolist() == [[0.0, 0.0], pytest.approx([-0.125, 0.25])]


def test_opd_advantage_clips_at_plus_minus_c() -> None:
    # ℓ_T − ℓ_old = [2.0, −3.0, 0.4, −0.7] → clip to [−1, 1] → [1.0, −1.0, 0.4, −0.7]
    adv = opd_advantages(t([[1.5, -3.5, -0.1, -1.2]]), t([[-0.5, -0.5, -0.5, -0.5]]))
    assert adv[0].tolist() == pytest.approx([1.0, -1.0, 0.4, -0.7])
    # a different C
    adv2 = opd_advantages(t([[1.5, -3.5]]), t([[-0.5, -0.5]]), clip_c=2.5)
    assert adv2[0].tolist() == pytest.approx([2.0, -2.5])


def test_opd_loss_uses_clipped_advantage_in_ppo_surrogate() -> None:
    logp_old = t([[-1.0, -1.0, -1.0]])
    teacher = t([[1.0, -4.0, -0.6]])  # gaps 2.0, −3.0, 0.4 → A = [1, −1, 0.4]
    logp_cur = logp_old + t([[0.5, -0.5, 0.1]])
    out = opd_loss(logp_cur, logp_old, teacher, t([[1, 1, 1]]))
    # A=1,   ρ=1.648721 → clipped −1.28
    # A=−1,  ρ=0.606531 → clipped 0.8
    # A=0.4, ρ=1.105171 → −0.4·1.105171 = −0.442068
    expected = (-1.28 + 0.8 - 0.4 * E01) / 3
    assert out.loss.item() == pytest.approx(expected)
    assert out.metrics["clip_fraction"] == pytest.approx(2 / 3)
    assert out.metrics["mean_advantage"] == pytest.approx((1 - 1 + 0.4) / 3)


def test_ppo_clip_loss_with_explicit_advantages_and_weights() -> None:
    # A = [2, −0.5], ρ = [1, e^{0.5}], w = [0.5, 2]
    # tok0: −1·2 = −2, ×0.5 → −1
    # tok1: A<0, ρ=1.648721 > 1.28 → unclipped 0.5·1.648721 = 0.824361, ×2 → 1.648721
    out = ppo_clip_loss(
        t([[0.0, 0.5]]), t([[0.0, 0.0]]), t([[2.0, -0.5]]), t([[1, 1]]), weights=t([[0.5, 2.0]])
    )
    assert out.loss.item() == pytest.approx((-1.0 + E05) / 2)
    assert out.metrics["clip_fraction"] == 0.0


def _topk_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # one token, S = three vocab entries
    logp_old = t([[[math.log(0.5), math.log(0.3), math.log(0.1)]]])
    teacher = t([[[math.log(0.15), math.log(0.45), math.log(0.3)]]])
    logp_cur = logp_old + t([[[0.5, -0.5, 0.5]]])
    return logp_cur, logp_old, teacher


def _topk_hand(old: list[float], teach: list[float], delta: list[float]) -> float:
    """Plain-python reference: Σ_v max(−A_v ρ_v, −A_v clip(ρ_v)), A_v = clip(gap)·w_v."""
    z = sum(old)
    total = 0.0
    for p_old, p_t, d in zip(old, teach, delta, strict=True):
        w = p_old / z  # softmax of log-probs over S = renormalised probs
        a = max(-1.0, min(1.0, math.log(p_t / p_old))) * w
        rho = math.exp(d)
        total += max(-a * rho, -a * min(max(rho, 0.8), 1.28))
    return total


def test_topk_opd_loss_value() -> None:
    logp_cur, logp_old, teacher = _topk_inputs()
    out = topk_opd_loss(logp_cur, logp_old, teacher, t([[1]]))
    # w = [0.5, 0.3, 0.1] / 0.9 = [0.555556, 0.333333, 0.111111]
    # gaps: ln(0.3) = −1.203973 → −1; ln(1.5) = 0.405465; ln(3) = 1.098612 → 1
    # A = [−0.555556, 0.135155, 0.111111]
    # v0: A<0, ρ=1.648721: max(0.915956, 0.711111) = 0.915956   (unclipped)
    # v1: A>0, ρ=0.606531: max(−0.081975, −0.108124) = −0.081975 (unclipped)
    # v2: A>0, ρ=1.648721: max(−0.183191, −0.142222) = −0.142222 (CLIPPED)
    # sum = 0.691759
    assert out.loss.item() == pytest.approx(0.691759, abs=1e-6)
    assert out.loss.item() == pytest.approx(
        _topk_hand([0.5, 0.3, 0.1], [0.15, 0.45, 0.3], [0.5, -0.5, 0.5])
    )
    assert out.metrics["clip_fraction"] == pytest.approx(1 / 3)
    assert out.metrics["mean_advantage"] == pytest.approx(-0.555556 + 0.135155 + 0.111111, abs=1e-6)
    assert out.metrics["approx_kl"] == pytest.approx((k3(0.5) * 2 + k3(-0.5)) / 3)


def test_topk_opd_loss_subset_mask_and_full_vocab_indices() -> None:
    logp_cur, logp_old, teacher = _topk_inputs()
    # S = {v0, v1}: w = [0.5, 0.3] / 0.8 = [0.625, 0.375]
    # A = [−0.625, 0.375·0.405465 = 0.152049]
    # v0: max(0.625·1.648721, 0.625·1.28) = 1.030451; v1: max(−0.092223, −0.121639) = −0.092223
    sub = topk_opd_loss(
        logp_cur, logp_old, teacher, t([[1]]), subset_mask=torch.tensor([[[True, True, False]]])
    )
    assert sub.loss.item() == pytest.approx(1.030451 - 0.092223, abs=1e-6)
    assert sub.loss.item() == pytest.approx(_topk_hand([0.5, 0.3], [0.15, 0.45], [0.5, -0.5]))

    # same numbers from full [B, T, V] tensors plus indices (V = 5, S at ids 3, 0, 4)
    pad = t([[[-9.0] * 5]])
    full_cur, full_old, full_teacher = pad.clone(), pad.clone(), pad.clone()
    idx = torch.tensor([[[3, 0, 4]]])
    full_cur.scatter_(-1, idx, logp_cur)
    full_old.scatter_(-1, idx, logp_old)
    full_teacher.scatter_(-1, idx, teacher)
    full = topk_opd_loss(full_cur, full_old, full_teacher, t([[1]]), indices=idx)
    assert full.loss.item() == pytest.approx(0.691759, abs=1e-6)


def test_topk_opd_loss_masks_tokens_and_aggregates() -> None:
    logp_cur, logp_old, teacher = _topk_inputs()
    # token 1 is a copy with ρ = 1 and all gaps clipped → per-token loss −Σ A_v
    cur = torch.cat([logp_cur, logp_old], dim=1)
    old = torch.cat([logp_old, logp_old], dim=1)
    teach = torch.cat([teacher, teacher], dim=1)
    only_first = topk_opd_loss(cur, old, teach, t([[1, 0]]))
    assert only_first.loss.item() == pytest.approx(0.691759, abs=1e-6)
    both = topk_opd_loss(cur, old, teach, t([[1, 1]]))
    # token 1: ρ = 1 → l = −ΣA = −(−0.555556 + 0.135155 + 0.111111) = 0.309290
    assert both.loss.item() == pytest.approx((0.691759 + 0.309290) / 2, abs=1e-6)


def test_hybrid_weighting() -> None:
    logp_cur = t([[0.1, 0.5]]).requires_grad_(True)
    old = t([[0.0, 0.0]])
    mask = t([[1, 1]])
    rl = binary_rl_loss(logp_cur, old, t([1.0]), mask)
    # rl: A=1: (−1.105171 − 1.28)/2 = −1.192586
    # opd: teacher = old + 0.3 → A = 0.3: (−0.3·1.105171 − 0.3·1.28)/2 = −0.357776
    opd = opd_loss(logp_cur, old, old + 0.3, mask)
    rl_hand = (-E01 - 1.28) / 2
    opd_hand = (-0.3 * E01 - 0.3 * 1.28) / 2
    default = hybrid_loss(rl, opd)
    assert default.loss.item() == pytest.approx(rl_hand + opd_hand)
    weighted = hybrid_loss(rl, opd, w_rl=0.5, w_opd=2.0)
    assert weighted.loss.item() == pytest.approx(0.5 * rl_hand + 2.0 * opd_hand)
    assert weighted.metrics["loss"] == pytest.approx(0.5 * rl_hand + 2.0 * opd_hand)
    assert weighted.metrics["rl/clip_fraction"] == pytest.approx(0.5)
    assert weighted.metrics["opd/mean_advantage"] == pytest.approx(0.3)
    weighted.loss.backward()
    # only token 0 is unclipped: grad = 0.5·(−1.105171/2) + 2·(−0.3·1.105171/2)
    assert logp_cur.grad is not None
    assert logp_cur.grad[0].tolist() == pytest.approx([0.5 * -E01 / 2 + 2.0 * -0.3 * E01 / 2, 0.0])


def test_staleness_keep_mask() -> None:
    # current 5, max 2: staleness [0, 1, 2, 3, 4] → keep [T, T, T, F, F]
    keep = staleness_keep_mask(torch.tensor([5, 4, 3, 2, 1]), current_version=5, max_staleness=2)
    assert keep.tolist() == [True, True, True, False, False]
    assert staleness_keep_mask(torch.tensor([7, 6]), 7, 0).tolist() == [True, False]

    # dropping a sample removes it from the loss: keep only seq0 of the binary example
    keep2 = staleness_keep_mask(torch.tensor([9, 3]), current_version=9, max_staleness=4)
    mask = t([[1, 1, 1], [1, 1, 1]]) * keep2[:, None]
    out, _ = _binary(mask.tolist())
    assert out.loss.item() == pytest.approx((-E01 - 1.28 - EM05) / 3)


def test_tis_weights_truncate_and_weight_the_loss() -> None:
    prox = t([[0.5, 1.0, -0.3]])
    behavior = t([[0.0, 0.0, 0.0]])
    # exp([0.5, 1.0, −0.3]) = [1.648721, 2.718282 → truncated at c = 2, 0.740818]
    w = tis_weights(prox, behavior)
    assert w[0].tolist() == pytest.approx([E05, 2.0, math.exp(-0.3)])
    capped = tis_weights(prox, behavior, cap=1.5)  # [1.648721 → 1.5, 2.718282 → 1.5, 0.740818]
    assert capped[0].tolist() == pytest.approx([1.5, 1.5, math.exp(-0.3)])
    masked = tis_weights(prox, behavior, loss_mask=t([[1, 0, 1]]))
    assert masked[0].tolist() == pytest.approx([E05, 0.0, math.exp(-0.3)])
    assert not w.requires_grad

    # weighted binary RL with ρ = 1 (ℓ_cur = ℓ_old = ℓ_prox), A = 1: l_t = −w_t
    out = binary_rl_loss(prox.clone(), prox, t([1.0]), t([[1, 1, 1]]), weights=w)
    assert out.loss.item() == pytest.approx(-(E05 + 2.0 + math.exp(-0.3)) / 3)


@pytest.mark.parametrize("reward", [1.0, -1.0])
def test_gradient_sign_one_sgd_step(reward: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 1, 5, requires_grad=True)
    token = torch.tensor([[2]])
    before = token_logprobs(logits, token)
    old = before.detach()
    out = binary_rl_loss(before, old, torch.tensor([reward]), torch.ones(1, 1))
    out.loss.backward()
    with torch.no_grad():
        logits -= 0.1 * logits.grad  # type: ignore[operator]
        after = token_logprobs(logits, token)
    if reward > 0:
        assert after.item() > old.item()  # positive advantage raises the log-prob
    else:
        assert after.item() < old.item()


def test_gradient_sign_opd_and_topk() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 1, 6, requires_grad=True)
    token = torch.tensor([[4]])
    lp = token_logprobs(logits, token)
    old = lp.detach()
    opd_loss(lp, old, old + 0.5, torch.ones(1, 1)).loss.backward()  # teacher likes the token more
    with torch.no_grad():
        after = token_logprobs(logits - 0.1 * logits.grad, token)  # type: ignore[operator]
    assert after.item() > old.item()

    # top-k: teacher prefers vocab entry of S with index 1 more than the student
    logits2 = torch.randn(1, 1, 6, requires_grad=True)
    full = torch.log_softmax(logits2, dim=-1)
    idx = torch.tensor([[[0, 1, 2]]])
    teacher = full.detach().clone()
    teacher[0, 0, 1] += 0.7
    teacher[0, 0, 0] -= 0.7
    topk_opd_loss(full, full.detach(), teacher, torch.ones(1, 1), indices=idx).loss.backward()
    with torch.no_grad():
        new = torch.log_softmax(logits2 - 0.1 * logits2.grad, dim=-1)  # type: ignore[operator]
    assert new[0, 0, 1] > full[0, 0, 1]
    assert new[0, 0, 0] < full[0, 0, 0]


def test_kl_to_reference_by_hand() -> None:
    """k3: kl_t = exp(ℓ_ref − ℓ_cur) − (ℓ_ref − ℓ_cur) − 1. Token 1: ℓ_cur = ln 0.5,
    ℓ_ref = ln 0.25, so d = −ln 2, kl = 0.5 + ln 2 − 1 = 0.193147; token 2: equal, 0; token
    3 masked. token_mean = 0.193147 / 2; d loss / d ℓ_cur1 = (1 − exp(d)) / 2 = 0.25."""
    cur = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.25), -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = kl_to_reference(cur, ref, mask, aggregate="token_mean")
    expected = (0.5 + math.log(2) - 1) / 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.metrics["kl_ref"] == pytest.approx(expected, abs=1e-6)
    out.loss.backward()
    assert cur.grad is not None
    assert cur.grad[0].tolist() == pytest.approx([0.25, 0.0, 0.0], abs=1e-6)


# ---------------------------------------------------------------------------
# Binary RL baseline, hybrid's added advantages, warm-up (issue 23)


def test_batch_mean_baseline_by_hand() -> None:
    # rows 0, 1, 3 train: b = (1 − 1 − 1) / 3 = −1/3; row 2 (r = 5) does not count
    r = torch.tensor([1.0, -1.0, 5.0, -1.0])
    rows = torch.tensor([True, True, False, True])
    assert float(batch_mean_baseline(r, rows)) == pytest.approx(-1.0 / 3.0)
    assert float(batch_mean_baseline(r, torch.zeros(4, dtype=torch.bool))) == 0.0


def test_baseline_turns_an_all_negative_batch_into_no_push_away() -> None:
    r = torch.tensor([-1.0, -1.0])
    m = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    b = batch_mean_baseline(r, m.sum(-1) > 0)  # −1
    a = binary_rl_advantages(r, m, b)
    assert torch.equal(a, torch.zeros(2, 2))
    # without a baseline every sampled token is pushed away (A = −1)
    assert binary_rl_advantages(r, m).tolist() == [[-1.0, -1.0], [-1.0, 0.0]]
    # one +1 among three −1: b = −0.5, A = +1.5 for it and −0.5 for the others
    r2 = torch.tensor([1.0, -1.0, -1.0, -1.0])
    m2 = torch.ones(4, 1)
    a2 = binary_rl_advantages(r2, m2, batch_mean_baseline(r2, torch.ones(4, dtype=torch.bool)))
    assert a2.squeeze(-1).tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])


def test_binary_rl_loss_with_baseline_by_hand() -> None:
    # ρ = 1 (ℓ_cur = ℓ_old): l_t = −A_t; r = (1, −1), b = 0 → A = (1, −1) with baseline 0,
    # b = 0.5 → A = (0.5, −1.5); token_mean over 2 tokens each: L = −(0.5·2 − 1.5·2)/4 = 0.5
    logp = torch.zeros(2, 2)
    r = torch.tensor([1.0, -1.0])
    m = torch.ones(2, 2)
    out = binary_rl_loss(logp, logp, r, m, baseline=0.5)
    assert float(out.loss) == pytest.approx(0.5)
    assert out.metrics["mean_advantage"] == pytest.approx(-0.5)
    assert float(binary_rl_loss(logp, logp, r, m).loss) == pytest.approx(0.0)


def test_hybrid_advantages_add_per_token_by_hand() -> None:
    # row 0: hinted and rewarded r = −1; b = 0 (rows −1 and +1): A_rl = (−1, −1, 0)
    #        teacher gap ℓ_T − ℓ_old = (2.0, −0.3, 0.4) → clip(·, ±1) = (1.0, −0.3, 0.4)
    #        opd mask (1, 1, 0): A = w_rl·A_rl + w_opd·A_opd with w = (1, 0.5)
    #        = (−1 + 0.5, −1 − 0.15, 0) = (−0.5, −1.15, 0)
    # row 1: r = +1, no hint: A = (1, 1, 1)
    r = torch.tensor([-1.0, 1.0])
    rl_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    opd_mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    old = torch.full((2, 3), -2.0)
    teacher = torch.tensor([[0.0, -2.3, -1.6], [-9.0, -9.0, -9.0]])
    b = batch_mean_baseline(r, rl_mask.sum(-1) > 0)
    a = hybrid_advantages(r, rl_mask, teacher, old, opd_mask, w_rl=1.0, w_opd=0.5, baseline=b)
    assert a.tolist()[0] == pytest.approx([-0.5, -1.15, 0.0])
    assert a.tolist()[1] == pytest.approx([1.0, 1.0, 1.0])
    # ρ = 1: l = −A over max(m_rl, m_opd) = 5 tokens, token_mean: L = −(−1.65 + 3) / 5
    out = hybrid_advantage_loss(
        old, old, r, rl_mask, teacher, opd_mask, w_rl=1.0, w_opd=0.5, baseline=b
    )
    assert float(out.loss) == pytest.approx(-(3.0 - 1.65) / 5)


def test_hybrid_advantage_loss_clips_the_sum_not_each_part() -> None:
    # ρ = e^{0.5} > 1.28 on one token; A_rl = +1, A_opd = −1 (gap −3 clipped): A = 0, so the
    # loss is 0 (the two loss-sum parts would give −1.28 and +1.6487)
    cur = torch.tensor([[0.5]])
    old = torch.zeros(1, 1)
    out = hybrid_advantage_loss(
        cur, old, torch.tensor([1.0]), torch.ones(1, 1), torch.tensor([[-3.0]]), torch.ones(1, 1)
    )
    assert float(out.loss) == pytest.approx(0.0)


def test_warmup_factor_by_hand() -> None:
    assert [warmup_factor(k, 4) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0 and warmup_factor(0, 1) == 1.0


# ---------------------------------------------------------------------------
# Per-row baselines (issue 38)


def test_row_baselines_by_hand() -> None:
    # rows: z-scored −1 and +1 (normalised), judged −1, a failure at 0, judged +0.5; all train.
    # batch mean over the rows not normalised: (−1 + 0 + 0.5) / 3 = −1/6
    # b = (0, 0, −1/6, max(−1/6, 0) = 0, −1/6) → A = (−1, 1, −5/6, 0, 2/3)
    # (one batch mean over all five, −0.1, gave (−0.9, 1.1, −0.9, +0.1, 0.6))
    r = torch.tensor([-1.0, 1.0, -1.0, 0.0, 0.5])
    rows = torch.ones(5, dtype=torch.bool)
    normalized = torch.tensor([True, True, False, False, False])
    failed = torch.tensor([False, False, False, True, False])
    b, mean = row_baselines(r, rows, normalized, failed)
    assert float(mean) == pytest.approx(-1 / 6)
    a = binary_rl_advantages(r, torch.ones(5, 1), b).squeeze(-1)
    assert a.tolist() == pytest.approx([-1.0, 1.0, -5 / 6, 0.0, 2 / 3])
    # batch_mean off: b = 0 except the failure, which is never lifted: a failure at +0.5
    # (an older record, before outcome_bound) gets b = 0.5, A = 0
    r2 = torch.tensor([0.5, -1.0])
    b2, _ = row_baselines(r2, torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.bool),
                          torch.tensor([True, False]), batch_mean=False)  # fmt: skip
    assert (r2 - b2).tolist() == [0.0, -1.0]
