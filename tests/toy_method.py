"""A training method defined outside the library (loaded with ``--plugin tests.toy_method``).

Reward-weighted log-likelihood: ``L = -s · Σ_i r_i Σ_t m_it log π(y_it) / Σ_i Σ_t n_it`` over
the RL mask ``m`` and the normalising mask ``n``, with ``s`` its option ``scale``
(``[trainer.method_options] scale = 2``). It exists to prove that a method is one module owning
its options: nothing in ``pipeline/`` names it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from pipeline.trainer.losses import LossOutput
from pipeline.trainer.methods import StepInputs, register_method, register_part


class ToyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scale: float = 1.0


@register_part("toy", mask="rl")
def reward_weighted_nll(x: StepInputs) -> LossOutput:
    logp, mask = x.logp[x.rows], x.mask[x.rows]
    rewards = x.rewards[x.rows]
    scale = x.options.scale if x.options is not None else 1.0
    loss = -scale * (rewards[:, None] * logp * mask).sum() / x.norm[x.rows].sum().clamp(min=1.0)
    return LossOutput(loss, {"loss": float(loss.detach())})


register_method("toy", ["toy"], options=ToyOptions)
