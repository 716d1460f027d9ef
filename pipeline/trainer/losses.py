"""Policy-gradient losses for liverl's three training methods.

See docs/architecture.md#training-losses.

Plain functions over torch tensors, in the style of TRL. Shapes are batch-first
and padded:

* per-token log-probs, advantages, masks, weights: ``[B, T]``
* top-k log-probs: gathered ``[B, T, K]`` (or full ``[B, T, V]`` plus the
  vocabulary indices ``[B, T, K]`` to gather)
* per-sample rewards and weight versions: ``[B]``

Notation: ``ℓ_cur`` log-probs under the policy being optimised (carries the
gradient), ``ℓ_old`` log-probs the PPO ratio is taken against (sampling time,
or the proximal policy for decoupled off-policy correction), ``ℓ_T`` teacher
log-probs (the same response tokens under the prompt with the hint appended),
``ρ = exp(ℓ_cur − ℓ_old)``.

Every loss shares the PPO-clipped surrogate (ε = 0.2, ε_hi = 0.28)::

    l_t = max(−ρ_t·A_t, −clip(ρ_t, 1 − ε, 1 + ε_hi)·A_t)

Aggregation over unmasked tokens (``loss_mask == 0`` tokens never count in the
numerator; ``n`` is the normalising mask, ``loss_mask`` unless ``norm_mask`` is given):

* ``"sample_mean"`` (the trainer's default; slime's ``sum_of_sample_mean`` divided
  by the batch size, i.e. OpenClaw-RL's launchers, which do not set
  ``--calculate-per-token-loss``): ``(1/B) Σ_b Σ_t m·l / max(Σ_t n, 1)`` — every
  sample weighs the same whatever its length, and a fully masked row counts as a
  zero in the mean over all ``B`` rows, as in slime;
* ``"token_mean"``: ``Σ_{b,t} m·l / Σ_{b,t} n`` — a token-level mean across the
  whole batch, so long responses weigh more than short ones (slime with
  ``--calculate-per-token-loss``);
* ``"seq_mean"``: mean over sequences with ``Σ_t n > 0`` of ``Σ_t m·l / Σ_t n``;
  sequences with nothing to normalise by are left out of the mean.

``norm_mask`` lets two terms share one denominator: Hybrid passes the union of the
RL and OPD masks to both, so each term is averaged over the batch, as slime does
with the single loss mask of a combined sample (an unhinted token is a zero in the
OPD mean, not absent from it).

A batch with no unmasked token gives a zero loss that is still attached to the
graph (``backward`` works and yields zero gradients).

Every loss returns a :class:`LossOutput` with the metrics ``loss``,
``clip_fraction`` (share of unmasked tokens where the clipped branch is
strictly active), ``approx_kl`` (k3 estimator ``(ρ − 1) − log ρ`` averaged over
unmasked tokens) and ``mean_advantage`` (mean over unmasked tokens).

Off-policy samples (each sample carries the weight version that produced it)
are handled in one of two ways, both provided here:

* drop: :func:`staleness_keep_mask` → multiply into ``loss_mask``;
* correct: :func:`tis_weights` → pass as ``weights`` to any loss; per-token
  truncated importance weights ``w = min(exp(ℓ_prox − ℓ_behavior), c)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

# The loss functions' defaults are the trainer settings' (stated once, where no torch is needed).
from pipeline.trainer.defaults import EPS as EPS
from pipeline.trainer.defaults import EPS_HIGH as EPS_HIGH
from pipeline.trainer.defaults import OPD_CLIP as OPD_CLIP
from pipeline.trainer.defaults import TIS_CAP as TIS_CAP
from pipeline.trainer.defaults import TOPK as TOPK

Aggregate = Literal["sample_mean", "token_mean", "seq_mean"]


@dataclass
class LossOutput:
    """A scalar loss (attached to the graph) and detached float metrics."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    # tensors a method's combine rule may reuse (hybrid's per-token advantage sum); not logged
    inputs: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# log-prob helpers


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``token_ids`` under ``logits``.

    ``out[b, t] = log_softmax(logits[b, t])[token_ids[b, t]]``; ``logits`` is
    ``[..., V]``, ``token_ids`` is ``[...]`` (align logits and targets before
    calling: logits at position t must predict ``token_ids[..., t]``).
    Computed in float32 for stability.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


def topk_logprobs(logits: torch.Tensor, k: int = TOPK) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-probs and their vocabulary indices, ``[..., V] → ([..., k], [..., k])``.

    ``values = topk(log_softmax(logits), k)`` (normalised over the full
    vocabulary), sorted in descending order.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, indices = logp.topk(k, dim=-1)
    return values, indices


def gather_vocab(logprobs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Gather vocabulary entries: ``[..., V]`` at ``[..., K]`` indices → ``[..., K]``."""
    return logprobs.gather(-1, indices.long())


# ---------------------------------------------------------------------------
# aggregation and the shared surrogate


def masked_aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    aggregate: Aggregate = "token_mean",
    norm_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce ``[B, T]`` per-token values over unmasked tokens (``m = mask``,
    ``n = norm_mask``, default ``m``).

    ``sample_mean``: ``(1/B) Σ_b Σ_t m·x / max(Σ_t n, 1)`` (fully masked rows count as 0);
    ``token_mean``: ``Σ m·x / Σ n``; ``seq_mean``: mean over rows with ``Σ_t n > 0`` of
    ``Σ_t m·x / Σ_t n``. Zero (attached) when nothing counts.
    """
    m = mask.to(values.dtype)
    n = m if norm_mask is None else norm_mask.to(values.dtype)
    if aggregate == "sample_mean":
        per_seq = (values * m).sum(dim=-1) / n.sum(dim=-1).clamp(min=1.0)
        return per_seq.sum() / max(values.shape[0], 1)
    if aggregate == "token_mean":
        return (values * m).sum() / n.sum().clamp(min=1.0)
    if aggregate == "seq_mean":
        per_seq_count = n.sum(dim=-1)
        per_seq = (values * m).sum(dim=-1) / per_seq_count.clamp(min=1.0)
        has_tokens = (per_seq_count > 0).to(values.dtype)
        return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)
    raise ValueError(
        f"unknown aggregate {aggregate!r}; expected 'sample_mean', 'token_mean' or 'seq_mean'"
    )


def _token_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.to(values.dtype)
    return float((values * m).sum() / m.sum().clamp(min=1.0))


def _surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element clipped surrogate and where its clipped branch is strictly active."""
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps, 1.0 + eps_high) * advantages
    return torch.maximum(unclipped, clipped), clipped > unclipped


def ppo_clip_loss(
    logp_cur: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps: float = EPS,
    eps_high: float = EPS_HIGH,
    aggregate: Aggregate = "token_mean",
    weights: torch.Tensor | None = None,
    norm_mask: torch.Tensor | None = None,
) -> LossOutput:
    """PPO-clipped surrogate with given per-token advantages (all ``[B, T]``).

    ``ρ_t = exp(ℓ_cur − ℓ_old)``,
    ``l_t = w_t · max(−ρ_t·A_t, −clip(ρ_t, 1 − ε, 1 + ε_hi)·A_t)``,
    ``L = aggregate_{m_t = 1}(l_t)``.

    ``ℓ_old``, ``A`` and ``w`` (default 1) are detached. ``weights`` is meant
    for :func:`tis_weights` (pass the proximal log-probs as ``logp_old`` for the
    decoupled form: the clip is then a trust region around the pre-update
    policy and ``w`` corrects behavior → proximal). ``norm_mask`` (default
    ``loss_mask``) is what the aggregate divides by (see :func:`masked_aggregate`).
    """
    logp_old = logp_old.detach()
    advantages = advantages.detach().to(logp_cur.dtype)
    mask = loss_mask.to(logp_cur.dtype)
    log_ratio = logp_cur - logp_old
    ratio = torch.exp(log_ratio)
    per_token, clip_active = _surrogate(ratio, advantages, eps, eps_high)
    if weights is not None:
        per_token = per_token * weights.detach().to(per_token.dtype)
    loss = masked_aggregate(per_token, mask, aggregate, norm_mask)
    with torch.no_grad():
        kl = (ratio - 1.0) - log_ratio
        metrics = {
            "loss": float(loss.detach()),
            "clip_fraction": _token_mean(clip_active.to(mask.dtype), mask),
            "approx_kl": _token_mean(kl, mask),
            "mean_advantage": _token_mean(advantages, mask),
        }
    return LossOutput(loss=loss, metrics=metrics)


# ---------------------------------------------------------------------------
# Binary RL


def batch_mean_baseline(rewards: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Baseline for ungrouped Binary-RL rewards: the mean reward of the batch's trained rows.

    ``b = Σ_b 1[rows_b]·r_b / max(Σ_b 1[rows_b], 1)`` (a 0-dim tensor; 0 when no row counts).
    ``rows`` ``[B]`` (bool or 0/1) marks the rows the RL term trains (``Σ_t m[b, t] > 0``).

    With ``A = r − b`` a batch whose turns were all rewarded −1 gives ``A = 0`` (no
    push-away from everything that was sampled: nothing in it is better than the rest), and a
    +1 among −1s gets ``A = 1 − b > 1``: REINFORCE with the batch as its baseline (GRPO's
    group mean, with the batch as the one group, since every prompt is sampled once).
    """
    keep = rows.to(torch.float32)
    r = rewards.to(torch.float32)
    return (r * keep).sum() / keep.sum().clamp(min=1.0)


def row_baselines(
    rewards: torch.Tensor,
    rows: torch.Tensor,
    normalized: torch.Tensor,
    failed: torch.Tensor,
    batch_mean: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row baseline ``b`` ``[B]`` for ``A = r − b``, and the batch mean it uses (0-dim).

    - a group-normalised row (``normalized``: z-scored in its group and step) is already an
      advantage centred in its group: ``b = 0`` (re-centring it by the batch would let the
      other rows decide its sign);
    - any other row: the batch mean over the trained rows that are not normalised
      (:func:`batch_mean_baseline`), or 0 when ``batch_mean`` is off;
    - a row of a failed session (``failed``: outcome < 0) gets ``b ← max(b, r)``, so
      ``A = min(r − b, 0)``: a failure is never encouraged, whatever the batch holds.

    All arguments ``[B]`` (``rows``, ``normalized``, ``failed`` bool or 0/1).
    """
    r = rewards.to(torch.float32)
    own = rows.bool() & ~normalized.bool()
    mean = batch_mean_baseline(r, own) if batch_mean else torch.zeros((), device=r.device)
    b = torch.where(normalized.bool(), torch.zeros_like(r), mean.expand_as(r))
    return torch.where(failed.bool(), torch.maximum(b, r), b), mean


def binary_rl_advantages(
    rewards: torch.Tensor, loss_mask: torch.Tensor, baseline: float | torch.Tensor = 0.0
) -> torch.Tensor:
    """``A[b, t] = (r_b − baseline_b) · m[b, t]``: the sample's reward, less the baseline, on
    every response token.

    ``baseline`` is a scalar or per row ``[B]``; 0 is plain ``A = r``, the trainer passes
    :func:`row_baselines` (``rl_baseline``). ``rewards`` ``[B]``, ``loss_mask`` ``[B, T]`` →
    ``[B, T]``.
    """
    r = rewards.to(torch.float32) - torch.as_tensor(
        baseline, dtype=torch.float32, device=rewards.device
    )
    return r.unsqueeze(-1) * loss_mask.to(torch.float32)


def binary_rl_loss(
    logp_cur: torch.Tensor,
    logp_old: torch.Tensor,
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps: float = EPS,
    eps_high: float = EPS_HIGH,
    aggregate: Aggregate = "token_mean",
    weights: torch.Tensor | None = None,
    norm_mask: torch.Tensor | None = None,
    baseline: float | torch.Tensor = 0.0,
) -> LossOutput:
    """Binary RL: ``A_t = r − b`` on every response token, PPO-clipped.

    ``l_t = max(−ρ_t·A, −clip(ρ_t, 1 − ε, 1 + ε_hi)·A)``, ``ρ_t = exp(ℓ_cur − ℓ_old)``,
    ``A = r − b`` (``b = baseline``, default 0: ``A = r``); ``rewards`` is ``[B]``, the
    rest ``[B, T]``.
    """
    advantages = binary_rl_advantages(rewards, loss_mask, baseline)
    return ppo_clip_loss(
        logp_cur,
        logp_old,
        advantages,
        loss_mask,
        eps=eps,
        eps_high=eps_high,
        aggregate=aggregate,
        weights=weights,
        norm_mask=norm_mask,
    )


# ---------------------------------------------------------------------------
# On-policy distillation (OPD)


def opd_advantages(
    teacher_logp: torch.Tensor, logp_old: torch.Tensor, clip_c: float = OPD_CLIP
) -> torch.Tensor:
    """Token advantage ``A_t = clip(ℓ_T − ℓ_old, −C, C)`` (detached), C = 1.0."""
    return (teacher_logp.detach() - logp_old.detach()).clamp(-clip_c, clip_c)


def opd_loss(
    logp_cur: torch.Tensor,
    logp_old: torch.Tensor,
    teacher_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_c: float = OPD_CLIP,
    eps: float = EPS,
    eps_high: float = EPS_HIGH,
    aggregate: Aggregate = "token_mean",
    weights: torch.Tensor | None = None,
    norm_mask: torch.Tensor | None = None,
) -> LossOutput:
    """OPD on the sampled tokens: ``A_t = clip(ℓ_T − ℓ_old, −C, C)`` in the PPO surrogate.

    ``l_t = max(−ρ_t·A_t, −clip(ρ_t, 1 − ε, 1 + ε_hi)·A_t)``; all inputs ``[B, T]``;
    ``teacher_logp`` are the response tokens' log-probs under the hinted prompt.
    """
    advantages = opd_advantages(teacher_logp, logp_old, clip_c)
    return ppo_clip_loss(
        logp_cur,
        logp_old,
        advantages,
        loss_mask,
        eps=eps,
        eps_high=eps_high,
        aggregate=aggregate,
        weights=weights,
        norm_mask=norm_mask,
    )


def topk_opd_loss(
    logp_cur: torch.Tensor,
    logp_old: torch.Tensor,
    teacher_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    indices: torch.Tensor | None = None,
    subset_mask: torch.Tensor | None = None,
    clip_c: float = OPD_CLIP,
    eps: float = EPS,
    eps_high: float = EPS_HIGH,
    aggregate: Aggregate = "token_mean",
    weights: torch.Tensor | None = None,
    norm_mask: torch.Tensor | None = None,
) -> LossOutput:
    """Top-k OPD over a vocabulary subset S per token.

    For each token t and ``v ∈ S_t``::

        w_v = softmax_{S_t}(ℓ_old(v))                       (detached)
        A_v = clip(ℓ_T(v) − ℓ_old(v), −C, C) · w_v
        ρ_v = exp(ℓ_cur(v) − ℓ_old(v))
        l_t = Σ_{v ∈ S_t} max(−A_v·ρ_v, −A_v·clip(ρ_v, 1 − ε, 1 + ε_hi))

    then ``L = aggregate_{m_t = 1}(weights_t · l_t)``.

    Inputs are gathered ``[B, T, K]`` log-probs (full-vocabulary-normalised),
    or full ``[B, T, V]`` tensors together with ``indices`` ``[B, T, K]``
    (e.g. from :func:`pipeline.trainer.hint_selection.vocab_subset`).
    ``subset_mask`` ``[B, T, K]`` (bool, default all true) marks which of
    the K slots belong to S_t, for subsets of varying size.

    Metrics: ``clip_fraction`` and ``approx_kl`` are averaged over the
    (unmasked token, v ∈ S) entries; ``mean_advantage`` is the mean over
    unmasked tokens of ``Σ_{v∈S} A_v`` (the w-weighted clipped gap).
    """
    if indices is not None:
        logp_cur = gather_vocab(logp_cur, indices)
        logp_old = gather_vocab(logp_old, indices)
        teacher_logp = gather_vocab(teacher_logp, indices)
    logp_old = logp_old.detach()
    teacher_logp = teacher_logp.detach()
    if subset_mask is None:
        subset_mask = torch.ones_like(logp_old, dtype=torch.bool)
    in_s = subset_mask.bool()

    w = torch.softmax(logp_old.masked_fill(~in_s, float("-inf")), dim=-1)
    w = torch.nan_to_num(w, nan=0.0)  # rows with an empty S (masked tokens only)
    adv = (teacher_logp - logp_old).clamp(-clip_c, clip_c) * w
    log_ratio = logp_cur - logp_old
    ratio = torch.exp(log_ratio)
    per_entry, clip_active = _surrogate(ratio, adv, eps, eps_high)
    per_token = (per_entry * in_s.to(per_entry.dtype)).sum(dim=-1)
    if weights is not None:
        per_token = per_token * weights.detach().to(per_token.dtype)
    mask = loss_mask.to(per_token.dtype)
    loss = masked_aggregate(per_token, mask, aggregate, norm_mask)
    with torch.no_grad():
        entry_mask = in_s.to(mask.dtype) * mask.unsqueeze(-1)
        kl = (ratio - 1.0) - log_ratio
        metrics = {
            "loss": float(loss.detach()),
            "clip_fraction": _token_mean(clip_active.to(mask.dtype), entry_mask),
            "approx_kl": _token_mean(kl, entry_mask),
            "mean_advantage": _token_mean(adv.sum(dim=-1), mask),
        }
    return LossOutput(loss=loss, metrics=metrics)


# ---------------------------------------------------------------------------
# Hybrid


def hybrid_loss(
    rl: LossOutput, opd: LossOutput, *, w_rl: float = 1.0, w_opd: float = 1.0
) -> LossOutput:
    """``L = w_rl·L_rl + w_opd·L_opd`` (both weights 1.0 by default).

    Metrics are the parts' metrics prefixed ``rl/`` and ``opd/`` plus ``loss``.
    """
    loss = w_rl * rl.loss + w_opd * opd.loss
    metrics = {f"rl/{k}": v for k, v in rl.metrics.items()}
    metrics.update({f"opd/{k}": v for k, v in opd.metrics.items()})
    metrics["loss"] = float(loss.detach())
    return LossOutput(loss=loss, metrics=metrics)


def hybrid_advantages(
    rewards: torch.Tensor,
    rl_mask: torch.Tensor,
    teacher_logp: torch.Tensor,
    logp_old: torch.Tensor,
    opd_mask: torch.Tensor,
    *,
    w_rl: float = 1.0,
    w_opd: float = 1.0,
    clip_c: float = OPD_CLIP,
    baseline: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """OpenClaw-RL's combination: the RL and OPD advantages added per token (detached).

    ``A_t = w_rl·(r − b)·m^rl_t + w_opd·clip(ℓ_T,t − ℓ_old,t, −C, C)·m^opd_t``

    (``rewards`` ``[B]``, the rest ``[B, T]``). One PPO surrogate is then taken over
    ``max(m^rl, m^opd)``, so on a hinted and rewarded turn the sequence-level reward shifts
    every token and the teacher's gap says which tokens to move most, inside one clip.
    """
    rl = binary_rl_advantages(rewards, rl_mask, baseline)
    opd = opd_advantages(teacher_logp, logp_old, clip_c) * opd_mask.to(torch.float32)
    return (w_rl * rl + w_opd * opd).detach()


def hybrid_advantage_loss(
    logp_cur: torch.Tensor,
    logp_old: torch.Tensor,
    rewards: torch.Tensor,
    rl_mask: torch.Tensor,
    teacher_logp: torch.Tensor,
    opd_mask: torch.Tensor,
    *,
    w_rl: float = 1.0,
    w_opd: float = 1.0,
    clip_c: float = OPD_CLIP,
    baseline: float | torch.Tensor = 0.0,
    eps: float = EPS,
    eps_high: float = EPS_HIGH,
    aggregate: Aggregate = "token_mean",
    weights: torch.Tensor | None = None,
    norm_mask: torch.Tensor | None = None,
) -> LossOutput:
    """Hybrid with added advantages: :func:`hybrid_advantages` in the PPO surrogate,

    ``l_t = max(−ρ_t·A_t, −clip(ρ_t, 1 − ε, 1 + ε_hi)·A_t)`` over ``m = max(m^rl, m^opd)``.
    """
    advantages = hybrid_advantages(
        rewards,
        rl_mask,
        teacher_logp,
        logp_old,
        opd_mask,
        w_rl=w_rl,
        w_opd=w_opd,
        clip_c=clip_c,
        baseline=baseline,
    )
    mask = torch.maximum(rl_mask.to(torch.float32), opd_mask.to(torch.float32))
    return ppo_clip_loss(
        logp_cur,
        logp_old,
        advantages,
        mask,
        eps=eps,
        eps_high=eps_high,
        aggregate=aggregate,
        weights=weights,
        norm_mask=norm_mask,
    )


def warmup_factor(updates_done: int, warmup_steps: int) -> float:
    """Linear learning-rate warm-up: ``lr_k = lr · min(1, (k + 1) / N)`` for the ``k``-th
    optimizer update (0-based), ``N = warmup_steps`` (0 or 1: no warm-up).

    Adam's first update moves every parameter by about ``lr`` whatever its gradient's size
    (``m̂/√v̂ = g/|g|``), so on a zero-initialised LoRA B the first steps are sign steps of
    the full rate across every entry; warm-up shrinks them until the moments mean something.
    """
    if warmup_steps <= 1:
        return 1.0
    return min(1.0, (updates_done + 1) / warmup_steps)


# ---------------------------------------------------------------------------
# KL to the reference (a stabiliser against drifting into degenerate answers)


def kl_to_reference(
    logp_cur: torch.Tensor,
    logp_ref: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregate: Aggregate = "token_mean",
    norm_mask: torch.Tensor | None = None,
) -> LossOutput:
    """Per-token KL estimate to the frozen reference (k3, GRPO/slime's ``low_var_kl``):

    ``kl_t = exp(ℓ_ref − ℓ_cur) − (ℓ_ref − ℓ_cur) − 1`` (≥ 0, 0 where the policy equals
    the reference), aggregated like the policy terms; its gradient pulls ``ℓ_cur`` back
    toward ``ℓ_ref`` on the sampled tokens. The trainer adds ``kl_coef`` times it.
    """
    diff = logp_ref.detach() - logp_cur
    per_token = torch.exp(diff) - diff - 1.0
    m = mask.to(per_token.dtype)
    loss = masked_aggregate(per_token, m, aggregate, norm_mask)
    return LossOutput(
        loss=loss,
        metrics={"loss": float(loss.detach()), "kl_ref": _token_mean(per_token.detach(), m)},
    )


# ---------------------------------------------------------------------------
# Staleness (off-policy samples)


def staleness_keep_mask(
    sample_versions: torch.Tensor, current_version: int, max_staleness: int
) -> torch.Tensor:
    """Bool ``[B]``: keep samples at most ``max_staleness`` versions old.

    ``keep_b = (current_version − version_b) ≤ max_staleness``; a sample produced
    by the current weights has staleness 0, so ``max_staleness = 0`` is strictly
    on-policy. Apply as ``loss_mask * keep[:, None]``.
    """
    staleness = current_version - sample_versions.long()
    return staleness <= max_staleness


def tis_weights(
    logp_prox: torch.Tensor,
    logp_behavior: torch.Tensor,
    cap: float = TIS_CAP,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Truncated importance weights ``w_t = min(exp(ℓ_prox − ℓ_behavior), c)`` (detached).

    ``ℓ_prox``: log-probs of the current policy before the update (no grad);
    ``ℓ_behavior``: the log-probs recorded when the sample was generated;
    c = 2.0 by default. Masked positions (if ``loss_mask`` given) get weight 0.
    Pass the result as ``weights`` to a loss.
    """
    with torch.no_grad():
        w = torch.exp(logp_prox.detach() - logp_behavior.detach()).clamp(max=cap)
        if loss_mask is not None:
            w = w * loss_mask.to(w.dtype)
    return w
