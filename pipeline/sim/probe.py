"""A fixed capability probe: does training one user's preference break what others get?

Twenty factual questions with short checkable answers that SmolLM2-135M-Instruct mostly
knows, never used for training. Two figures, because one RL step once turned sampled
answers (temperature 0.7) into gibberish while greedy factual answers stayed right:

* ``correct``: greedy answers that contain an accepted answer (knowledge kept);
* ``fluency``: mean log-prob per token of *sampled* answers under the frozen base model
  (sampled text stays language). The scorer is always the base, so the figure is
  comparable across weight versions.

:func:`probe_model` runs a local Hugging Face model; :func:`probe_endpoint` runs any chat
endpoint through an ``ask(question, temperature)`` function (the demo asks the gateway with
``X-Liverl-Train: false``, so nothing is recorded or trained). Both run without gradients.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:  # imported where used: pipeline.sim stays light (no torch) for its users
    import torch


@dataclass(frozen=True)
class ProbeItem:
    question: str
    # Accepted answers: correct if any appears as whole word(s), case-insensitive, after
    # light normalisation (accents dropped, punctuation as spaces).
    answers: tuple[str, ...]
    # Or a regular expression the answer must match (case-insensitive): for checks that are
    # not a word, e.g. "any digit" in a probe of your own (load_probe).
    pattern: str | None = None


def _p(question: str, *answers: str) -> ProbeItem:
    return ProbeItem(question, answers)


# Questions the base model answers right come first: the promotion gate asks the first
# gate_probe_questions (8) of them, and a regression shows only where the live version was right.
PROBE: tuple[ProbeItem, ...] = (
    _p("What is the capital of France?", "Paris"),
    _p("What is the capital of Japan?", "Tokyo"),
    _p("What is the capital of Germany?", "Berlin"),
    _p("How many days are in a week?", "seven", "7"),
    _p("What color is the sky on a clear day?", "blue"),
    _p("What is 2 + 2?", "four", "4"),
    _p("Who wrote Romeo and Juliet?", "Shakespeare"),
    _p("What is the opposite of hot?", "cold"),
    _p("What gas do plants absorb from the air?", "carbon dioxide", "CO2"),
    _p("What is the boiling point of water in Celsius?", "100", "hundred"),
    _p("What is the chemical symbol for gold?", "Au"),
    _p("What is the capital of Italy?", "Rome"),
    _p("What is the capital of Spain?", "Madrid"),
    _p("What is the largest planet in our solar system?", "Jupiter"),
    _p("What do bees make?", "honey"),
    _p("How many legs does a spider have?", "eight", "8"),
    _p("What is frozen water called?", "ice"),
    _p("What is the freezing point of water in Celsius?", "0", "zero"),
    _p("Which animal is known as the king of the jungle?", "lion"),
    _p("How many continents are there?", "seven", "7"),
)

# A word: letters and digits; a number keeps its decimals ("7.5" is not "7").
_WORD = re.compile(r"[0-9a-z]+(?:[.,][0-9]+)*")
_ZERO_DECIMALS = re.compile(r"(?<=[0-9])\.0+$")


def _words(text: str) -> list[str]:
    """Lowercase ASCII words: accents dropped ("Étoile" -> "etoile"), anything else a
    separator ("CO₂" keeps its digit through NFKD: "co2"), zero decimals dropped ("100.0" ->
    "100", so a boiling point never reads as a freezing point of 0)."""
    decomposed = unicodedata.normalize("NFKD", text.lower())
    plain = "".join(c for c in decomposed if not unicodedata.combining(c))
    return [_ZERO_DECIMALS.sub("", w) for w in _WORD.findall(plain)]


def is_correct(item: ProbeItem, answer: str) -> bool:
    """Whether an accepted answer occurs in ``answer`` as whole word(s): "Paris." counts,
    "Parisian" does not (a prefix match would credit near-misses and gibberish)."""
    if item.pattern is not None and re.search(item.pattern, answer, re.IGNORECASE):
        return True
    words = _words(answer)
    for accepted in item.answers:
        want = _words(accepted)
        n = len(want)
        if n and any(words[i : i + n] == want for i in range(len(words) - n + 1)):
            return True
    return False


MAX_PROBE_ITEMS = 500
MAX_QUESTION_CHARS = 2_000


def load_probe(path: str | Path) -> tuple[ProbeItem, ...]:
    """A probe of your own: JSON lines ``{"question": ..., "answers": [...]}`` and/or
    ``"pattern"`` (a regex). Bounded (items, question length); a bad line names itself."""
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = orjson.loads(line)
            question, answers = doc["question"], tuple(doc.get("answers", ()))
            pattern = doc.get("pattern")
            if not isinstance(question, str) or not question or len(question) > MAX_QUESTION_CHARS:
                raise ValueError(f"question must be 1-{MAX_QUESTION_CHARS} characters")
            if not answers and pattern is None:
                raise ValueError("needs answers or a pattern")
            if pattern is not None:
                re.compile(pattern)
            items.append(ProbeItem(question, tuple(str(a) for a in answers), pattern))
        except (ValueError, KeyError, TypeError, re.error) as exc:
            raise ValueError(f"{path}:{n}: {exc}") from exc
        if len(items) > MAX_PROBE_ITEMS:
            raise ValueError(f"{path}: more than {MAX_PROBE_ITEMS} probe items")
    if not items:
        raise ValueError(f"{path}: no probe items")
    return tuple(items)


@dataclass
class ProbeResult:
    correct: int
    n: int
    fluency: float | None  # mean log-prob/token, sampled answers, base-scored; None: not measured
    answers: list[str]  # greedy answers, in PROBE order
    samples: list[str] = field(default_factory=list)  # sampled answers used for fluency

    def to_dict(self) -> dict[str, Any]:
        """The headline figures, JSON-ready (answers stay out: summaries carry them apart)."""
        return {
            "correct": self.correct,
            "n": self.n,
            "share": self.correct / self.n if self.n else None,
            "fluency": self.fluency,
        }


def chat_prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """The prompt the policy sees for ``question``: the chat template with the generation
    prompt, or the plain question and a newline for a tokenizer without a template."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(question + "\n", add_special_tokens=False)["input_ids"]]


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id)


def generate(
    model: Any,
    tokenizer: Any,
    questions: Sequence[str],
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[str]:
    """Answers of a local model: greedy at ``temperature == 0``, else plain temperature
    sampling (no top-k/top-p, like the gateway) seeded from ``seed``, so a probe is
    repeatable; the global RNG is left as it was."""
    import torch
    from transformers import GenerationConfig

    if not questions:
        return []
    device = _device(model)
    prompts = [chat_prompt_ids(tokenizer, q) for q in questions]
    width = max(len(p) for p in prompts)
    pad = _pad_id(tokenizer)
    # Left padding: every prompt ends where generation starts.
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    sample = temperature > 0
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=temperature if sample else None,
        top_k=0 if sample else None,
        top_p=1.0 if sample else None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
    )
    was_training = model.training
    model.eval()
    try:
        devices = [device] if device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    finally:
        model.train(was_training)
    return [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out]


def fluency(
    base_model: Any, tokenizer: Any, questions: Sequence[str], answers: Sequence[str]
) -> float:
    """Mean over all answer tokens of log p_base(token | chat prompt, earlier answer tokens).

    Gibberish scores far lower than language under the frozen base, whatever model wrote
    it. Raises ValueError when the answers hold no tokens (nothing to measure)."""
    import torch

    if len(questions) != len(answers):
        raise ValueError("one answer per question")
    device = _device(base_model)
    rows: list[tuple[list[int], int]] = []  # (prompt + answer ids, prompt length)
    for question, answer in zip(questions, answers, strict=True):
        prompt = chat_prompt_ids(tokenizer, question)
        body = [int(i) for i in tokenizer(answer, add_special_tokens=False)["input_ids"]]
        if body:
            rows.append((prompt + body, len(prompt)))
    if not rows:
        raise ValueError("no answer tokens to score")
    width = max(len(r) for r, _ in rows)
    pad = _pad_id(tokenizer)
    # Right padding: positions of real tokens are unaffected by what follows them.
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows], device=device)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows], device=device)
    was_training = base_model.training
    base_model.eval()
    try:
        with torch.no_grad():
            logits = base_model(input_ids=ids, attention_mask=mask).logits.float()
    finally:
        base_model.train(was_training)
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    total, count = 0.0, 0
    for b, (r, start) in enumerate(rows):
        # Token t is predicted at position t - 1.
        total += float(logp[b, start - 1 : len(r) - 1].sum())
        count += len(r) - start
    return total / count


def _fluency_or_none(
    base_model: Any, tokenizer: Any, questions: Sequence[str], answers: Sequence[str]
) -> float | None:
    try:
        return fluency(base_model, tokenizer, questions, answers)
    except ValueError:  # only empty answers: nothing to score
        return None


def probe_model(
    model: Any,
    tokenizer: Any,
    *,
    base_model: Any = None,
    items: Sequence[ProbeItem] = PROBE,
    max_new_tokens: int = 32,
    samples_per_item: int = 1,
    temperature: float = 0.7,
    seed: int = 0,
) -> ProbeResult:
    """Greedy answers -> ``correct``; with ``base_model``, sampled answers -> ``fluency``."""
    questions = [it.question for it in items]
    greedy = generate(model, tokenizer, questions, max_new_tokens=max_new_tokens)
    correct = sum(is_correct(it, a) for it, a in zip(items, greedy, strict=True))
    samples: list[str] = []
    score: float | None = None
    if base_model is not None:
        asked = [q for q in questions for _ in range(samples_per_item)]
        samples = generate(
            model,
            tokenizer,
            asked,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
        )
        score = _fluency_or_none(base_model, tokenizer, asked, samples)
    return ProbeResult(correct, len(items), score, greedy, samples)


def probe_endpoint(
    ask: Callable[[str, float], str],
    *,
    base_model: Any = None,
    tokenizer: Any = None,
    items: Sequence[ProbeItem] = PROBE,
    temperature: float = 0.7,
) -> ProbeResult:
    """The probe through any chat endpoint: ``ask(question, temperature)`` returns the
    answer text; greedy is temperature 0. Sampled answers are asked (and scored) only when
    ``base_model`` and ``tokenizer`` are given."""
    questions = [it.question for it in items]
    greedy = [ask(q, 0.0) for q in questions]
    correct = sum(is_correct(it, a) for it, a in zip(items, greedy, strict=True))
    samples: list[str] = []
    score: float | None = None
    if base_model is not None and tokenizer is not None:
        samples = [ask(q, temperature) for q in questions]
        score = _fluency_or_none(base_model, tokenizer, questions, samples)
    return ProbeResult(correct, len(items), score, greedy, samples)
