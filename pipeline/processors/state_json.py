"""The processors' table values as JSON: msgspec over the state dataclasses.

A worker reads and writes a session's state on every input, so this is on the hot path.
pydantic's TypeAdapter wrote and read the same JSON (the bytes are identical: same field
names and order, int dict keys as strings, tuples as arrays) at about three times the CPU,
so values written before the switch read back unchanged.
"""

from __future__ import annotations

from array import array
from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")


class StateUnreadable(ValueError):
    """A stored value that does not decode as this code's state (another code version wrote
    it, or a bug): the runtime dead-letters and drops it."""


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, array):  # packed token arrays (events/arrays.py) kept in a state
        return obj.tolist()
    raise NotImplementedError(f"cannot store a {type(obj).__name__} in a state")


_ENCODER = msgspec.json.Encoder(enc_hook=_enc_hook)


class StateJson(Generic[T]):
    """``dump`` and ``load`` of one state type."""

    def __init__(self, cls: type[T]) -> None:
        self._decoder = msgspec.json.Decoder(cls)

    @staticmethod
    def dump(value: object) -> bytes:
        return _ENCODER.encode(value)

    def load(self, raw: bytes | memoryview) -> T:
        """The state; StateUnreadable for a value that is not one."""
        try:
            return self._decoder.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise StateUnreadable(str(exc)) from None
