"""The session prompt cache gives exactly the ids of a full encode, turn after turn."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pipeline.models.tiny import SPECIAL_TOKENS, build_tokenizer
from pipeline.serving.app import Gateway, create_app
from pipeline.serving.backends.hf import HFBackend
from pipeline.serving.chat import render_prompt
from pipeline.serving.prompt_cache import PromptCache
from pipeline.serving.settings import ServeSettings


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module")
def tiny_backend() -> HFBackend:
    from pipeline.models.tiny import ensure_tiny_model

    return HFBackend(ensure_tiny_model(), workers=1)


def metaspace_tokenizer() -> Any:
    """A SentencePiece-style tokenizer (Metaspace, a leading '▁' on the first piece only), the
    other common family besides byte-level BPE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    t.decoder = decoders.Metaspace(prepend_scheme="first")
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, how are you?"] * 20
    t.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=200, special_tokens=["<unk>", *SPECIAL_TOKENS], show_progress=False
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>")
    fast.chat_template = build_tokenizer().chat_template
    return fast


def full(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def conversation(turns: int) -> list[list[dict[str, str]]]:
    """The message lists a client sends for each turn of one session."""
    msgs = [{"role": "system", "content": "You are a  helpful assistant."}]
    out = []
    for i in range(turns):
        msgs = [*msgs, {"role": "user", "content": f"Question {i}:  how are you? \n"}]
        out.append(msgs)
        msgs = [*msgs, {"role": "assistant", "content": f" fine, thanks {i}!"}]
    return out


@pytest.mark.parametrize("make", [build_tokenizer, metaspace_tokenizer], ids=["bpe", "metaspace"])
def test_each_turn_equals_a_full_encode_and_reuses_the_last(make: Any) -> None:
    tokenizer = make()
    cache = PromptCache(tokenizer)
    assert cache.enabled
    for msgs in conversation(6):
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert cache.encode("s1", text) == full(tokenizer, text)
    assert cache.hits == 5  # every turn after the first
    # Turn k's prompt repeats all of turn k-1's but its generation prompt.
    assert cache.saved_chars > 0
    assert cache._verified == 5  # all hits so far were checked against a full encode


def test_edits_divergence_and_a_missing_added_token_fall_back_exactly(tok: Any) -> None:
    cache = PromptCache(tok)
    turns = conversation(3)
    texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in turns]
    for text in texts:
        cache.encode("s", text)
    hits = cache.hits
    # An earlier message edited: only the part before the edit can be reused.
    edited = texts[-1].replace("Question 0", "Question X")
    assert cache.encode("s", edited) == full(tok, edited)
    assert cache.hits == hits + 1
    # The same prefix followed by plain text where the old prompt had an added token: the
    # cut before that one is used.
    cut = edited.rindex("<|im_start|>")
    odd = edited[:cut] + "plain text, no marker"
    assert cache.encode("s", odd) == full(tok, odd)
    assert cache.hits == hits + 2
    # A different session and no session share nothing.
    assert cache.encode("other", texts[-1]) == full(tok, texts[-1])
    assert cache.encode(None, texts[-1]) == full(tok, texts[-1])
    assert cache.hits == hits + 2


def test_memory_bound_drops_least_recent_sessions(tok: Any) -> None:
    text = tok.apply_chat_template(conversation(1)[0], add_generation_prompt=True, tokenize=False)
    one = PromptCache(tok)
    one.encode("a", text)
    size = one._bytes
    cache = PromptCache(tok, max_bytes=3 * size)
    for sid in "abcde":
        cache.encode(sid, text)
    assert len(cache) == 3 and list(cache._entries) == ["c", "d", "e"]
    assert cache._bytes <= 3 * size
    cache.forget("d")
    assert list(cache._entries) == ["c", "e"]
    assert PromptCache(tok, max_bytes=0).enabled is False


class _Encoding:
    def __init__(self, text: str) -> None:
        # ids after the first depend on the text's length: pieces that are not independent
        self.ids = [ord(c) + (len(text) % 2 if i and c != "<" else 0) for i, c in enumerate(text)]
        self.offsets = [(i, i + 1) for i in range(len(text))]


class _SkewedBackend:
    truncation = None
    padding = None

    def get_added_tokens_decoder(self) -> dict[int, Any]:
        return {ord("<"): SimpleNamespace(lstrip=False, content="<")}

    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        return _Encoding(text)


class _SkewedTokenizer:
    backend_tokenizer = _SkewedBackend()

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self.backend_tokenizer.encode(text).ids}


def test_a_tokenizer_that_does_not_split_exactly_turns_the_cache_off() -> None:
    tokenizer = _SkewedTokenizer()
    backend = tokenizer.backend_tokenizer
    cache = PromptCache(tokenizer)
    cache.encode("s", "ab<cd")
    second = "ab<cd<ef"  # shares "ab" then '<': a hit whose ids differ from a full encode
    assert cache.encode("s", second) == backend.encode(second).ids
    assert cache.enabled is False and len(cache) == 0
    assert cache.encode("s", second) == backend.encode(second).ids


def test_gateway_sessions_use_the_cache(tok: Any, tiny_backend: Any) -> None:
    gw = Gateway(ServeSettings(record=False), tiny_backend)
    with TestClient(create_app(gw)) as client:
        for msgs in conversation(3):
            r = client.post(
                "/v1/chat/completions",
                json={"model": gw.model_name, "messages": msgs, "max_tokens": 2},
                headers={"X-Session-Id": "cached", "X-Liverl-Train": "false"},
            )
            assert r.status_code == 200, r.text
        assert gw.prompts.hits == 2
        expected = render_prompt(tiny_backend.tokenizer, conversation(3)[-1], None)
        assert gw.prompts._entries["cached"].ids.tolist() == expected
        r = client.post(
            "/v1/chat/completions",
            json={"model": gw.model_name, "messages": conversation(4)[-1], "max_tokens": 2},
            headers={"X-Session-Id": "cached", "X-Session-Done": "true", "X-Liverl-Train": "false"},
        )
        assert r.status_code == 200, r.text
    assert "cached" not in gw.prompts._entries  # a closed session's prompt is dropped


def test_no_cache_when_special_tokens_are_split_as_text(tok: Any) -> None:
    import copy

    split = copy.deepcopy(tok)
    split.split_special_tokens = True
    assert not PromptCache(split).enabled
    assert PromptCache(tok).enabled
