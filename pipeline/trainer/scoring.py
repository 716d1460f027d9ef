"""What the training step and the promotion gate share: the held-out split and the forward
pass that scores recorded responses. Both import it; neither imports the other."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from typing import Any

import torch

HELD_OUT = "held_out"  # trajectory status of samples kept out of training for the gate


def is_held_out(event_id: str, fraction: float) -> bool:
    """Deterministic split: the same sample is held out in every process and every replay."""
    if fraction <= 0.0:
        return False
    h = int.from_bytes(hashlib.sha256(b"liverl-holdout:" + event_id.encode()).digest()[:8], "big")
    return h < fraction * 2**64


def response_logits(
    model: Any,
    prompts: Sequence[list[int]],
    responses: Sequence[list[int]],
    *,
    pad_id: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Logits predicting each response token, ``[B, R_max, V]`` (right-padded), from one
    padded forward pass over prompt + response."""
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    length = max(len(s) for s in seqs)
    rmax = max(len(r) for r in responses)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), length), dtype=torch.long)
    pos = torch.zeros((len(seqs), rmax), dtype=torch.long)
    for b, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
        ids[b, : len(s)] = torch.tensor(s)
        attn[b, : len(s)] = 1
        r = len(s) - len(p)
        pos[b, :r] = torch.arange(len(p) - 1, len(p) - 1 + r)
    ids, attn, pos = ids.to(device), attn.to(device), pos.to(device)
    ctx = (contextlib.nullcontext() if autocast_dtype is None
           else torch.autocast(device.type, dtype=autocast_dtype))
    with ctx:
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    return logits.gather(1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()
