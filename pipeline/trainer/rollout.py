"""Fresh answers from a local model, and their log-probabilities: what the promotion gate runs
on a candidate and on the live version (:mod:`pipeline.trainer.gate`).

Prompts are token ids (a recorded prompt is already chat-formatted and ends with the
generation prompt), so a held-out turn is answered exactly as the gateway would have asked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from pipeline.trainer import losses as L
from pipeline.trainer.scoring import response_logits


@contextlib.contextmanager
def evaluating(model: Any) -> Iterator[Any]:
    """``model`` in eval mode (dropout off) for the block, its training mode restored after."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


@torch.no_grad()
def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    pad_id: int,
    eos_ids: Sequence[int],
    device: torch.device,
    max_new_tokens: int = 32,
    temperature: float | Sequence[float] = 0.0,
    seed: int = 0,
    seeds: Sequence[int] | None = None,
    batch: int = 64,
    on_finished: Callable[[list[int]], None] | None = None,
) -> list[list[int]]:
    """Answer token ids per prompt (EOS excluded): greedy at ``temperature`` 0, else sampled
    with a generator seeded from ``seed`` and the prompt's index, so the same call gives the
    same answers whatever else ran in the process (``seeds``: one per prompt instead, so a
    prompt's answer does not depend on its place in the batch). ``temperature`` may be one per
    prompt, so
    greedy and sampled answers share one pass: decoding on a CPU is bound by reading the
    weights once per step, so one batch of 2n rows costs far less than two of n. Left-padded
    batches of ``batch``. ``on_finished`` is told the indices of the prompts whose answers
    ended at each decoding step (the gate's progress), cheaply: one call per step."""
    temps = (
        [float(temperature)] * len(prompts)
        if isinstance(temperature, (int, float))
        else [float(t) for t in temperature]
    )
    out: list[list[int]] = []
    stop = set(int(e) for e in eos_ids)
    with evaluating(model):
        for start in range(0, len(prompts), batch):
            chunk = prompts[start : start + batch]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            attn = torch.zeros((len(chunk), width), dtype=torch.long)
            for b, p in enumerate(chunk):
                ids[b, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
                attn[b, width - len(p) :] = 1
            ids, attn = ids.to(device), attn.to(device)
            past = None
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            answers: list[list[int]] = [[] for _ in chunk]
            done = [False] * len(chunk)
            gens = [
                _generator(seed, start + b) if seeds is None else _generator(seeds[start + b], 0)
                for b in range(len(chunk))
            ]
            step_ids, step_pos, mask = ids, pos, attn
            told = [False] * len(chunk)

            def tell(
                told: list[bool] = told,
                done: list[bool] = done,
                start: int = start,
                everything: bool = False,
            ) -> None:
                ended = [b for b in range(len(told)) if not told[b] and (everything or done[b])]
                for b in ended:
                    told[b] = True
                if ended and on_finished is not None:
                    on_finished([start + b for b in ended])

            for _ in range(max_new_tokens):
                res = model(
                    input_ids=step_ids,
                    attention_mask=mask,
                    position_ids=step_pos,
                    past_key_values=past,
                    use_cache=True,
                )
                past = res.past_key_values
                logits = res.logits[:, -1, :].float()
                nxt = []
                for b in range(len(chunk)):
                    t = temps[start + b]
                    if t <= 0.0:
                        tok = int(logits[b].argmax())
                    else:
                        probs = torch.softmax(logits[b] / t, dim=-1).cpu()
                        tok = int(torch.multinomial(probs, 1, generator=gens[b]))
                    if not done[b]:
                        if tok in stop:
                            done[b] = True
                        else:
                            answers[b].append(tok)
                    nxt.append(tok if not done[b] else pad_id)
                tell()
                if all(done):
                    break
                step_ids = torch.tensor(nxt, dtype=torch.long, device=device)[:, None]
                step_pos = step_pos[:, -1:] + 1
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            tell(everything=True)  # the answers cut at max_new_tokens end here
            out.extend(answers)
    return out


def _generator(seed: int, index: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + index) % (2**63))
    return g


@torch.no_grad()
def mean_logprobs(
    model: Any,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    pad_id: int,
    device: torch.device,
    batch: int = 16,
) -> list[float | None]:
    """Per pair, the mean log-probability per token of ``response`` after ``prompt`` under
    ``model`` (None for an empty response: nothing to score)."""
    out: list[float | None] = [None] * len(prompts)
    todo = [i for i, r in enumerate(responses) if len(r) > 0]
    with evaluating(model):
        for start in range(0, len(todo), batch):
            idx = todo[start : start + batch]
            logits = response_logits(
                model,
                [prompts[i] for i in idx],
                [responses[i] for i in idx],
                pad_id=pad_id,
                device=device,
            )
            rmax = logits.shape[1]
            tok = torch.zeros((len(idx), rmax), dtype=torch.long)
            mask = torch.zeros((len(idx), rmax))
            for b, i in enumerate(idx):
                n = len(responses[i])
                tok[b, :n] = torch.tensor(list(responses[i]), dtype=torch.long)
                mask[b, :n] = 1.0
            logp = L.token_logprobs(logits, tok.to(logits.device)).cpu() * mask
            for b, i in enumerate(idx):
                out[i] = float(logp[b].sum() / mask[b].sum())
    return out
