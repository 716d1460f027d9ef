"""The gateway's detokenizer gives exactly transformers' decode, or falls back to it."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from pipeline.models.tiny import build_tokenizer
from pipeline.serving.detokenizer import VERIFY_DECODES, Detokenizer

from .test_serving_prompt_cache import metaspace_tokenizer


@pytest.mark.parametrize("make", [build_tokenizer, metaspace_tokenizer])
def test_decodes_equal_transformers_prefix_by_prefix(make: Any) -> None:
    """Every prefix of an answer, as a stream decodes it, special tokens dropped."""
    tok = make()
    text = "the quick brown fox, how are you?  hello  world"
    ids = [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    detok = Detokenizer(tok)
    assert detok.fast
    for k in range(len(ids) + 1):
        assert detok.decode(ids[:k]) == tok.decode(ids[:k], skip_special_tokens=True)
    assert detok.decode(ids) == tok.decode(ids[:-1])  # the eos id adds no text


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_by_transformers() -> None:
    tok = build_tokenizer()
    tok.clean_up_tokenization_spaces = True
    assert not Detokenizer(tok).fast


class Differs:
    """A tokenizer whose transformers decode adds something the fast one does not."""

    def __init__(self, after: int) -> None:
        self.inner = build_tokenizer()
        self.backend_tokenizer = self.inner.backend_tokenizer
        self.clean_up_tokenization_spaces = False
        self.calls, self.after = 0, after

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.calls += 1
        text = self.inner.decode(ids, skip_special_tokens=skip_special_tokens)
        return text + "!" if self.calls > self.after else text


def test_a_mismatch_while_checking_turns_the_shortcut_off_for_good(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tok = Differs(after=3)
    ids = tok.inner("hello world", add_special_tokens=False)["input_ids"]
    detok = Detokenizer(tok)
    with caplog.at_level(logging.WARNING):
        assert [detok.decode(ids) for _ in range(3)] == ["hello world"] * 3
        assert detok.decode(ids) == "hello world!"  # transformers' text, not the fast one
    assert not detok.fast and "differs" in caplog.text
    assert detok.decode(ids) == "hello world!"


def test_after_the_checks_transformers_is_no_longer_called() -> None:
    tok = Differs(after=10**9)
    ids = tok.inner("hello world", add_special_tokens=False)["input_ids"]
    detok = Detokenizer(tok)
    for _ in range(VERIFY_DECODES + 10):
        assert detok.decode(ids) == "hello world"
    assert tok.calls == VERIFY_DECODES and detok.fast
