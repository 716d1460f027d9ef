"""One optimizer step on a batch of samples: Binary RL, OPD (with hint selection) or hybrid.

Kafka-free on purpose: the loop, tests and benchmarks drive it directly. The losses come
from :mod:`pipeline.trainer.losses` and hint selection from
:mod:`pipeline.trainer.hint_selection`; this module only lines tensors up for them.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from pipeline.events import Sample
from pipeline.trainer import hint_selection as hs
from pipeline.trainer import losses as L
from pipeline.trainer import methods, scoring
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.prompts import ChatMarkers, teacher_prompt
from pipeline.trainer.scoring import HELD_OUT, is_held_out


class DataParallel(Protocol):
    """What a step needs from a data-parallel group (``distributed.RankGroup`` is one): the
    core depends on this, never on the module that spawns ranks."""

    def shard(self, samples: Sequence[Any], active: torch.Tensor, uses_opd: bool) -> torch.Tensor:
        """Bool ``[B]``: the active rows this rank trains."""
        ...

    def all_reduce_grads(self, model: Any) -> None:
        """Sum the trainable parameters' gradients over the ranks."""
        ...

    def combine(
        self, metrics: dict[str, tuple[float, float]], hints: dict[int, str]
    ) -> tuple[dict[str, float], dict[int, str]]:
        """The whole batch's metrics from every rank's ``{key: (value, weight)}``, and every
        rank's chosen hints by row."""
        ...


MAX_HINTS = 3
OPTIMIZER_FILE = "optimizer.pt"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_MODEL_CARD = "README.md"  # peft writes a model card next to an adapter; not served


@dataclass
class SampleOutcome:
    """What the step did with one sample (becomes trajectory columns)."""

    status: str  # trained | masked | stale_dropped | no_hint | held_out
    staleness: int
    selected_hint: str | None = None


@dataclass
class StepResult:
    step: int
    weight_version: int
    losses: dict[str, float]
    kl: float
    clip_fraction: float
    grad_norm: float | None
    samples: int
    tokens: int
    trained_tokens: int
    dropped_stale: int
    reward_mean: float
    metrics: dict[str, float]
    outcomes: list[SampleOutcome]
    timings: dict[str, float] = field(default_factory=dict)


class _LocalGroup:
    """One process: every row is this rank's, the gradient is already the batch's."""

    def shard(self, samples: Sequence[Any], active: torch.Tensor, uses_opd: bool) -> torch.Tensor:
        return torch.ones_like(active)

    def all_reduce_grads(self, model: Any) -> None:
        return None

    def combine(
        self, metrics: dict[str, tuple[float, float]], hints: dict[int, str]
    ) -> tuple[dict[str, float], dict[int, str]]:
        return {k: v for k, (v, _w) in metrics.items()}, hints


LOCAL: DataParallel = _LocalGroup()


@dataclass
class _Batch:
    """One batch through a step: its tensors (``[B, R]`` unless noted), which rows train
    which term, and what the first epoch fixes for the others."""

    samples: Sequence[Sample]
    rmax: int
    tokens: torch.Tensor  # response token ids
    rewards: torch.Tensor  # [B]
    versions: torch.Tensor  # [B] behaviour weight versions
    valid: torch.Tensor  # 1 on every response token
    behavior: torch.Tensor  # the engine's log-probs
    lag_v: torch.Tensor  # [B] staleness in versions
    stale: torch.Tensor  # [B] beyond max_staleness
    held_list: list[bool]  # held out for the promotion gate
    has_hint: torch.Tensor  # [B]
    rl_ok: torch.Tensor  # [B] the RL term may train it
    usable: torch.Tensor  # [B] some term of the method may train it
    keep: torch.Tensor  # [B] usable and fresh enough
    mask_rl: torch.Tensor
    mask_opd: torch.Tensor
    rows: torch.Tensor  # the rows the loss averages over
    norm: torch.Tensor  # the normalising mask every part shares
    baseline: float | torch.Tensor  # [B] per row (L.row_baselines), or 0.0
    batch_mean: float  # the batch mean reward in it (reported as the step's ``baseline``)
    method: methods.Method
    options: Any  # the method's validated options
    mine: torch.Tensor  # [B] this rank's rows
    trained_tokens: int
    active: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    logp_old: torch.Tensor | None = None
    weights: torch.Tensor | None = None  # importance weights of stale rows (tis)
    drift: dict[str, float] = field(default_factory=dict)
    outcomes: list[SampleOutcome] = field(default_factory=list)

    def trainable(self) -> torch.Tensor:
        """[B]: rows with a token in either term's mask."""
        return (self.mask_rl.sum(dim=-1) > 0) | (self.mask_opd.sum(dim=-1) > 0)


@dataclass
class _Clock:
    """Seconds per stage, summed over a step's epochs."""

    teacher: float = 0.0
    backward: float = 0.0
    sync: float = 0.0
    optimizer: float = 0.0


def resolve_model_path(model: str) -> Path:
    """``tiny`` (built in code), a model-store name (pulled on first use) or a local dir."""
    import logging

    from pipeline.models.store import resolve

    log = logging.getLogger(__name__)
    return resolve(model, report=lambda msg: log.info("model store: %s", msg))


def is_adapter_version(directory: Path | None) -> bool:
    return directory is not None and (Path(directory) / ADAPTER_CONFIG).is_file()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class TrainerCore:
    """Policy, optional frozen reference (OPD teacher), tokenizer and optimizer."""

    def __init__(
        self,
        cfg: TrainerSettings,
        model: Any,
        tokenizer: Any,
        *,
        reference: Any | None = None,
        step: int = 0,
    ) -> None:
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        self.model = model.to(self.device)
        self.model.train()
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
            self.model.config.use_cache = False
        self.reference = reference.to(self.device).eval() if reference is not None else None
        if self.reference is not None:
            self.reference.requires_grad_(False)
        # With a LoRA policy the frozen reference is the base itself, adapters switched off:
        # no second copy of the weights.
        self.lora = _is_peft(self.model)
        self.base_teacher = self.lora and cfg.teacher == "reference" and reference is None
        self.tokenizer = tokenizer
        self.markers = ChatMarkers.from_tokenizer(tokenizer)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.learning_rate,
            weight_decay=cfg.weight_decay,
        )
        self.step = step
        # Optimizer steps since the weights were exactly a published version: the loop passes
        # a new ``current_version`` right after publishing (or loading) it, and several steps
        # may share one version (the publish budget); only at 0 is the trainer's forward pass
        # the behaviour policy of that version's samples.
        self.version_seen: int | None = None
        self.steps_on_version = 0
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and self.device.type == "cuda")
        self.autocast_dtype = torch.bfloat16 if bf16 else None

    # ---- construction / persistence ---------------------------------------------------

    @classmethod
    def load(
        cls, cfg: TrainerSettings, weights_dir: Path | None = None, step: int = 0
    ) -> TrainerCore:
        """Policy from ``weights_dir`` (a published version: full weights or a LoRA adapter on
        ``cfg.model``) or ``cfg.model``; the OPD teacher is a frozen reference: a copy of
        ``cfg.model`` for full fine-tuning, the base with adapters off for LoRA."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(cfg.seed)
        base = resolve_model_path(cfg.model)
        tokenizer = AutoTokenizer.from_pretrained(base)
        reference = None
        if cfg.uses_lora:
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            model = _with_adapter(model, cfg, weights_dir)
        else:
            if is_adapter_version(weights_dir):
                raise ValueError(
                    f"{weights_dir} holds a LoRA adapter; train it with --adapter lora"
                )
            src = weights_dir if weights_dir is not None else base
            model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
            needs_teacher = methods.get(cfg.method).uses("opd") and cfg.teacher == "reference"
            if needs_teacher or cfg.kl_coef > 0:
                if weights_dir is None:
                    reference = copy.deepcopy(model)
                else:
                    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        core = cls(cfg, model, tokenizer, reference=reference, step=step)
        core.base_path = base
        opt = None if weights_dir is None else weights_dir / "trainer" / OPTIMIZER_FILE
        if opt is not None and opt.exists():
            core.optimizer.load_state_dict(
                torch.load(opt, map_location=core.device, weights_only=True)
            )
        return core

    base_path: Path | None = None
    # The OPD teacher's log-probs of the batch being trained, shared by its PPO epochs.
    _teacher_cache: list[torch.Tensor | None] | None = None
    # Set by ``distributed.RankGroup.attach``: this process trains its shard of each batch.
    dist: DataParallel | None = None

    def base_model_info(self) -> dict[str, str] | None:
        """What a LoRA version's manifest records of its base, checked before serving it."""
        if not self.lora or self.base_path is None:
            return None
        from pipeline.models.store import fingerprint

        return {"path": str(self.base_path), "fingerprint": fingerprint(self.base_path)}

    def load_snapshot(self, directory: Path | None) -> Any:
        """A frozen, plain (merged) model of a published version, or of the base (None)."""
        from transformers import AutoModelForCausalLM

        base = self.base_path or resolve_model_path(self.cfg.model)
        if directory is None or not is_adapter_version(directory):
            model = AutoModelForCausalLM.from_pretrained(directory or base, dtype=torch.float32)
        else:
            from peft import PeftModel

            plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            model = PeftModel.from_pretrained(plain, directory).merge_and_unload()
        # transformers' decorator on PreTrainedModel.to hides its signature from the checker.
        return model.to(self.device).eval().requires_grad_(False)  # type: ignore[arg-type]

    def save_weights(self, directory: Path) -> None:
        """Servable files: safetensors weights, config and tokenizer; for a LoRA policy only
        the adapter (``adapter_config.json`` + ``adapter_model.safetensors``)."""
        if self.lora:
            self.model.save_pretrained(directory, safe_serialization=True)
            (Path(directory) / PEFT_MODEL_CARD).unlink(missing_ok=True)
            return
        self.model.save_pretrained(directory, safe_serialization=True)
        self.tokenizer.save_pretrained(directory)

    def save_optimizer(self, path: Path) -> None:
        torch.save(self.optimizer.state_dict(), path)

    # ---- the step -------------------------------------------------------------------------

    def _response_logits(
        self, model: Any, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Logits predicting each response token, ``[B, R_max, V]`` (right-padded)."""
        return scoring.response_logits(
            model,
            prompts,
            responses,
            pad_id=self.pad_id,
            device=self.device,
            autocast_dtype=self.autocast_dtype,
        )

    def _teacher_model(self) -> Any:
        return self.reference if self.reference is not None else self.model

    def _teacher_context(self) -> contextlib.AbstractContextManager[Any]:
        if self.base_teacher:
            return self.model.disable_adapter()
        return contextlib.nullcontext()

    def _teacher_logits(self, samples: Sequence[Sample]) -> list[torch.Tensor | None]:
        """Per sample, teacher log-probs ``[H, R, V]`` under each hinted prompt (None: no hint).

        Hinted sequences of consecutive samples share a forward pass while their padded size
        stays within the batch token bound (hints make prompts longer than the student's)."""
        out: list[torch.Tensor | None] = [None] * len(samples)
        group: list[int] = []
        seqs: list[tuple[Sequence[int], Sequence[int]]] = []

        def flush() -> None:
            if not seqs:
                return
            with self._teacher_context():
                logits = self._response_logits(self._teacher_model(), *zip(*seqs, strict=True))
            logp = torch.log_softmax(logits, dim=-1)
            at = 0
            for b in group:
                s = samples[b]
                h, r = len(s.hints[:MAX_HINTS]), len(s.response_token_ids)
                out[b] = logp[at : at + h, :r]
                at += h
            group.clear()
            seqs.clear()

        for b, s in enumerate(samples):
            if not s.hints:
                continue
            mine = [
                (
                    teacher_prompt(s.prompt_token_ids, h, self.tokenizer, self.markers),
                    s.response_token_ids,
                )
                for h in s.hints[:MAX_HINTS]
            ]
            longest = max(len(p) + len(r) for p, r in [*seqs, *mine])
            if seqs and longest * (len(seqs) + len(mine)) > self.cfg.batch_max_tokens:
                flush()
            group.append(b)
            seqs.extend(mine)
        flush()
        return out

    def _choose_hint(
        self,
        sample: Sample,
        teacher: torch.Tensor,
        student_logp: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor, str]:
        """Teacher log-probs ``[R, V]`` of the chosen hint(s) and the (most used) hint text."""
        hints = sample.hints[:MAX_HINTS]
        lengths = [len(h) for h in hints]
        if len(hints) == 1 or self.cfg.hint_selection == "shortest":
            overlap = torch.zeros((len(hints), teacher.shape[1]), dtype=torch.long)
        else:
            overlap = hs.overlap_counts(student_logp, teacher, self.cfg.topk)
        choice = hs.select_hint(
            overlap.cpu(), self.cfg.hint_selection, hint_lengths=lengths, token_mask=mask.cpu()
        )
        chosen = hints[Counter(choice.tolist()).most_common(1)[0][0]]
        return hs.gather_hint(teacher, choice.to(teacher.device)), chosen

    def train_step(
        self,
        samples: Sequence[Sample],
        current_version: int,
        staleness: Sequence[int] | None = None,
    ) -> StepResult:
        """One gradient step on ``samples`` (already checked by ``batching.check_sample``).

        ``staleness``: per sample, how many versions of the current version's lineage came
        after the one that produced it (the loop's count, where rejected candidates, never
        served, do not count); default ``current_version − behavior_weight_version``.

        The RL term trains ``loss_mask`` and the OPD term ``opd_mask`` (hinted samples only), so
        a hinted turn with a neutral score trains OPD alone. Both terms are aggregated over the
        same rows and the same normalising mask (see :meth:`_batch_rows`).

        The stages, top to bottom: prepare (tensors, what trains where), shard (this rank's
        rows; all of them in one process), then per PPO epoch forward → loss parts → backward
        → reduce (the ranks' summed gradient) → optimizer step, and the report. Data
        parallelism is the group around them (:class:`DataParallel`), not a branch inside."""
        t0 = time.perf_counter()
        group = self.dist or LOCAL
        b = self._prepare(samples, current_version, staleness)
        self._shard(b, group)
        if current_version != self.version_seen:
            self.version_seen, self.steps_on_version = current_version, 0
        lag = self.steps_on_version
        ref = (
            self._reference_logprobs(samples, b.active, b.rmax, b.tokens)
            if self.cfg.kl_coef > 0
            else None
        )
        epochs = max(1, self.cfg.ppo_epochs)
        first: tuple[dict[str, L.LossOutput], L.LossOutput, float | None] | None = None
        clock = _Clock()
        grad_norms: list[float] = []
        self._teacher_cache = None
        try:
            for epoch in range(epochs):
                logits = self._active_logits(samples, b.active, b.rmax)  # forward
                logp_cur = L.token_logprobs(logits, b.tokens)
                if epoch == 0:  # the ratio's reference, fixed over the epochs
                    self._first_epoch(b, logp_cur.detach(), current_version, lag)
                parts, out = self._loss_parts(b, logits, logp_cur, ref, clock)
                grad_norm = self._backward_and_step(out, b.trained_tokens, group, clock)
                if grad_norm is not None and b.trained_tokens > 0:
                    grad_norms.append(grad_norm)
                if first is None:
                    first = (parts, out, grad_norm)
                if grad_norm is None or b.trained_tokens == 0:
                    break  # a non-finite gradient or nothing to train: no further epochs
        finally:
            self._teacher_cache = None
        assert first is not None
        return self._report(b, first, parts, grad_norms, epochs, lag, current_version, t0, clock)

    # ---- the stages of a step -----------------------------------------------------------

    def _prepare(
        self, samples: Sequence[Sample], current_version: int, staleness: Sequence[int] | None
    ) -> _Batch:
        """The batch as padded tensors, and which rows train which term."""
        cfg = self.cfg
        dev = self.device
        bsz = len(samples)
        rmax = max(len(s.response_token_ids) for s in samples)

        def pad(rows: Sequence[Sequence[float]], dtype: torch.dtype) -> torch.Tensor:
            out = torch.zeros((bsz, rmax), dtype=dtype)
            for b, row in enumerate(rows):
                out[b, : len(row)] = torch.tensor(row, dtype=dtype)
            return out.to(dev)

        def flags(values: list[bool]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.bool, device=dev)

        tokens = pad([s.response_token_ids for s in samples], torch.long)
        loss_mask = pad([s.loss_mask for s in samples], torch.float32)
        opd_mask = pad([self._opd_mask_of(s) for s in samples], torch.float32)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32, device=dev)
        # check_sample refuses a non-finite reward; one that overflows float32 (or a caller
        # that skipped the check) must still not reach an advantage: it trains no RL term.
        finite = torch.isfinite(rewards)
        rewards = torch.where(finite, rewards, torch.zeros_like(rewards))
        versions = torch.tensor([s.behavior_weight_version for s in samples], device=dev)
        if staleness is None:
            lag_v = (current_version - versions).clamp(min=0)
            stale = ~L.staleness_keep_mask(versions, current_version, cfg.max_staleness)
        else:
            lag_v = torch.tensor(list(staleness), dtype=torch.long, device=dev)
            stale = lag_v > cfg.max_staleness
        held_list = [cfg.gate and is_held_out(s.event_id, cfg.gate_holdout) for s in samples]
        held = flags(held_list)
        has_hint = self._has_hint(samples).bool()
        not_masked = flags([not s.masked for s in samples])
        rl_ok = not_masked & ~held & finite & (loss_mask.sum(dim=-1) > 0)
        opd_ok = not_masked & ~held & has_hint & (opd_mask.sum(dim=-1) > 0)
        no = torch.zeros_like(rl_ok)
        method = methods.get(cfg.method)
        uses_rl, uses_opd = method.uses("rl"), method.uses("opd")
        usable = (rl_ok if uses_rl else no) | (opd_ok if uses_opd else no)
        fresh_enough = ~stale if cfg.staleness == "drop" else torch.ones_like(stale)
        mask_rl = loss_mask * (rl_ok & fresh_enough)[:, None].float()
        mask_opd = opd_mask * (opd_ok & fresh_enough)[:, None].float()
        rows, norm = self._batch_rows(has_hint, held, mask_rl, mask_opd, uses_rl, uses_opd)
        # Binary RL's baseline per row (before any data-parallel shard): the whole batch's mean
        # reward over its trained rows that are not group-normalised; 0 for a group-normalised
        # row; a failed session's row never above 0 (L.row_baselines).
        baseline: float | torch.Tensor = 0.0
        batch_mean = 0.0
        if uses_rl:
            base, mean = L.row_baselines(
                rewards, mask_rl.sum(dim=-1) > 0, flags([s.normalized for s in samples]),
                flags([s.outcome_failed() for s in samples]),
                batch_mean=cfg.rl_baseline == "batch_mean",
            )  # fmt: skip
            baseline, batch_mean = base, float(mean)
        return _Batch(
            samples=samples,
            rmax=rmax,
            tokens=tokens,
            rewards=rewards,
            versions=versions,
            valid=pad([[1.0] * len(s.response_token_ids) for s in samples], torch.float32),
            behavior=pad([s.behavior_logprobs for s in samples], torch.float32),
            lag_v=lag_v,
            stale=stale,
            held_list=held_list,
            has_hint=has_hint,
            rl_ok=rl_ok,
            usable=usable,
            keep=usable & fresh_enough,
            mask_rl=mask_rl,
            mask_opd=mask_opd,
            rows=rows,
            norm=norm,
            baseline=baseline,
            batch_mean=batch_mean,
            method=method,
            options=methods.options(cfg.method, cfg.method_options),
            mine=torch.ones(bsz, dtype=torch.bool, device=dev),
            trained_tokens=int(norm.sum().item()),
        )

    @staticmethod
    def _shard(b: _Batch, group: DataParallel) -> None:
        """This rank's rows keep their tokens in the numerators; ``rows`` and ``norm`` stay
        the whole batch's, so the ranks' losses add up to the batch's loss and their summed
        gradients to its gradient, whatever the aggregate. Rows with nothing to train (a
        closing turn, a stale or held-out sample) need no forward pass."""
        b.mine = group.shard(b.samples, b.trainable(), b.method.uses("opd"))
        b.mask_rl = b.mask_rl * b.mine[:, None]
        b.mask_opd = b.mask_opd * b.mine[:, None]
        b.active = b.trainable()

    def _first_epoch(self, b: _Batch, prox: torch.Tensor, current_version: int, lag: int) -> None:
        """Before any update: the ratio's reference, stale rows' weights, drift, statuses."""
        cfg = self.cfg
        # Drift is engine vs trainer on the weights that produced the sample: after a step at
        # the same version the difference would be learning.
        fresh_rows = (b.versions == current_version) & b.active & (lag == 0)
        b.drift = self._logprob_drift(prox, b.behavior, b.valid * fresh_rows[:, None])
        # Ratio reference (fixed over the epochs): the engine's recorded log-probs, or the
        # trainer's own recomputation before the first update (slime's default, which
        # recomputes unless --use-rollout-logprobs).
        b.logp_old = prox if cfg.old_logprobs == "trainer" else b.behavior
        if cfg.staleness == "tis" and bool(b.stale.any()):
            # Decoupled correction for stale samples: trust region around the pre-update
            # policy, truncated importance weights behavior -> it.
            tis = L.tis_weights(prox, b.behavior, cfg.tis_cap)
            b.logp_old = torch.where(b.stale[:, None], prox, b.logp_old)
            b.weights = torch.where(b.stale[:, None], tis, torch.ones_like(tis))
        uses_rl, uses_opd = b.method.uses("rl"), b.method.uses("opd")
        b.outcomes = [
            SampleOutcome(
                status="trained"
                if b.keep[i]
                else "stale_dropped"
                if b.usable[i]
                else HELD_OUT
                if b.held_list[i]
                else "no_hint"
                if uses_opd and not uses_rl and b.rl_ok[i] and not b.has_hint[i]
                else "masked",
                staleness=int(b.lag_v[i]),
            )
            for i in range(len(b.samples))
        ]

    def _loss_parts(
        self,
        b: _Batch,
        logits: torch.Tensor,
        logp_cur: torch.Tensor,
        ref: torch.Tensor | None,
        clock: _Clock,
    ) -> tuple[dict[str, L.LossOutput], L.LossOutput]:
        """Each loss part of the method, their combination, and the KL to the reference."""
        cfg = self.cfg
        assert b.logp_old is not None  # set by the first epoch
        parts: dict[str, L.LossOutput] = {}
        for name in b.method.parts:
            part = methods.PARTS[name]
            t1 = time.perf_counter()
            parts[name] = part.fn(
                methods.StepInputs(
                    core=self,
                    cfg=cfg,
                    samples=b.samples,
                    resp_logits=logits,
                    tokens=b.tokens,
                    logp=logp_cur,
                    logp_old=b.logp_old,
                    rewards=b.rewards,
                    mask=b.mask_rl if part.mask == "rl" else b.mask_opd,
                    weights=b.weights,
                    outcomes=b.outcomes,
                    rows=b.rows,
                    norm=b.norm,
                    baseline=b.baseline,
                    batch_mean=b.batch_mean,
                    options=b.options,
                )
            )
            if part.mask == "opd":  # the OPD mask's parts run the teacher
                clock.teacher += time.perf_counter() - t1
        out = b.method.combine(parts, cfg)
        if ref is not None:
            rows, norm = b.rows, b.norm
            kl = L.kl_to_reference(
                logp_cur[rows],
                ref[rows],
                (norm * b.mine[:, None])[rows],
                aggregate=cfg.aggregate,
                norm_mask=norm[rows],
            )
            parts["kl"] = kl
            total = out.loss + cfg.kl_coef * kl.loss
            out = L.LossOutput(
                total,
                {**out.metrics, "kl_ref": kl.metrics["kl_ref"], "loss": float(total.detach())},
            )
        return parts, out

    def _backward_and_step(
        self, out: L.LossOutput, trained_tokens: int, group: DataParallel, clock: _Clock
    ) -> float | None:
        """Backward, the ranks' summed gradient, clip, one optimizer step; the grad norm
        (None when it is not finite: no step)."""
        t1 = time.perf_counter()
        if out.loss.requires_grad:  # no active row: nothing to differentiate
            out.loss.backward()
        t2 = time.perf_counter()
        clock.backward += t2 - t1
        group.all_reduce_grads(self.model)  # every rank clips and steps on the same gradient
        t_sync = time.perf_counter()
        clock.sync += t_sync - t2
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm: float | None = 0.0
        if params:
            max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if grad_norm is None or not math.isfinite(grad_norm):
            grad_norm = None
        elif trained_tokens > 0:
            self._warm_up_lr()
            self.optimizer.step()
            self.steps_on_version += 1
        self.optimizer.zero_grad(set_to_none=True)
        clock.optimizer += time.perf_counter() - t_sync
        return grad_norm

    def _report(
        self,
        b: _Batch,
        first: tuple[dict[str, L.LossOutput], L.LossOutput, float | None],
        last_parts: dict[str, L.LossOutput],
        grad_norms: list[float],
        epochs: int,
        lag: int,
        current_version: int,
        t0: float,
        clock: _Clock,
    ) -> StepResult:
        """The step as reported: its first (on-policy) epoch, the last epoch's drift from it,
        and, across ranks, the whole batch's figures."""
        cfg = self.cfg
        last_main = last_parts[b.method.main]
        parts, out, grad_norm = first
        main = parts[b.method.main]
        t3 = time.perf_counter()
        t2 = t3 - clock.optimizer - clock.sync  # forward, teacher, backward (all epochs)
        self.step += 1
        if epochs > 1:
            out = L.LossOutput(
                out.loss,
                {
                    **out.metrics,
                    "epochs": float(len(grad_norms)),
                    "grad_norm_last": grad_norms[-1] if grad_norms else 0.0,
                    "approx_kl_last": last_main.metrics.get("approx_kl", 0.0),
                    "clip_fraction_last": last_main.metrics.get("clip_fraction", 0.0),
                },
            )
        timings = {"compute_s": t2 - t0, "optimizer_s": clock.optimizer, "teacher_s": clock.teacher}
        drift = b.drift
        if self.dist is not None:
            numerators = {
                "rl": b.mask_rl[b.rows],
                "opd": b.mask_opd[b.rows],
                "kl": (b.norm * b.mine[:, None])[b.rows],
            }
            out, drift = self._combine_ranks(
                b.method, parts, out, drift, b.outcomes, b.mine, numerators
            )
            timings["sync_s"] = clock.sync + time.perf_counter() - t3
        losses = {name: part.metrics["loss"] for name, part in parts.items()}
        losses["total"] = out.metrics["loss"]
        samples = b.samples
        return StepResult(
            step=self.step,
            weight_version=current_version,
            losses=losses,
            kl=main.metrics.get("approx_kl", 0.0),
            clip_fraction=min(1.0, max(0.0, main.metrics.get("clip_fraction", 0.0))),
            grad_norm=grad_norm,
            samples=len(samples),
            tokens=sum(len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples),
            trained_tokens=b.trained_tokens,
            dropped_stale=int((b.stale & b.usable).sum()) if cfg.staleness == "drop" else 0,
            reward_mean=float(b.rewards.mean()),
            # policy_lag_steps: optimizer steps this version's weights had taken before this
            # one (staleness counts published versions; this counts what they hide)
            metrics={**out.metrics, **drift, "policy_lag_steps": float(lag)},
            outcomes=b.outcomes,
            timings=timings,
        )

    def _combine_ranks(
        self,
        method: methods.Method,
        parts: dict[str, L.LossOutput],
        out: L.LossOutput,
        drift: dict[str, float],
        outcomes: list[SampleOutcome],
        mine: torch.Tensor,
        numerators: dict[str, torch.Tensor],
    ) -> tuple[L.LossOutput, dict[str, float]]:
        """Data parallel: the whole batch's metrics and chosen hints, from every rank's (see
        ``RankGroup.combine``); a part's metrics are weighted by the tokens this rank trained
        in it (``numerators``: this rank's token masks by mask kind, and the KL term's)."""
        assert self.dist is not None
        tokens = {name: float(numerators[methods.PARTS[name].mask].sum()) for name in method.parts}
        tokens["kl"] = float(numerators["kl"].sum())

        def weight(key: str) -> float:
            prefix = key.split("/", 1)[0] if "/" in key else None
            if key == "kl_ref" or prefix == "joint":  # hybrid's joint term: the union mask
                return tokens["kl"]
            return tokens[prefix if prefix in tokens else method.main]

        local = {
            f"part/{name}/{k}": (v, tokens.get(name, tokens["kl"]))
            for name, part in parts.items()
            for k, v in part.metrics.items()
        }
        local.update({f"out/{k}": (v, weight(k)) for k, v in out.metrics.items()})
        count = drift.get("logprob_drift_tokens", 0.0)
        local.update({f"drift/{k}": (v, count) for k, v in drift.items()})
        hints = {
            b: o.selected_hint
            for b, o in enumerate(outcomes)
            if bool(mine[b]) and o.selected_hint is not None
        }
        merged, chosen = self.dist.combine(local, hints)
        for b, text in chosen.items():
            outcomes[b].selected_hint = text

        def section(name: str) -> dict[str, float]:
            head = f"{name}/"
            return {k[len(head) :]: v for k, v in merged.items() if k.startswith(head)}

        for name, part in parts.items():
            part.metrics = section(f"part/{name}")
        return L.LossOutput(out.loss, section("out")), section("drift")

    def _active_logits(
        self,
        samples: Sequence[Sample],
        active: torch.Tensor,
        rmax: int,
        model: Any | None = None,
    ) -> torch.Tensor:
        """Response logits ``[B, rmax, V]``: computed for active rows, zeros elsewhere."""
        model = self.model if model is None else model
        idx = active.nonzero().squeeze(-1).tolist()
        if len(idx) == len(samples):
            return self._response_logits(
                model,
                [s.prompt_token_ids for s in samples],
                [s.response_token_ids for s in samples],
            )
        out = torch.zeros((len(samples), rmax, self.vocab_size), device=self.device)
        if idx:
            sub = self._response_logits(
                model,
                [samples[i].prompt_token_ids for i in idx],
                [samples[i].response_token_ids for i in idx],
            )
            out = out.index_copy(
                0,
                torch.tensor(idx, device=self.device),
                torch.nn.functional.pad(sub, (0, 0, 0, rmax - sub.shape[1])),
            )
        return out

    def _reference_logprobs(
        self, samples: Sequence[Sample], active: torch.Tensor, rmax: int, tokens: torch.Tensor
    ) -> torch.Tensor:
        """Log-probs of the response tokens under the frozen reference (the base with the
        adapter off for LoRA, the reference copy for full fine-tuning)."""
        with torch.no_grad():
            if self.lora:
                with self.model.disable_adapter():
                    logits = self._active_logits(samples, active, rmax)
            elif self.reference is not None:
                logits = self._active_logits(samples, active, rmax, self.reference)
            else:  # pragma: no cover - load() always provides one when kl_coef > 0
                raise ValueError("kl_coef > 0 needs a reference model")
            return L.token_logprobs(logits, tokens)

    def updates_done(self) -> int:
        """Optimizer updates so far (Adam's step count, restored with the optimizer state)."""
        steps = [int(state["step"]) for state in self.optimizer.state.values() if "step" in state]
        return max(steps, default=0)

    def _warm_up_lr(self) -> None:
        """Set the learning rate of the coming update (:func:`losses.warmup_factor`)."""
        lr = self.cfg.learning_rate * L.warmup_factor(self.updates_done(), self.cfg.lr_warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _has_hint(self, samples: Sequence[Sample]) -> torch.Tensor:
        return torch.tensor([bool(s.hints) for s in samples], device=self.device).float()

    @staticmethod
    def _opd_mask_of(sample: Sample) -> Sequence[int]:
        """The sample's OPD mask; ``loss_mask`` for older events or a mask of the wrong length
        (``check_sample`` validates ``loss_mask`` only)."""
        mask = sample.opd_token_mask()
        return mask if len(mask) == len(sample.response_token_ids) else sample.loss_mask

    def _batch_rows(
        self,
        has_hint: torch.Tensor,
        held: torch.Tensor,
        mask_rl: torch.Tensor,
        mask_opd: torch.Tensor,
        uses_rl: bool,
        uses_opd: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows the loss is averaged over, and the mask that normalises both terms.

        Rows follow the reference's batches: OpenClaw-RL (``rl``) and its combine launcher
        (``hybrid``) submit every scored turn, excluded ones with a zero loss mask, and slime
        divides by the whole batch, so every row counts (held-out rows are evaluation data, not
        batch rows); OpenClaw-OPD submits hinted turns only, so ``opd`` averages over hinted
        rows. The normalising mask is the union of the method's masks, so in ``hybrid`` the OPD
        term is averaged over the batch like the RL term (an unhinted token is a zero in it,
        not absent from it) instead of over hinted tokens only."""
        if not uses_rl:  # OPD-mask parts only: hinted rows
            rows = has_hint & ~held
            norm = mask_opd
        else:
            rows = ~held
            norm = torch.maximum(mask_rl, mask_opd) if uses_opd else mask_rl
        return rows.nonzero().squeeze(-1), norm

    @staticmethod
    def _logprob_drift(
        trainer_logp: torch.Tensor, behavior: torch.Tensor, fresh: torch.Tensor
    ) -> dict[str, float]:
        """Engine vs trainer log-probs: mean and max ``|ℓ_trainer − ℓ_behavior|`` over the
        response tokens of samples generated by the weights the trainer holds now (the current
        version, before any step on it: then the trainer's forward pass *is* the behaviour
        policy, so any difference is numerical drift). Empty when the batch has no such
        sample."""
        count = int(fresh.sum().item())
        if count == 0:
            return {}
        diff = (trainer_logp.float() - behavior.float()).abs() * fresh
        return {
            "logprob_drift_mean": float(diff.sum() / count),
            "logprob_drift_max": float(diff.max()),
            "logprob_drift_tokens": float(count),
        }

    def _opd_part(
        self,
        samples: Sequence[Sample],
        resp_logits: torch.Tensor,
        tokens: torch.Tensor,
        logp_cur: torch.Tensor,
        logp_old: torch.Tensor,
        mask_opd: torch.Tensor,
        weights: torch.Tensor | None,
        outcomes: list[SampleOutcome],
        rows: torch.Tensor,
        norm: torch.Tensor,
    ) -> L.LossOutput:
        """The OPD term over ``rows``, trained where ``mask_opd`` is set and normalised by
        ``norm``; teacher passes run only for samples the term trains."""
        cfg = self.cfg
        bsz, rmax, _ = resp_logits.shape
        k = cfg.topk
        logp_full = torch.log_softmax(resp_logits, dim=-1)
        student = logp_full.detach()
        teacher_tok = torch.zeros((bsz, rmax), device=self.device)
        indices = torch.zeros((bsz, rmax, k), dtype=torch.long, device=self.device)
        subset = torch.ones((bsz, rmax, k), dtype=torch.bool, device=self.device)
        teacher_k = torch.zeros((bsz, rmax, k), device=self.device)
        trains = (mask_opd.sum(dim=-1) > 0).tolist()
        with torch.no_grad():
            if self._teacher_cache is None or len(self._teacher_cache) != len(samples):
                self._teacher_cache = self._teacher_logits(
                    [s if t else replace(s, hints=[]) for s, t in zip(samples, trains, strict=True)]
                )
            teachers = self._teacher_cache
            for b, s in enumerate(samples):
                teacher = teachers[b]
                if teacher is None:
                    continue
                r = len(s.response_token_ids)
                chosen, text = self._choose_hint(s, teacher, student[b, :r], mask_opd[b, :r])
                outcomes[b].selected_hint = text
                teacher_tok[b, :r] = chosen.gather(-1, tokens[b, :r, None]).squeeze(-1)
                if cfg.opd_loss == "topk":
                    idx, sub = hs.vocab_subset(student[b, :r], chosen, cfg.topk_subset, k)
                    indices[b, :r], subset[b, :r] = idx, sub
                    teacher_k[b, :r] = chosen.gather(-1, idx)
        w = None if weights is None else weights[rows]
        if cfg.opd_loss == "token":
            out = L.opd_loss(
                logp_cur[rows],
                logp_old[rows],
                teacher_tok[rows],
                mask_opd[rows],
                clip_c=cfg.opd_clip,
                eps=cfg.eps,
                eps_high=cfg.eps_high,
                aggregate=cfg.aggregate,
                weights=w,
                norm_mask=norm[rows],
            )
        else:
            cur_k = L.gather_vocab(logp_full, indices)[rows]
            # Behavior log-probs exist only for sampled tokens, so the top-k ratio is taken
            # against the current epoch's policy (ρ_v = 1: no trust region across epochs).
            out = L.topk_opd_loss(
                cur_k,
                cur_k.detach(),
                teacher_k[rows],
                mask_opd[rows],
                subset_mask=subset[rows],
                clip_c=cfg.opd_clip,
                eps=cfg.eps,
                eps_high=cfg.eps_high,
                aggregate=cfg.aggregate,
                weights=w,
                norm_mask=norm[rows],
            )
        # what hybrid's advantage combine reuses: the sampled tokens under the teacher
        out.inputs.update(teacher_logp=teacher_tok[rows], mask=mask_opd[rows])
        return out


def _is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _with_adapter(model: Any, cfg: TrainerSettings, weights_dir: Path | None) -> Any:
    """Wrap ``model`` with a trainable LoRA adapter: the published one in ``weights_dir``, or
    a fresh one (B = 0, so version 0 answers exactly like the base)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if weights_dir is not None:
        if not is_adapter_version(weights_dir):
            raise ValueError(
                f"{weights_dir} holds full weights, not a LoRA adapter; "
                "train it with --adapter full"
            )
        return PeftModel.from_pretrained(model, weights_dir, is_trainable=True)
    config = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,  # type: ignore[arg-type]  # peft says int; scales by alpha / r
        lora_dropout=cfg.lora_dropout,
        target_modules=list(cfg.lora_target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)
