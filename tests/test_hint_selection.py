"""Hand-made examples for pipeline.trainer.hint_selection (CPU, tiny tensors)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.trainer.hint_selection import (
    gather_hint,
    overlap_counts,
    select_hint,
    topk_ids,
    vocab_subset,
)
from pipeline.trainer.losses import topk_opd_loss

V = 8


def scores(*rankings: list[int]) -> torch.Tensor:
    """[T, V] scores whose top entries per token are, in order, the given ids."""
    out = torch.full((len(rankings), V), -10.0)
    for i, ids in enumerate(rankings):
        for rank, v in enumerate(ids):
            out[i, v] = 5.0 - rank
    return out


# Student top-4 per token: token0 {0,1,2,3}, token1 {4,5,6,7}
STUDENT = scores([0, 1, 2, 3], [4, 5, 6, 7])
# Hint 0: token0 {2,3,4,5} ∩ {0,1,2,3} = {2,3} → 2;  token1 {4,5,6,0} ∩ {4,5,6,7} = {4,5,6} → 3
# Hint 1: token0 {0,1,2,7} ∩ {0,1,2,3} = {0,1,2} → 3; token1 {0,1,2,3} ∩ {4,5,6,7} = {} → 0
TEACHER = torch.stack(
    [
        scores([2, 3, 4, 5], [4, 5, 6, 0]),
        scores([0, 1, 2, 7], [0, 1, 2, 3]),
    ]
)


def test_topk_ids() -> None:
    assert set(topk_ids(STUDENT)[0].tolist()) == {0, 1, 2, 3}
    assert topk_ids(STUDENT, k=2).tolist() == [[0, 1], [4, 5]]


def test_overlap_counts_hand_example() -> None:
    o = overlap_counts(STUDENT, TEACHER)
    assert o.tolist() == [[2, 3], [3, 0]]
    # logits or log-probs give the same top-k
    logprob_o = overlap_counts(torch.log_softmax(STUDENT, -1), torch.log_softmax(TEACHER, -1))
    assert logprob_o.tolist() == [[2, 3], [3, 0]]
    # k = 2: student {0,1},{4,5}; hint0 {2,3},{4,5} → [0, 2]; hint1 {0,1},{0,1} → [2, 0]
    assert overlap_counts(STUDENT, TEACHER, k=2).tolist() == [[0, 2], [2, 0]]
    # leading batch dimension
    batched = overlap_counts(
        torch.stack([STUDENT, STUDENT]), torch.stack([TEACHER, TEACHER.flip(0)])
    )
    assert batched.tolist() == [[[2, 3], [3, 0]], [[3, 0], [2, 3]]]


def test_select_sequence_mode() -> None:
    o = torch.tensor([[2, 3], [3, 0]])
    # Σ_i: hint0 = 5, hint1 = 3 → hint 0 for every token
    assert select_hint(o, "sequence").tolist() == [0, 0]
    # mask out token1: hint0 = 2, hint1 = 3 → hint 1
    assert select_hint(o, "sequence", token_mask=torch.tensor([1, 0])).tolist() == [1, 1]


def test_select_sequence_mode_tie() -> None:
    o = torch.tensor([[2, 1], [1, 2], [0, 0]])  # sums 3, 3, 0
    assert select_hint(o, "sequence").tolist() == [0, 0]  # no lengths: lower index
    assert select_hint(o, "sequence", hint_lengths=[10, 5, 1]).tolist() == [1, 1]  # shorter wins
    assert select_hint(o, "sequence", hint_lengths=[5, 5, 1]).tolist() == [0, 0]  # equal → lower


def test_select_token_mode_with_tie() -> None:
    o = torch.tensor([[2, 3, 1], [3, 0, 1], [1, 1, 0]])
    # token0: max 3 at hint1; token1: max 3 at hint0; token2: tie hint0/hint1 (1, 1)
    assert select_hint(o, "token").tolist() == [1, 0, 0]
    assert select_hint(o, "token", hint_lengths=[9, 4, 1]).tolist() == [1, 0, 1]


def test_select_shortest_mode() -> None:
    o = torch.tensor([[4, 4], [0, 0], [0, 0]])  # overlap is ignored
    # lengths 3 and 3 tie → lower index
    assert select_hint(o, "shortest", hint_lengths=[7, 3, 3]).tolist() == [1, 1]
    assert select_hint(o, "shortest", hint_lengths=[2, 3, 3]).tolist() == [0, 0]
    assert select_hint(o, "shortest").tolist() == [0, 0]


def test_select_errors() -> None:
    o = torch.tensor([[1, 2]])
    with pytest.raises(ValueError):
        select_hint(o, "best")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        select_hint(o, "sequence", hint_lengths=[1, 2])


def test_gather_hint() -> None:
    teacher = torch.tensor([[10.0, 11.0, 12.0], [20.0, 21.0, 22.0]])  # [H=2, T=3]
    assert gather_hint(teacher, torch.tensor([1, 0, 1])).tolist() == [20.0, 11.0, 22.0]
    per_vocab = TEACHER  # [H, T, V]
    got = gather_hint(per_vocab, torch.tensor([1, 0]))
    assert torch.equal(got[0], TEACHER[1, 0]) and torch.equal(got[1], TEACHER[0, 1])


def test_vocab_subset_student_and_teacher() -> None:
    teacher = TEACHER[0]
    idx, mask = vocab_subset(STUDENT, teacher, "student")
    assert [set(r) for r in idx.tolist()] == [{0, 1, 2, 3}, {4, 5, 6, 7}]
    assert mask.all()
    idx, mask = vocab_subset(STUDENT, teacher, "teacher")
    assert [set(r) for r in idx.tolist()] == [{2, 3, 4, 5}, {4, 5, 6, 0}]
    assert mask.all()
    with pytest.raises(ValueError):
        vocab_subset(STUDENT, teacher, "union")  # type: ignore[arg-type]


def test_vocab_subset_overlap_with_empty_fallback() -> None:
    # hint 1: token0 intersection {0,1,2}; token1 intersection empty → student top-4
    idx, mask = vocab_subset(STUDENT, TEACHER[1], "overlap")
    s0 = {v for v, keep in zip(idx[0].tolist(), mask[0].tolist(), strict=True) if keep}
    s1 = {v for v, keep in zip(idx[1].tolist(), mask[1].tolist(), strict=True) if keep}
    assert s0 == {0, 1, 2}
    assert s1 == {4, 5, 6, 7}  # fallback
    # hint 0: {2,3} and {4,5,6}
    idx, mask = vocab_subset(STUDENT, TEACHER[0], "overlap")
    rows = zip(idx.tolist(), mask.tolist(), strict=True)
    chosen = [{v for v, keep in zip(i, m, strict=True) if keep} for i, m in rows]
    assert chosen == [{2, 3}, {4, 5, 6}]


def test_selection_feeds_topk_loss() -> None:
    # student and teacher (hint chosen per sequence) log-probs, one sample
    student = torch.log_softmax(STUDENT.double(), -1)
    teacher_all = torch.log_softmax(TEACHER.double(), -1)
    choice = select_hint(overlap_counts(student, teacher_all), "sequence")
    assert choice.tolist() == [0, 0]
    teacher = gather_hint(teacher_all, choice)
    idx, mask = vocab_subset(student, teacher, "overlap")
    out = topk_opd_loss(
        student[None],
        student[None],
        teacher[None],
        torch.ones(1, 2),
        indices=idx[None],
        subset_mask=mask[None],
    )
    # ρ = 1 → per-token loss = −Σ_{v∈S} clip(ℓ_T − ℓ_old, ±1)·softmax_S(ℓ_old)
    expected = 0.0
    for i, s in enumerate([[2, 3], [4, 5, 6]]):
        z = sum(math.exp(student[i, v].item()) for v in s)
        expected += -sum(
            max(-1.0, min(1.0, teacher[i, v].item() - student[i, v].item()))
            * math.exp(student[i, v].item())
            / z
            for v in s
        )
    assert out.loss.item() == pytest.approx(expected / 2)
