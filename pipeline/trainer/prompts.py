"""Teacher prompts for OPD: the student's prompt with a hint appended to the last user message.

Samples carry token ids, not messages, so the hint is spliced in at token level: the tokens
of ``"\\n\\n[user's hint / instruction]\\n{hint}"`` go right before the end-of-turn token that
closes the last user message. Every other prompt token stays exactly as the engine saw it
(no re-tokenization drift). This needs a ChatML-style template (``<|im_start|>user`` ...
``<|im_end|>``), which the tiny model and Qwen use; when the structure is not found, the hint
goes before the final assistant header, or at the end of the prompt as a last resort.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

HINT_TEMPLATE = "\n\n[user's hint / instruction]\n{hint}"


@dataclass(frozen=True)
class ChatMarkers:
    """Token ids of the chat template's structure, read once from the tokenizer."""

    im_start: int | None
    im_end: int | None
    user: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatMarkers:
        vocab = tokenizer.get_vocab()
        return cls(
            im_start=vocab.get("<|im_start|>"),
            im_end=vocab.get("<|im_end|>"),
            user=tuple(tokenizer.encode("user", add_special_tokens=False)),
        )


def hint_insert_position(prompt: Sequence[int], markers: ChatMarkers) -> int:
    """Index in ``prompt`` where the hint tokens go (see module docstring)."""
    start, end, user = markers.im_start, markers.im_end, markers.user
    if start is not None and end is not None:
        for i in range(len(prompt) - 1, -1, -1):
            if prompt[i] == start and tuple(prompt[i + 1 : i + 1 + len(user)]) == user:
                for j in range(i + 1 + len(user), len(prompt)):
                    if prompt[j] == end:
                        return j
                break
        for i in range(len(prompt) - 1, -1, -1):
            if prompt[i] == start:
                return i
    return len(prompt)


def last_user_ids(prompt: Sequence[int], markers: ChatMarkers) -> list[int] | None:
    """The tokens of the last user message (the request a fresh answer should speak to), or
    None when the prompt has no ChatML user turn to find."""
    start, end, user = markers.im_start, markers.im_end, markers.user
    if start is None or end is None:
        return None
    at = hint_insert_position(prompt, markers)
    for i in range(min(at, len(prompt)) - 1, -1, -1):
        if prompt[i] == start:
            if (
                tuple(prompt[i + 1 : i + 1 + len(user)]) == user
                and at < len(prompt)
                and prompt[at] == end
            ):
                return list(prompt[i + 1 + len(user) : at])
            return None
    return None


def teacher_prompt(
    prompt: Sequence[int], hint: str, tokenizer: Any, markers: ChatMarkers
) -> list[int]:
    """The prompt with ``hint`` appended to its last user message."""
    at = hint_insert_position(prompt, markers)
    hint_ids = tokenizer.encode(HINT_TEMPLATE.format(hint=hint), add_special_tokens=False)
    return [*prompt[:at], *hint_ids, *prompt[at:]]
