"""Token ids to text, as ``tokenizer.decode(ids, skip_special_tokens=True)`` gives it, faster.

transformers' ``decode`` walks the id list in Python before the Rust tokenizer decodes it
(``to_py_obj`` checks each element's type): ~150 µs for a 100-token answer. A streamed answer
is decoded again at every token (what is safe to send depends on the whole text), so that walk
was 62 % of the gateway's CPU while streaming a 200-token answer (``bench/gateway.py
--client-stream --max-tokens 200``, profiled). The fast tokenizer's own ``decode`` is the same
text without the walk. It is used only where transformers adds nothing after it (no clean-up
of tokenization spaces) and its first decodes are checked against transformers'; a mismatch
turns the shortcut off for good, with a warning, rather than serve a different text.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

VERIFY_DECODES = 32  # first decodes per detokenizer checked against transformers'


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        usable = backend is not None and callable(getattr(backend, "decode", None))
        self._backend = backend if usable and not _cleans_up(tokenizer) else None
        self._checked = 0

    @property
    def fast(self) -> bool:
        """Whether decodes skip transformers (False: a slow tokenizer, spaces cleaned up, or
        a check that failed)."""
        return self._backend is not None

    def decode(self, ids: list[int]) -> str:
        if self._backend is None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        text: str = self._backend.decode(ids, skip_special_tokens=True)
        if self._checked < VERIFY_DECODES:
            self._checked += 1
            slow = self.tokenizer.decode(ids, skip_special_tokens=True)
            if slow != text:
                log.warning(
                    "the tokenizer's fast decode differs from transformers' "
                    "(%r vs %r); every answer is now decoded by transformers",
                    text[:80],
                    slow[:80],
                )
                self._backend = None
                return slow
        return text


def _cleans_up(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
