"""Tokenize only what is new in a session's prompt.

Each turn of a session re-sends the whole conversation, so its rendered prompt repeats the
previous turn's prompt and adds the answer and the user's reply. Tokenizing 12k characters
costs ~11 ms of CPU (the tiny model's tokenizer; a 3k-token SmolLM2 prompt ~2 ms), the
largest per-request cost of a long session in the gateway. This cache keeps each session's
last prompt (text and token ids) and tokenizes the new one from the last point where the two
texts still agree *and* an added token (``<|im_start|>``, ``<|im_end|>``…) starts.

Why that split is exact: a fast tokenizer first cuts the text at its added tokens and then
normalizes, pre-tokenizes and encodes each piece between them independently, so a cut just
before an added token changes nothing on either side, unless that token strips whitespace
to its left (``lstrip``); such tokens are never used as cut points. The first few cache hits
of each tokenizer are still checked against a full encode; a mismatch turns the cache off
for good (with a warning) instead of serving different ids.
"""

from __future__ import annotations

import bisect
import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

VERIFY_HITS = 8  # first hits per cache checked against a full encode


@dataclass(slots=True)
class _Entry:
    text: str
    ids: array  # uint32 token ids: a quarter of a list's memory
    cuts: list[int]  # char offsets where an added token starts (ascending)
    cut_tokens: list[int]  # the token index at each cut

    @property
    def nbytes(self) -> int:
        return len(self.text) + self.ids.itemsize * len(self.ids) + 16 * len(self.cuts)


class PromptCache:
    """Per-session prompt tokenization; ``encode(session, text)`` equals a full encode."""

    def __init__(self, tokenizer: Any, max_bytes: int = 64 << 20) -> None:
        self.tokenizer = tokenizer
        self.max_bytes = max_bytes
        self._backend = _fast_backend(tokenizer)
        # Added tokens that may start a cut, by id: their text (a model can also emit an
        # added token's id, e.g. <unk>, for text that is not that token: no cut there).
        self._cut_ids: dict[int, str] = {}
        if self._backend is not None:
            added = self._backend.get_added_tokens_decoder()
            self._cut_ids = {i: tok.content for i, tok in added.items() if not tok.lstrip}
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.saved_chars = 0
        self._verified = 0

    @property
    def enabled(self) -> bool:
        return self._backend is not None and bool(self._cut_ids) and self.max_bytes > 0

    def encode(self, session_id: str | None, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added), reusing the session's last prompt."""
        if not self.enabled or session_id is None:
            return self._full(text)
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._bytes -= entry.nbytes
        k = _shared_cut(entry, text) if entry is not None else -1
        if entry is None or k < 0:
            return self._encode_and_store(session_id, text)
        if not self._starts_cut(text, entry.cuts[k]) and k > 0:
            k -= 1  # the new text differs right at the last shared cut: take the one before
        start, kept = entry.cuts[k], entry.cut_tokens[k]
        tail, offsets = self._encode_offsets(text[start:])
        if not tail or self._cut_ids.get(tail[0]) is None or offsets[0][0] != 0:
            # no added token starts the tail after all: no split there, encode in full
            return self._encode_and_store(session_id, text)
        joined = entry.ids[:kept]
        joined.extend(tail)
        out = joined.tolist()
        if self._verified < VERIFY_HITS:
            self._verified += 1
            full = self._full(text)
            if out != full:
                log.warning(
                    "prompt cache disabled: this tokenizer does not split exactly at its "
                    "added tokens; every prompt is now tokenized in full"
                )
                self._backend = None
                self._entries.clear()
                self._bytes = 0
                return full
        self.hits += 1
        self.saved_chars += start
        self._store(
            session_id, text, joined, offsets, start, entry.cuts[: k + 1], entry.cut_tokens[: k + 1]
        )
        return out

    def forget(self, session_id: str) -> None:
        """Drop a closed session's prompt."""
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._bytes -= entry.nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def _starts_cut(self, text: str, char: int) -> bool:
        return any(text.startswith(c, char) for c in self._cut_ids.values())

    def _full(self, text: str) -> list[int]:
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _encode_and_store(self, session_id: str, text: str) -> list[int]:
        ids, offsets = self._encode_offsets(text)
        self._store(session_id, text, array("I", ids), offsets, 0, [], [])
        return ids

    def _encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._backend.encode(text, add_special_tokens=False)
        return list(enc.ids), enc.offsets

    def _store(
        self,
        session_id: str,
        text: str,
        ids: array,
        tail_offsets: list[tuple[int, int]],
        start: int,
        cuts: list[int],
        cut_tokens: list[int],
    ) -> None:
        """Keep ``text`` and its ``ids``: the prefix up to char ``start`` (whose cuts are
        given) reused, the rest encoded with ``tail_offsets`` (relative to ``start``)."""
        kept = len(ids) - len(tail_offsets)
        for j, tok in enumerate(ids[kept:]):
            content = self._cut_ids.get(tok)
            if content is None:
                continue
            char = tail_offsets[j][0] + start
            if text.startswith(content, char) and (not cuts or char > cuts[-1]):
                cuts.append(char)
                cut_tokens.append(kept + j)
        entry = _Entry(text, ids, cuts, cut_tokens)
        if entry.nbytes > self.max_bytes:
            return
        self._entries[session_id] = entry
        self._bytes += entry.nbytes
        while self._bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.nbytes


def _shared_cut(entry: _Entry, text: str) -> int:
    """Index of the last cut up to which ``text`` repeats ``entry.text`` (-1: none). A text
    that agrees up to a cut agrees up to every earlier one, so a binary search finds it."""
    lo, hi = 0, bisect.bisect_right(entry.cuts, len(text)) - 1
    best = -1
    while lo <= hi:
        mid = (lo + hi) // 2
        c = entry.cuts[mid]
        if c > 0 and text[:c] == entry.text[:c]:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def _fast_backend(tokenizer: Any) -> Any:
    """The tokenizers-library object behind a fast tokenizer, when encoding with it directly
    gives what ``tokenizer(text)`` gives (no truncation or padding configured, special tokens
    matched as tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    # A tokenizer told to split its special tokens as text has no added-token cuts to use.
    if getattr(tokenizer, "split_special_tokens", False) or getattr(
        backend, "encode_special_tokens", False
    ):
        return None
    return backend
