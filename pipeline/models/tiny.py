"""A tiny causal LM and byte-level BPE tokenizer built entirely in code.

No model hub is reachable on CI or a fresh laptop, so ``liverl serve``/``train`` default to
this model and tests build it locally. Byte-level BPE encodes any text and decodes exactly;
a ChatML template renders conversations (tools included) the same way everywhere.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: loading transformers takes seconds
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

TINY_ID = "liverl-tiny"
TINY_REVISION = "v1"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "\n<tool_call>{{ call['function']['name'] }} {{ call['function']['arguments'] }}</tool_call>"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "You are a helpful assistant. Answer briefly and precisely.",
    "The user asks a question; the assistant answers, calls tools, and reads their results.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "ls -la && cat README.md && pytest -q tests/ && git status",
    "Thanks, that works! No, that is wrong: the test still fails with exit code 1.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) [ ] { } < > : ; , .",
    "yes no ok error warning passed failed true false null none the a an is are was",
    "What is the capital of France? Paris. Count from one to five: one two three four five.",
]


def default_model_dir(cache_dir: Path | None = None) -> Path:
    root = cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "liverl"
    return Path(root) / "models" / f"{TINY_ID}-{TINY_REVISION}"


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on a fixed corpus; deterministic for a given vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    max_positions: int = 2048,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A Llama-architecture model small enough to train on a CPU in seconds."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def ensure_tiny_model(path: Path | None = None, **model_kwargs: int) -> Path:
    """Build the tiny model and tokenizer at ``path`` once (atomic rename); return the path."""
    target = Path(path) if path is not None else default_model_dir()
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        tokenizer = build_tokenizer()
        model = build_model(len(tokenizer), **model_kwargs)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
