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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.events import Sample
from pipeline.trainer import hint_selection as hs
from pipeline.trainer import losses as L
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.gate import HELD_OUT, is_held_out
from pipeline.trainer.prompts import ChatMarkers, teacher_prompt

MAX_HINTS = 3
OPTIMIZER_FILE = "optimizer.pt"


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


def resolve_model_path(model: str) -> Path:
    """``tiny`` means the built-in tiny model (built once into the cache)."""
    if model == "tiny":
        from pipeline.models.tiny import ensure_tiny_model

        return ensure_tiny_model()
    return Path(model)


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
        self.tokenizer = tokenizer
        self.markers = ChatMarkers.from_tokenizer(tokenizer)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        self.step = step
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and self.device.type == "cuda")
        self.autocast_dtype = torch.bfloat16 if bf16 else None

    # ---- construction / persistence ---------------------------------------------------

    @classmethod
    def load(cls, cfg: TrainerSettings, weights_dir: Path | None = None, step: int = 0):  # type: ignore[no-untyped-def]
        """Policy from ``weights_dir`` (a published version) or ``cfg.model``; reference from
        ``cfg.model`` when the OPD teacher is the frozen reference."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(cfg.seed)
        base = resolve_model_path(cfg.model)
        src = weights_dir if weights_dir is not None else base
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src)
        reference = None
        if cfg.method != "rl" and cfg.teacher == "reference":
            if weights_dir is None:
                reference = copy.deepcopy(model)
            else:
                reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        core = cls(cfg, model, tokenizer, reference=reference, step=step)
        opt = None if weights_dir is None else weights_dir / "trainer" / OPTIMIZER_FILE
        if opt is not None and opt.exists():
            core.optimizer.load_state_dict(
                torch.load(opt, map_location=core.device, weights_only=True)
            )
        return core

    def save_weights(self, directory: Path) -> None:
        """Servable files: safetensors weights, config and tokenizer."""
        self.model.save_pretrained(directory, safe_serialization=True)
        self.tokenizer.save_pretrained(directory)

    def save_optimizer(self, path: Path) -> None:
        torch.save(self.optimizer.state_dict(), path)

    # ---- the step -------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _response_logits(
        self, model: Any, prompts: Sequence[list[int]], responses: Sequence[list[int]]
    ) -> torch.Tensor:
        """Logits predicting each response token, ``[B, R_max, V]`` (right-padded)."""
        seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
        length = max(len(s) for s in seqs)
        rmax = max(len(r) for r in responses)
        ids = torch.full((len(seqs), length), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(seqs), length), dtype=torch.long)
        pos = torch.zeros((len(seqs), rmax), dtype=torch.long)
        for b, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
            ids[b, : len(s)] = torch.tensor(s)
            attn[b, : len(s)] = 1
            r = len(s) - len(p)
            pos[b, :r] = torch.arange(len(p) - 1, len(p) - 1 + r)
        ids, attn, pos = ids.to(self.device), attn.to(self.device), pos.to(self.device)
        with self._autocast():
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        return logits.gather(1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()

    def _teacher_model(self) -> Any:
        return self.reference if self.reference is not None else self.model

    def _teacher_logits(self, samples: Sequence[Sample]) -> list[torch.Tensor | None]:
        """Per sample, teacher log-probs ``[H, R, V]`` under each hinted prompt (None: no hint).

        Hinted sequences of consecutive samples share a forward pass while their padded size
        stays within the batch token bound (hints make prompts longer than the student's)."""
        out: list[torch.Tensor | None] = [None] * len(samples)
        group: list[int] = []
        seqs: list[tuple[list[int], list[int]]] = []

        def flush() -> None:
            if not seqs:
                return
            logp = torch.log_softmax(
                self._response_logits(self._teacher_model(), *zip(*seqs, strict=True)), dim=-1
            )
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
                (teacher_prompt(s.prompt_token_ids, h, self.tokenizer, self.markers),
                 s.response_token_ids)
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
        self, sample: Sample, teacher: torch.Tensor, student_logp: torch.Tensor,
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

    def train_step(self, samples: Sequence[Sample], current_version: int) -> StepResult:
        """One gradient step on ``samples`` (already checked by ``batching.check_sample``)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        dev = self.device
        bsz = len(samples)
        rmax = max(len(s.response_token_ids) for s in samples)

        def pad(rows: list[list[float]], dtype: torch.dtype) -> torch.Tensor:
            out = torch.zeros((bsz, rmax), dtype=dtype)
            for b, row in enumerate(rows):
                out[b, : len(row)] = torch.tensor(row, dtype=dtype)
            return out.to(dev)

        tokens = pad([s.response_token_ids for s in samples], torch.long)
        loss_mask = pad([s.loss_mask for s in samples], torch.float32)
        behavior = pad([s.behavior_logprobs for s in samples], torch.float32)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32, device=dev)
        versions = torch.tensor([s.behavior_weight_version for s in samples], device=dev)
        staleness = (current_version - versions).clamp(min=0)
        held = [cfg.gate and is_held_out(s.event_id, cfg.gate_holdout) for s in samples]
        usable = torch.tensor(
            [not s.masked and not h for s, h in zip(samples, held, strict=True)], device=dev
        )
        usable &= loss_mask.sum(dim=-1) > 0
        stale = ~L.staleness_keep_mask(versions, current_version, cfg.max_staleness)
        keep = usable & ~stale if cfg.staleness == "drop" else usable

        resp_logits = self._response_logits(
            self.model,
            [s.prompt_token_ids for s in samples],
            [s.response_token_ids for s in samples],
        )
        logp_cur = L.token_logprobs(resp_logits, tokens)
        prox = logp_cur.detach()
        weights: torch.Tensor | None = None
        logp_old = behavior
        if cfg.staleness == "tis" and bool(stale.any()):
            # Decoupled correction for stale samples: trust region around the pre-update
            # policy, truncated importance weights for behavior -> pre-update.
            tis = L.tis_weights(prox, behavior, cfg.tis_cap)
            logp_old = torch.where(stale[:, None], prox, behavior)
            weights = torch.where(stale[:, None], tis, torch.ones_like(tis))
        mask_rl = loss_mask * keep[:, None].float()

        outcomes = [
            SampleOutcome(
                status="trained" if keep[b] else "stale_dropped" if usable[b]
                else HELD_OUT if held[b] else "masked",
                staleness=int(staleness[b]),
            )
            for b in range(bsz)
        ]
        parts: dict[str, L.LossOutput] = {}
        if cfg.method in ("rl", "hybrid"):
            parts["rl"] = L.binary_rl_loss(
                logp_cur, logp_old, rewards, mask_rl, eps=cfg.eps, eps_high=cfg.eps_high,
                aggregate=cfg.aggregate, weights=weights,
            )
        t_teacher = 0.0
        if cfg.method in ("opd", "hybrid"):
            t1 = time.perf_counter()
            parts["opd"] = self._opd_part(samples, resp_logits, tokens, logp_cur, logp_old,
                                          mask_rl, weights, outcomes)
            t_teacher = time.perf_counter() - t1
        if cfg.method == "hybrid":
            out = L.hybrid_loss(parts["rl"], parts["opd"], w_rl=cfg.w_rl, w_opd=cfg.w_opd)
            main = parts["rl"]
        else:
            out = main = parts[cfg.method]

        trained = mask_rl if cfg.method != "opd" else mask_rl * self._has_hint(samples)[:, None]
        trained_tokens = int(trained.sum().item())
        out.loss.backward()
        t2 = time.perf_counter()
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm: float | None = 0.0
        if params:
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if grad_norm is None or not math.isfinite(grad_norm):
            grad_norm = None
        elif trained_tokens > 0:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        self.step += 1

        losses = {name: part.metrics["loss"] for name, part in parts.items()}
        losses["total"] = out.metrics["loss"]
        return StepResult(
            step=self.step,
            weight_version=current_version,
            losses=losses,
            kl=main.metrics["approx_kl"],
            clip_fraction=min(1.0, max(0.0, main.metrics["clip_fraction"])),
            grad_norm=grad_norm,
            samples=bsz,
            tokens=sum(len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples),
            trained_tokens=trained_tokens,
            dropped_stale=int((stale & usable).sum()) if cfg.staleness == "drop" else 0,
            reward_mean=float(rewards.mean()),
            metrics=dict(out.metrics),
            outcomes=outcomes,
            timings={"compute_s": t2 - t0, "optimizer_s": t3 - t2, "teacher_s": t_teacher},
        )

    def _has_hint(self, samples: Sequence[Sample]) -> torch.Tensor:
        return torch.tensor([bool(s.hints) for s in samples], device=self.device).float()

    def _opd_part(
        self,
        samples: Sequence[Sample],
        resp_logits: torch.Tensor,
        tokens: torch.Tensor,
        logp_cur: torch.Tensor,
        logp_old: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None,
        outcomes: list[SampleOutcome],
    ) -> L.LossOutput:
        cfg = self.cfg
        bsz, rmax, _ = resp_logits.shape
        k = cfg.topk
        has_hint = self._has_hint(samples)
        mask_opd = mask * has_hint[:, None]
        logp_full = torch.log_softmax(resp_logits, dim=-1)
        student = logp_full.detach()
        teacher_tok = torch.zeros((bsz, rmax), device=self.device)
        indices = torch.zeros((bsz, rmax, k), dtype=torch.long, device=self.device)
        subset = torch.ones((bsz, rmax, k), dtype=torch.bool, device=self.device)
        teacher_k = torch.zeros((bsz, rmax, k), device=self.device)
        with torch.no_grad():
            teachers = self._teacher_logits(samples)
            for b, s in enumerate(samples):
                teacher = teachers[b]
                if teacher is None:
                    if cfg.method == "opd" and outcomes[b].status == "trained":
                        outcomes[b].status = "no_hint"
                    continue
                r = len(s.response_token_ids)
                chosen, text = self._choose_hint(s, teacher, student[b, :r], mask[b, :r])
                outcomes[b].selected_hint = text
                teacher_tok[b, :r] = chosen.gather(-1, tokens[b, :r, None]).squeeze(-1)
                if cfg.opd_loss == "topk":
                    idx, sub = hs.vocab_subset(student[b, :r], chosen, cfg.topk_subset, k)
                    indices[b, :r], subset[b, :r] = idx, sub
                    teacher_k[b, :r] = chosen.gather(-1, idx)
        if cfg.opd_loss == "token":
            return L.opd_loss(
                logp_cur, logp_old, teacher_tok, mask_opd, clip_c=cfg.opd_clip, eps=cfg.eps,
                eps_high=cfg.eps_high, aggregate=cfg.aggregate, weights=weights,
            )
        cur_k = L.gather_vocab(logp_full, indices)
        # Behavior log-probs exist only for sampled tokens, so the top-k ratio is taken
        # against the pre-update policy (ρ_v = 1 at the first and only step per batch).
        return L.topk_opd_loss(
            cur_k, cur_k.detach(), teacher_k, mask_opd, subset_mask=subset, clip_c=cfg.opd_clip,
            eps=cfg.eps, eps_high=cfg.eps_high, aggregate=cfg.aggregate, weights=weights,
        )
