"""Training methods as a registry: a method names the loss parts it trains and how they add up.

A loss part is a plain function ``StepInputs -> LossOutput`` (formulas in
:mod:`pipeline.trainer.losses`) that trains either the RL mask (``loss_mask``: every scored
turn) or the OPD mask (``opd_mask`` of hinted turns; the OPD part needs the core's teacher).
A method is a tuple of parts plus a ``combine`` rule. The core, the Delta lake (the
``losses`` map column of ``gradient_steps``), publishing and ``liverl report`` only iterate
over the parts, so a new method is one module that registers itself, loaded with
``[trainer] plugins = ["my.module"]`` (``--plugin``); see docs/architecture.md.

No torch at import: ``liverl --help`` lists the methods without loading it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from pipeline.trainer.losses import Aggregate, LossOutput

from pydantic import BaseModel

from pipeline import registry
from pipeline.registry import NoOptions, Registry

MaskKind = Literal["rl", "opd"]


class MethodSettings(Protocol):
    """The trainer settings a loss part reads (``TrainerSettings`` is one). The settings
    import this registry to check ``trainer.method``, so the registry names only this."""

    @property
    def eps(self) -> float: ...
    @property
    def eps_high(self) -> float: ...
    @property
    def aggregate(self) -> Aggregate: ...
    @property
    def opd_clip(self) -> float: ...
    @property
    def w_rl(self) -> float: ...
    @property
    def w_opd(self) -> float: ...
    @property
    def hybrid_combine(self) -> str: ...


@dataclass(frozen=True)
class StepInputs:
    """What a loss part sees for one batch (full-batch tensors; ``rows`` selects the rows the
    loss averages over, ``norm`` is the mask that normalises every part alike)."""

    core: Any  # TrainerCore: its teacher and hint selection, for parts that need them
    cfg: MethodSettings
    samples: Sequence[Any]
    resp_logits: torch.Tensor  # [B, R, V]
    tokens: torch.Tensor  # [B, R] response token ids
    logp: torch.Tensor  # [B, R] current log-probs of the response tokens (with grad)
    logp_old: torch.Tensor  # [B, R] the PPO ratio's reference log-probs
    rewards: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, R] this part's trainable tokens
    weights: torch.Tensor | None  # [B, R] importance weights of stale rows (tis), else None
    outcomes: list[Any]  # per-sample SampleOutcome (a part may record e.g. the chosen hint)
    rows: torch.Tensor  # indices of the rows the loss averages over
    norm: torch.Tensor  # [B, R]
    # Binary RL's reward baseline (trainer.rl_baseline): a scalar, or per row [B]
    # (losses.row_baselines); ``batch_mean`` is the batch mean reward it uses.
    baseline: float | torch.Tensor = 0.0
    batch_mean: float = 0.0
    # The method's own options (``[trainer.method_options]``), validated by its options model.
    options: Any = None

    def take(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` restricted to :attr:`rows` (None stays None)."""
        return None if t is None else t[self.rows]

    def row_baseline(self) -> float | torch.Tensor:
        """:attr:`baseline` for the rows the loss averages over (a scalar stays as it is)."""
        b = self.baseline
        return cast("torch.Tensor", b)[self.rows] if _per_row(b) else b


def _per_row(b: float | torch.Tensor) -> bool:
    """Whether a baseline is per row (a ``[B]`` tensor) rather than one number."""
    return not isinstance(b, int | float) and b.dim() > 0


LossPart = Callable[[StepInputs], "LossOutput"]
Combine = Callable[[dict[str, "LossOutput"], "MethodSettings"], "LossOutput"]


@dataclass(frozen=True)
class Part:
    name: str
    fn: LossPart
    mask: MaskKind


@dataclass(frozen=True)
class Method:
    name: str
    parts: tuple[str, ...]
    combine: Combine
    main: str  # the part whose approx KL and clip fraction the step reports
    options: type[BaseModel] = NoOptions  # validates [trainer.method_options]

    def uses(self, mask: MaskKind) -> bool:
        return any(PARTS[p].mask == mask for p in self.parts)


PARTS: dict[str, Part] = {}
# Methods by name (``[trainer] method``), each with its options model: the same registry
# pattern as the judges' (pipeline/registry.py).
METHODS: Registry[Method] = Registry("training method", "trainer.method")


def register_part(name: str, *, mask: MaskKind = "rl") -> Callable[[LossPart], LossPart]:
    """Decorator: ``fn`` computes the loss part ``name`` on the ``mask`` tokens."""

    def add(fn: LossPart) -> LossPart:
        PARTS[name] = Part(name, fn, mask)
        return fn

    return add


def _sum(parts: dict[str, LossOutput], _cfg: MethodSettings) -> LossOutput:
    from pipeline.trainer.losses import LossOutput

    if len(parts) == 1:
        return next(iter(parts.values()))
    total = sum((p.loss for p in parts.values()), start=0.0 * next(iter(parts.values())).loss)
    return LossOutput(total, {"loss": float(total.detach())})


def register_method(
    name: str,
    parts: Sequence[str],
    *,
    combine: Combine | None = None,
    main: str | None = None,
    options: type[BaseModel] = NoOptions,
) -> Method:
    """A method training ``parts`` (registered first), added up by ``combine`` (default: the
    sum); ``main`` (default: the first part) supplies the reported KL and clip fraction;
    ``options`` validates ``[trainer.method_options]``, which its parts get as ``x.options``."""
    unknown = [p for p in parts if p not in PARTS]
    if not parts or unknown:
        raise ValueError(
            f"method {name!r}: unknown loss part(s) {unknown or '(none given)'}; "
            f"known: {', '.join(sorted(PARTS))}"
        )
    method = Method(name, tuple(parts), combine or _sum, main or parts[0], options)
    METHODS.register(name, method, options)
    return method


def get(name: str) -> Method:
    return METHODS.get(name).item


def options(name: str, raw: Mapping[str, Any] | BaseModel | None) -> BaseModel:
    """``[trainer.method_options]`` validated by method ``name``'s options model."""
    return METHODS.options(name, raw)


def load_plugins(modules: Sequence[str]) -> None:
    """Import the modules that register methods and parts (``[trainer] plugins``)."""
    registry.load_plugins(modules, "trainer")


# ---- built-in parts and methods ------------------------------------------------------------


@register_part("rl", mask="rl")
def binary_rl(x: StepInputs) -> LossOutput:
    """Binary RL: PPO-clipped surrogate with the turn's reward as every token's advantage."""
    from pipeline.trainer import losses as L

    cfg = x.cfg
    out = L.binary_rl_loss(
        x.logp[x.rows],
        x.logp_old[x.rows],
        x.rewards[x.rows],
        x.mask[x.rows],
        eps=cfg.eps,
        eps_high=cfg.eps_high,
        aggregate=cfg.aggregate,
        weights=x.take(x.weights),
        norm_mask=x.norm[x.rows],
        baseline=x.row_baseline(),
    )
    out.metrics["baseline"] = x.batch_mean if _per_row(x.baseline) else float(x.baseline)
    # what hybrid's advantage combine reuses
    out.inputs.update(
        logp=x.logp[x.rows],
        logp_old=x.logp_old[x.rows],
        rewards=x.rewards[x.rows],
        mask=x.mask[x.rows],
        weights=x.take(x.weights),
        norm=x.norm[x.rows],
        baseline=x.row_baseline(),
    )
    return out


@register_part("opd", mask="opd")
def on_policy_distillation(x: StepInputs) -> LossOutput:
    """OPD: the hinted teacher's per-token advantage (needs the core's teacher passes)."""
    return x.core._opd_part(
        x.samples,
        x.resp_logits,
        x.tokens,
        x.logp,
        x.logp_old,
        x.mask,
        x.weights,
        x.outcomes,
        x.rows,
        x.norm,
    )


def _hybrid(parts: dict[str, LossOutput], cfg: MethodSettings) -> LossOutput:
    """``hybrid_combine = advantage`` (default): one surrogate on the per-token sum of the two
    advantages (:func:`~pipeline.trainer.losses.hybrid_advantage_loss`); ``loss``: the
    weighted sum of the two parts' losses. The parts' own losses are reported either way."""
    from pipeline.trainer import losses as L

    out = L.hybrid_loss(parts["rl"], parts["opd"], w_rl=cfg.w_rl, w_opd=cfg.w_opd)
    rl, opd = parts["rl"].inputs, parts["opd"].inputs
    if cfg.hybrid_combine != "advantage" or "teacher_logp" not in opd:
        return out
    joint = L.hybrid_advantage_loss(
        rl["logp"],
        rl["logp_old"],
        rl["rewards"],
        rl["mask"],
        opd["teacher_logp"],
        opd["mask"],
        w_rl=cfg.w_rl,
        w_opd=cfg.w_opd,
        clip_c=cfg.opd_clip,
        baseline=rl["baseline"],
        eps=cfg.eps,
        eps_high=cfg.eps_high,
        aggregate=cfg.aggregate,
        weights=rl["weights"],
        norm_mask=rl["norm"],
    )
    metrics = {
        **out.metrics,
        **{f"joint/{k}": v for k, v in joint.metrics.items()},
        "loss": joint.metrics["loss"],
    }
    return L.LossOutput(joint.loss, metrics)


register_method("rl", ["rl"])
register_method("opd", ["opd"])
register_method("hybrid", ["rl", "opd"], combine=_hybrid, main="rl")
