"""Promotion gate: a candidate version is promoted only if it does not regress on held-out turns.

Held-out set. With the gate on, a deterministic fraction of samples (``sha256(event_id)``
below ``gate_holdout``) is never trained on: the step masks it like a no-signal turn and its
trajectory row says ``status = "held_out"``. The evaluation set for version N is the newest
``gate_eval_samples`` held-out rows with a non-zero reward published up to N, in a fixed
order; it is rebuilt from the Delta ``trajectories`` table after a restart, so a recomputed
verdict sees the same rows as the original one.

Metric. ``score(θ) = Σ_i r_i Σ_t m_it log π_θ(y_it | x_i) / Σ_i Σ_t m_it``: the
reward-weighted mean log-probability of the recorded response tokens (what Binary RL pushes
up on good turns and down on bad ones), measured on turns the candidate never saw. The
candidate is compared with the live version: the newest ``promoted`` one, else the base
model. Promoted iff ``score(candidate) >= score(live) - gate_tolerance``; otherwise
rejected. Both scores, the delta, the positive/negative-turn log-probabilities and the
sample counts go into the verdict's ``metrics``.

Limits, stated plainly: this is an off-policy proxy (it scores recorded responses, it does
not sample and re-judge fresh ones) and it is only as representative as the recent traffic.

The verdict is stored in ``vN/trainer/verdict.json`` before it is appended to Delta and
sent, so a crash anywhere after that replays the same verdict rather than re-evaluating.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow.compute as pc
import torch
from deltalake import DeltaTable

from pipeline.durable import atomic_write
from pipeline.lake.reading import dataset
from pipeline.trainer import checkpoint as ck
from pipeline.trainer import losses as L
from pipeline.trainer.config import TrainerSettings
from pipeline.trainer.scoring import HELD_OUT, response_logits

VERDICT_FILE = "verdict.json"
VERDICT_DONE = "verdict.done"
_COLUMNS = [
    "event_id", "prompt_token_ids", "response_token_ids", "loss_mask", "reward",
    "weight_version", "step", "source_partition", "source_offset",
]


def _order(row: dict[str, Any]) -> tuple[int, int, int, int]:
    return (row["weight_version"], row["step"], row["source_partition"], row["source_offset"])


def read_verdict(directory: Path) -> dict[str, Any] | None:
    path = directory / ck.TRAINER_DIR / VERDICT_FILE
    return orjson.loads(path.read_bytes()) if path.exists() else None


def write_verdict(directory: Path, verdict: dict[str, Any]) -> None:
    """Atomic and durable: a crash leaves the old verdict or the new one."""
    atomic_write(directory / ck.TRAINER_DIR / VERDICT_FILE,
                 orjson.dumps(verdict, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2))


@dataclass(eq=False)
class Gate:
    """Held-out rows, the live (baseline) model, and the evaluation."""

    cfg: TrainerSettings
    rows: deque[dict[str, Any]] = field(init=False, repr=False)
    baseline: Any | None = field(default=None, init=False, repr=False)
    baseline_version: int = field(default=0, init=False)
    seeded_upto: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.rows = deque(maxlen=self.cfg.gate_eval_samples)

    # ---- state -------------------------------------------------------------------------

    def add(self, rows: Iterable[dict[str, Any]]) -> None:
        """Held-out rows with a reward signal, in the canonical order."""
        picked = [r for r in rows if r["status"] == HELD_OUT and r["reward"] != 0.0]
        self.rows.extend(sorted(picked, key=_order))

    def seed(self, core: Any, upto: int) -> None:
        """After a restart: held-out rows of versions <= ``upto`` from Delta, and the live model
        (newest promoted version <= ``upto``, else the base model)."""
        self.rows.clear()
        uri = str(Path(self.cfg.lake_root) / "trajectories")
        if DeltaTable.is_deltatable(uri):
            ds = dataset(uri)
            flt = (
                (pc.field("policy_id") == self.cfg.policy)
                & (pc.field("status") == HELD_OUT)
                & (pc.field("weight_version") <= upto)
            )
            found = ds.to_table(columns=[*_COLUMNS, "status"], filter=flt).to_pylist()
            self.add(found)
        self.baseline, self.baseline_version = None, 0
        for v in reversed(ck.versions(self.cfg.weights_root, self.cfg.policy)):
            d = ck.version_dir(self.cfg.weights_root, self.cfg.policy, v)
            verdict = read_verdict(d) if v <= upto else None
            if verdict is not None and verdict["status"] == "promoted":
                self.baseline = self._load(core, d)
                self.baseline_version = v
                break
        if self.baseline is None:
            self.baseline = self._load(core, None)
        self.seeded_upto = upto

    def _load(self, core: Any, directory: Path | None) -> Any:
        return core.load_snapshot(directory)

    def promote(self, core: Any, version: int) -> None:
        """The candidate (``core.model`` as published) becomes the live version."""
        if self.baseline is not None and type(self.baseline) is type(core.model):
            self.baseline.load_state_dict(core.model.state_dict())
        else:
            self.baseline = copy.deepcopy(core.model).eval().requires_grad_(False)
        self.baseline_version = version

    # ---- evaluation --------------------------------------------------------------------

    @torch.no_grad()
    def score(self, core: Any, model: Any, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
        was_training = model.training
        model.eval()
        weighted = tokens = 0.0
        pos = [0.0, 0.0]  # Σ logp, tokens on positive-reward turns
        neg = [0.0, 0.0]
        try:
            step = max(1, self.cfg.batch_max_samples)
            for i in range(0, len(rows), step):
                chunk = rows[i : i + step]
                logits = response_logits(
                    model, [r["prompt_token_ids"] for r in chunk],
                    [r["response_token_ids"] for r in chunk], pad_id=core.pad_id,
                    device=core.device, autocast_dtype=core.autocast_dtype,
                )
                rmax = logits.shape[1]
                ids = torch.zeros((len(chunk), rmax), dtype=torch.long)
                mask = torch.zeros((len(chunk), rmax))
                for b, r in enumerate(chunk):
                    n = len(r["response_token_ids"])
                    ids[b, :n] = torch.tensor(r["response_token_ids"])
                    mask[b, :n] = torch.tensor(r["loss_mask"], dtype=torch.float32)
                logp = L.token_logprobs(logits, ids.to(logits.device)).cpu() * mask
                per_seq, n_tok = logp.sum(-1), mask.sum(-1)
                for b, r in enumerate(chunk):
                    weighted += r["reward"] * float(per_seq[b])
                    tokens += float(n_tok[b])
                    acc = pos if r["reward"] > 0 else neg
                    acc[0] += float(per_seq[b])
                    acc[1] += float(n_tok[b])
        finally:
            model.train(was_training)
        return {
            "score": weighted / max(tokens, 1.0),
            "tokens": tokens,
            "logp_pos": pos[0] / pos[1] if pos[1] else 0.0,
            "logp_neg": neg[0] / neg[1] if neg[1] else 0.0,
        }

    def evaluate(self, core: Any, version: int) -> dict[str, Any] | None:
        """Verdict for ``core.model`` as version ``version`` (None: too few held-out turns)."""
        rows = list(self.rows)
        if len(rows) < self.cfg.gate_min_samples:
            return None
        assert self.baseline is not None
        cand = self.score(core, core.model, rows)
        live = self.score(core, self.baseline, rows)
        delta = cand["score"] - live["score"]
        ok = delta >= -self.cfg.gate_tolerance
        return {
            "status": "promoted" if ok else "rejected",
            "metrics": {
                "gate_score": cand["score"],
                "gate_live_score": live["score"],
                "gate_delta": delta,
                "gate_tolerance": self.cfg.gate_tolerance,
                "gate_live_version": self.baseline_version,
                "gate_samples": len(rows),
                "gate_tokens": int(cand["tokens"]),
                "gate_logp_pos": cand["logp_pos"],
                "gate_logp_neg": cand["logp_neg"],
                "gate_live_logp_pos": live["logp_pos"],
                "gate_live_logp_neg": live["logp_neg"],
                "gate_metric": "reward-weighted mean log-prob of held-out response tokens",
            },
        }
