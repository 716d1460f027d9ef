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
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    pad_id: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Logits predicting each response token, ``[B, R_max, V]`` (right-padded), from one
    padded forward pass over prompt + response."""
    pairs = list(zip(prompts, responses, strict=True))
    length = max(len(p) + len(r) for p, r in pairs)
    rmax = max(len(r) for r in responses)
    ids = torch.full((len(pairs), length), pad_id, dtype=torch.long)
    attn = torch.zeros((len(pairs), length), dtype=torch.long)
    pos = torch.zeros((len(pairs), rmax), dtype=torch.long)
    for b, (p, r) in enumerate(pairs):
        n, m = len(p), len(r)  # lists or packed arrays: filled in place, never concatenated
        ids[b, :n] = torch.tensor(p)
        ids[b, n : n + m] = torch.tensor(r)
        attn[b, : n + m] = 1
        pos[b, :m] = torch.arange(n - 1, n - 1 + m)
    ids, attn, pos = ids.to(device), attn.to(device), pos.to(device)
    ctx = (
        contextlib.nullcontext()
        if autocast_dtype is None
        else torch.autocast(device.type, dtype=autocast_dtype)
    )
    with ctx:
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    return logits.gather(1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()
