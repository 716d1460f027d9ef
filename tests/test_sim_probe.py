"""The capability probe: answer checking by hand, repeatable sampling, left-padded batches,
fluency against a per-token loop written out here, and the endpoint variant with a fake."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.models.tiny import ensure_tiny_model
from pipeline.sim import (
    PROBE,
    QUESTIONS,
    ProbeItem,
    ProbeResult,
    chat_prompt_ids,
    fluency,
    generate,
    is_correct,
    probe_endpoint,
    probe_model,
)
from pipeline.sim.probe import _words


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_tiny_model(tmp_path_factory.mktemp("tiny"))
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def sharp(tiny: tuple[Any, Any]) -> Any:
    """The tiny model with large random weights: freshly initialised it answers every prompt
    greedily with the same whitespace token, which would hide a padding bug."""
    import copy

    model = copy.deepcopy(tiny[0])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def _item(question: str) -> ProbeItem:
    return next(it for it in PROBE if it.question == question)


def test_is_correct_by_hand() -> None:
    france = _item("What is the capital of France?")
    assert is_correct(france, "The capital of France is Paris.")
    assert is_correct(france, "PARIS!")
    assert is_correct(france, "paris, of course")
    assert not is_correct(france, "L'Étoile, la Marseillaise")
    assert not is_correct(france, "Parisian cafés are lovely.")  # whole words only
    assert not is_correct(france, "")
    week = _item("How many days are in a week?")
    assert is_correct(week, "7")
    assert is_correct(week, "A week has seven days.")
    assert not is_correct(week, "There are 17 days.")
    assert not is_correct(week, "seventy")
    gas = _item("What gas do plants absorb from the air?")
    assert is_correct(gas, "Plants absorb carbon   dioxide.")  # a phrase, any spacing
    assert is_correct(gas, "They take in CO₂ from the air.")  # subscript two -> "co2"
    assert not is_correct(gas, "carbon and oxygen")
    freezing = _item("What is the freezing point of water in Celsius?")
    assert is_correct(freezing, "Water freezes at 0°C.")
    assert not is_correct(freezing, "Water boils at 100°C.")
    assert not is_correct(freezing, "It freezes at 100.0 degrees.")  # not "100" and "0"
    assert not is_correct(freezing, "The freezing point is -18.")
    assert is_correct(freezing, "0.0 degrees Celsius")
    boiling = _item("What is the boiling point of water in Celsius?")
    assert is_correct(boiling, "100°C")
    assert is_correct(boiling, "approximately 100.0 degrees Celsius.")
    assert not is_correct(week, "About 7.5 days.")
    assert is_correct(week, "7.")
    assert is_correct(_item("What is the chemical symbol for gold?"), "Gold's symbol is Au.")
    assert not is_correct(_item("What is the chemical symbol for gold?"), "Gold is aurum.")
    # accents on the accepted side are dropped too
    assert is_correct(ProbeItem("Where?", ("Zürich",)), "It is in zurich.")


def test_probe_is_fixed_and_never_trained_on() -> None:
    assert len(PROBE) == 20
    assert len({it.question for it in PROBE}) == 20
    assert all(it.answers and all(_words(a) for a in it.answers) for it in PROBE)
    trained = {" ".join(_words(q.text)) for q in QUESTIONS}
    assert not [it.question for it in PROBE if " ".join(_words(it.question)) in trained]
    # the probe's questions carry their own answer nowhere in the question text
    assert not [it.question for it in PROBE if is_correct(it, it.question)]


def test_chat_prompt_ids_uses_the_template_or_falls_back(tiny: tuple[Any, Any]) -> None:
    import copy

    _, tok = tiny
    ids = chat_prompt_ids(tok, "What do bees make?")
    assert tok.decode(ids) == (
        "<|im_start|>user\nWhat do bees make?<|im_end|>\n<|im_start|>assistant\n"
    )
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    ids = chat_prompt_ids(bare, "What do bees make?")
    assert bare.decode(ids) == "What do bees make?\n"


def test_sampling_is_repeatable_and_leaves_the_model_and_rng_alone(
    tiny: tuple[Any, Any],
) -> None:
    model, tok = tiny
    questions = [PROBE[0].question, PROBE[5].question, "Hi"]
    model.train()
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = generate(model, tok, questions, max_new_tokens=12, temperature=0.9, seed=7)
    assert torch.equal(torch.rand(3), expected_next)  # the global RNG was not consumed
    assert model.training  # training mode restored
    b = generate(model, tok, questions, max_new_tokens=12, temperature=0.9, seed=7)
    c = generate(model, tok, questions, max_new_tokens=12, temperature=0.9, seed=8)
    assert a == b
    assert a != c
    assert len(a) == 3 and any(a)
    model.eval()


def test_greedy_batches_with_left_padding_like_one_at_a_time(
    sharp: Any,
    tiny: tuple[Any, Any],
) -> None:
    tok = tiny[1]
    questions = ["What is 2 + 2?", "What is the capital of France? Answer in detail please."]
    assert len(chat_prompt_ids(tok, questions[0])) != len(chat_prompt_ids(tok, questions[1]))
    batched = generate(sharp, tok, questions, max_new_tokens=8)
    alone = [generate(sharp, tok, [q], max_new_tokens=8)[0] for q in questions]
    assert batched == alone
    assert all(batched) and batched[0] != batched[1]
    assert generate(sharp, tok, []) == []


def _fluency_by_hand(model: Any, tok: Any, questions: list[str], answers: list[str]) -> float:
    """One forward pass per answer token, on the unpadded prefix."""
    total, count = 0.0, 0
    with torch.no_grad():
        for question, answer in zip(questions, answers, strict=True):
            prefix = list(chat_prompt_ids(tok, question))
            for token in tok(answer, add_special_tokens=False)["input_ids"]:
                logits = model(input_ids=torch.tensor([prefix])).logits[0, -1]
                total += float(torch.log_softmax(logits.float(), dim=-1)[token])
                count += 1
                prefix.append(token)
    return total / count


def test_fluency_matches_a_per_token_loop(sharp: Any, tiny: tuple[Any, Any]) -> None:
    tok = tiny[1]
    questions = ["What is the capital of France?", "Hi", "What do bees make?"]
    answers = ["The capital of France is Paris.", "", "Bees make honey, and wax too."]
    got = fluency(sharp, tok, questions, answers)
    want = _fluency_by_hand(sharp, tok, [questions[0], questions[2]], [answers[0], answers[2]])
    assert got == pytest.approx(want, abs=1e-4)
    assert got < 0
    # a different answer scores differently: the figure depends on what was written
    assert fluency(sharp, tok, questions[:1], ["zq xv ]]"]) != pytest.approx(got)
    with pytest.raises(ValueError):
        fluency(sharp, tok, ["Hi"], [""])
    with pytest.raises(ValueError):
        fluency(sharp, tok, ["Hi", "Hi"], ["a"])


def test_probe_model_counts_greedy_and_scores_samples(sharp: Any, tiny: tuple[Any, Any]) -> None:
    base, tok = tiny
    items = PROBE[:4]
    plain = probe_model(sharp, tok, items=items, max_new_tokens=6)
    assert plain.n == 4 and plain.fluency is None and plain.samples == []
    assert plain.answers == generate(sharp, tok, [it.question for it in items], max_new_tokens=6)
    assert plain.correct == sum(
        is_correct(it, a) for it, a in zip(items, plain.answers, strict=True)
    )
    scored = probe_model(
        sharp, tok, base_model=base, items=items, max_new_tokens=6, samples_per_item=2, seed=3
    )
    asked = [it.question for it in items for _ in range(2)]
    assert scored.samples == generate(sharp, tok, asked, max_new_tokens=6, temperature=0.7, seed=3)
    assert scored.fluency == pytest.approx(fluency(base, tok, asked, scored.samples))


def test_probe_endpoint_asks_greedy_then_sampled(tiny: tuple[Any, Any]) -> None:
    base, tok = tiny
    calls: list[tuple[str, float]] = []
    right = {it.question: f"It is {it.answers[-1]}." for it in PROBE}

    def ask(question: str, temperature: float) -> str:
        calls.append((question, temperature))
        if temperature > 0:
            return "The capital of France is Paris."
        return right[question] if len(calls) <= 15 else "I do not know."

    result = probe_endpoint(ask)  # no scorer: greedy only
    assert [t for _, t in calls] == [0.0] * 20
    assert [q for q, _ in calls] == [it.question for it in PROBE]
    assert (result.correct, result.n, result.fluency, result.samples) == (15, 20, None, [])
    assert result.to_dict() == {"correct": 15, "n": 20, "share": 0.75, "fluency": None}

    calls.clear()
    result = probe_endpoint(ask, base_model=base, tokenizer=tok, temperature=0.5)
    assert [t for _, t in calls] == [0.0] * 20 + [0.5] * 20
    assert result.correct == 15 and len(result.samples) == 20
    expected = fluency(base, tok, [it.question for it in PROBE], result.samples)
    assert result.fluency == pytest.approx(expected)
    assert result.to_dict()["fluency"] == result.fluency

    silent = probe_endpoint(lambda _q, _t: "", base_model=base, tokenizer=tok)
    assert (silent.correct, silent.fluency) == (0, None)  # nothing to score is not a score


def test_probe_result_share_of_an_empty_probe() -> None:
    assert ProbeResult(0, 0, None, []).to_dict()["share"] is None


def test_probe_package_does_not_load_torch_on_import(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = "import sys, pipeline.sim; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.stdout.strip() == "False"
