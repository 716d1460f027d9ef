"""Overlap-guided hint selection and vocabulary subsets for top-k OPD.

See docs/architecture.md#hint-selection-and-top-k-opd.

For one response of T tokens scored by the student and, for each of up to 3
candidate hints h, by the teacher (the same response under the prompt with
hint h appended)::

    O[h, i] = |topk(student_i) ∩ topk(teacher_{h,i})|,  k = 4

Selection modes (:func:`select_hint`):

* ``sequence``: one hint for the whole response, ``argmax_h Σ_i O[h, i]``;
* ``token``: per token, ``argmax_h O[h, i]``;
* ``shortest``: the shortest hint, ignoring the overlap.

Ties (in every mode) go to the shorter hint, then to the lower index.

Vocabulary subsets S for :func:`pipeline.trainer.losses.topk_opd_loss`
(:func:`vocab_subset`): ``student`` (student top-k, default), ``teacher``
(teacher top-k) or ``overlap`` (their intersection; where it is empty the
token falls back to the student top-k).

Shapes: student log-probs ``[..., T, V]``, teacher log-probs
``[..., H, T, V]`` (logits work too: top-k is invariant under log-softmax).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

SelectionMode = Literal["sequence", "token", "shortest"]
SubsetMode = Literal["student", "teacher", "overlap"]

TOP_K: int = 4


def topk_ids(logprobs: torch.Tensor, k: int = TOP_K) -> torch.Tensor:
    """Indices of the k largest entries along the vocabulary axis, ``[..., V] → [..., k]``."""
    return logprobs.topk(k, dim=-1).indices


def overlap_counts(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, k: int = TOP_K
) -> torch.Tensor:
    """``O[..., h, i] = |topk(student_i) ∩ topk(teacher_{h,i})|`` as a long tensor ``[..., H, T]``.

    ``student_logprobs`` ``[..., T, V]``, ``teacher_logprobs`` ``[..., H, T, V]``.
    Entries lie in ``0..k``.
    """
    s = topk_ids(student_logprobs, k).unsqueeze(-3)  # [..., 1, T, k]
    t = topk_ids(teacher_logprobs, k)  # [..., H, T, k]
    # top-k ids are distinct within a row, so counting equal pairs counts the intersection
    return (s.unsqueeze(-1) == t.unsqueeze(-2)).sum(dim=(-1, -2))


def _tie_order(num_hints: int, hint_lengths: Sequence[int] | None) -> list[int]:
    """Hint indices ordered by preference on ties: shorter first, then lower index."""
    if hint_lengths is None:
        return list(range(num_hints))
    if len(hint_lengths) != num_hints:
        raise ValueError(f"{len(hint_lengths)} hint lengths for {num_hints} hints")
    return sorted(range(num_hints), key=lambda h: (hint_lengths[h], h))


def select_hint(
    overlap: torch.Tensor,
    mode: SelectionMode = "sequence",
    *,
    hint_lengths: Sequence[int] | None = None,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chosen hint index per token, long ``[T]``, from overlaps ``O`` ``[H, T]``.

    * ``sequence``: ``h* = argmax_h Σ_{i: m_i=1} O[h, i]``, same for every token;
    * ``token``: ``h*_i = argmax_h O[h, i]``;
    * ``shortest``: ``h* = argmin_h len(h)``.

    Ties go to the shorter hint (``hint_lengths``, any unit; omitted → all equal),
    then to the lower index. ``token_mask`` ``[T]`` restricts the sequence sum
    to response tokens (default: all). Use :func:`gather_hint` to pick the
    teacher log-probs of the chosen hint(s).
    """
    num_hints, num_tokens = overlap.shape
    if num_hints == 0:
        raise ValueError("no candidate hints")
    order = _tie_order(num_hints, hint_lengths)
    order_t = torch.tensor(order, dtype=torch.long, device=overlap.device)
    ranked = overlap[order_t].long()  # row j is hint order[j]; argmax takes the first max
    if mode == "shortest":
        choice = order_t[0].expand(num_tokens)
    elif mode == "sequence":
        if token_mask is not None:
            ranked = ranked * token_mask.to(ranked.device).long().unsqueeze(0)
        choice = order_t[ranked.sum(dim=-1).argmax()].expand(num_tokens)
    elif mode == "token":
        choice = order_t[ranked.argmax(dim=0)]
    else:
        raise ValueError(f"unknown mode {mode!r}; expected 'sequence', 'token' or 'shortest'")
    return choice.clone()


def gather_hint(teacher: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """Per token, the chosen hint's row: ``out[i] = teacher[choice[i], i]``.

    ``teacher`` ``[H, T, ...]``, ``choice`` ``[T]`` → ``[T, ...]``.
    """
    positions = torch.arange(teacher.shape[1], device=teacher.device)
    return teacher[choice.to(teacher.device).long(), positions]


def vocab_subset(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mode: SubsetMode = "student",
    k: int = TOP_K,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vocabulary subset S per token as ``(indices [..., T, k], subset_mask [..., T, k])``.

    ``student_logprobs`` and ``teacher_logprobs`` (the chosen hint's) are
    ``[..., T, V]``.

    * ``student``: S = topk(student), mask all true;
    * ``teacher``: S = topk(teacher), mask all true;
    * ``overlap``: S = topk(student) ∩ topk(teacher), returned as the student
      top-k indices with the mask marking those also in the teacher top-k;
      a token whose intersection is empty falls back to the full student
      top-k (mask all true), so S is never empty.

    Feed both to :func:`pipeline.trainer.losses.topk_opd_loss` (``indices=``,
    ``subset_mask=``).
    """
    s_ids = topk_ids(student_logprobs, k)
    if mode == "student":
        return s_ids, torch.ones_like(s_ids, dtype=torch.bool)
    t_ids = topk_ids(teacher_logprobs, k)
    if mode == "teacher":
        return t_ids, torch.ones_like(t_ids, dtype=torch.bool)
    if mode == "overlap":
        in_teacher = (s_ids.unsqueeze(-1) == t_ids.unsqueeze(-2)).any(dim=-1)
        empty = ~in_teacher.any(dim=-1, keepdim=True)
        return s_ids, in_teacher | empty
    raise ValueError(f"unknown subset {mode!r}; expected 'student', 'teacher' or 'overlap'")
