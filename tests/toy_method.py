"""A training method defined outside the library (loaded with ``--plugin tests.toy_method``).

Reward-weighted log-likelihood: ``L = -Σ_i r_i Σ_t m_it log π(y_it) / Σ_i Σ_t n_it`` over the
RL mask ``m`` and the normalising mask ``n``. It exists to prove that a method is one module:
nothing in ``pipeline/`` names it.
"""

from __future__ import annotations

from pipeline.trainer.losses import LossOutput
from pipeline.trainer.methods import StepInputs, register_method, register_part


@register_part("toy", mask="rl")
def reward_weighted_nll(x: StepInputs) -> LossOutput:
    logp, mask = x.logp[x.rows], x.mask[x.rows]
    rewards = x.rewards[x.rows]
    loss = -(rewards[:, None] * logp * mask).sum() / x.norm[x.rows].sum().clamp(min=1.0)
    return LossOutput(loss, {"loss": float(loss.detach())})


register_method("toy", ["toy"])
