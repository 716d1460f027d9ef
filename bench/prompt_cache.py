"""The gateway's per-session prompt cache: tokenizing a growing conversation in full on every
turn vs from the last shared cut (``pipeline/serving/prompt_cache.py``).

One session of ``--turns`` turns (each adds a user message and an answer of a few hundred
characters), rendered by the model's chat template; for each turn, the CPU time of a full
encode and of the cached encode (the ids are asserted equal, as the gateway would serve
them). Uses the tiny model's tokenizer, and SmolLM2's when its converted copy is in the
model store. Prints figures; asserts nothing about speed.

    .venv/bin/python bench/prompt_cache.py [--turns 24] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from pipeline.serving.prompt_cache import PromptCache


def conversation(turns: int) -> list[list[dict[str, str]]]:
    msgs = [{"role": "system", "content": "You are a careful coding assistant. " * 8}]
    out = []
    for i in range(turns):
        msgs = [
            *msgs,
            {
                "role": "user",
                "content": f"Step {i}: the test still fails with "
                f"ImportError in module_{i}.py; what should I try next? " * 3,
            },
        ]
        out.append(msgs)
        msgs = [
            *msgs,
            {
                "role": "assistant",
                "content": f"Open module_{i}.py, check the "
                "import of settings, then run pytest -x on that file only. " * 4,
            },
        ]
    return out


def measure(tokenizer: Any, turns: int, repeats: int) -> tuple[list[float], list[float], int]:
    texts = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
        for m in conversation(turns)
    ]
    full_ms: list[list[float]] = [[] for _ in texts]
    cached_ms: list[list[float]] = [[] for _ in texts]
    n_ids = 0
    for r in range(repeats):
        cache = PromptCache(tokenizer)
        for i, text in enumerate(texts):
            t0 = time.perf_counter()
            want = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            full_ms[i].append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            got = cache.encode(f"s{r}", text)
            cached_ms[i].append((time.perf_counter() - t0) * 1e3)
            assert got == want, f"turn {i}: cached ids differ"
            n_ids = len(want)
    return (
        [statistics.median(x) for x in full_ms],
        [statistics.median(x) for x in cached_ms],
        n_ids,
    )


def tokenizers() -> list[tuple[str, Any]]:
    from transformers import AutoTokenizer

    from pipeline.models.tiny import ensure_tiny_model

    out = [("tiny (byte-level BPE, 512 ids)", AutoTokenizer.from_pretrained(ensure_tiny_model()))]
    from pipeline.models import store

    path = store.model_dir(store.DEFAULT_MODEL)
    if store.verify(path) is None:
        out.append((f"{store.DEFAULT_MODEL} (byte-level BPE)", AutoTokenizer.from_pretrained(path)))
    else:
        print(f"({store.DEFAULT_MODEL} is not converted here: `liverl models pull` adds it)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    for name, tok in tokenizers():
        full, cached, n = measure(tok, args.turns, args.repeats)
        print(f"{name}: {args.turns} turns, last prompt {n} tokens; median of {args.repeats}")
        print(f"{'turn':>6}{'full ms':>10}{'cached ms':>11}{'ratio':>8}")
        for i in sorted({0, 1, args.turns // 4, args.turns // 2, args.turns - 1}):
            print(f"{i:>6}{full[i]:>10.3f}{cached[i]:>11.3f}{full[i] / cached[i]:>8.1f}")
        print(
            f"{'all':>6}{sum(full):>10.2f}{sum(cached):>11.2f}{sum(full) / sum(cached):>8.1f}"
            "  (total over the session)"
        )


if __name__ == "__main__":
    main()
