"""Token ids, log-probs and masks in memory: packed arrays that behave like the lists they replace.

A decoded interaction carries ~2,500 numbers. As Python lists they cost an object per number
to build and to read back (~100 µs an interaction, more than the rest of the codec); as
``array.array`` they are one buffer, filled from the wire by a copy (`binary.py`) and written
back the same way. These subclasses keep what consumers rely on from lists: ``==`` against a
list or tuple compares the items (so an event decoded from v2 equals the one built from
lists), slices and copies keep the class, and ``repr`` shows the items. Events may hold
either lists or these arrays (a writer passes what it has; decoding gives arrays); code that
reads them uses ``len``, indexing, iteration, ``sum``/``max``, ``torch.tensor`` or
``numpy.frombuffer``, which take both. JSON writers serialise them with :func:`json_default`.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    _IntArray = array[int]
    _FloatArray = array[float]
else:
    _IntArray = _FloatArray = array

_SWAP = sys.byteorder != "little"  # array() is native-endian; the wire is little-endian
# 'I' or 'L', whichever holds 4 bytes on this platform.
_U32 = next(code for code in "IL" if array(code).itemsize == 4)

_A = TypeVar("_A", bound="_Packed")


class _Packed:
    """Mixin of the list-like behaviour; the concrete classes also derive from ``array``."""

    __slots__ = ()
    TYPECODE: ClassVar[str]
    ITEMSIZE: ClassVar[int]  # bytes per item, on the wire and in memory

    def __new__(cls: type[_A], values: Iterable[Any] = ()) -> _A:
        return array.__new__(cls, cls.TYPECODE, values)  # type: ignore[type-var]

    @classmethod
    def from_le_bytes(cls: type[_A], raw: bytes | memoryview) -> _A:
        """Items from their little-endian bytes (a copy; raises ValueError on a partial item)."""
        # array's own constructor fills it from bytes in one C call (a decode makes three).
        out = array.__new__(cls, cls.TYPECODE, raw if type(raw) is bytes else bytes(raw))  # type: ignore[type-var]
        if _SWAP:
            out.byteswap()  # type: ignore[attr-defined]
        return out

    def le_bytes(self) -> bytes:
        """The items as little-endian bytes."""
        if not _SWAP:
            return self.tobytes()  # type: ignore[attr-defined]
        swapped = array(self.TYPECODE, self)  # type: ignore[call-overload]
        swapped.byteswap()
        return swapped.tobytes()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple)):
            return len(self) == len(other) and self.tolist() == list(other)  # type: ignore[arg-type,attr-defined]
        if isinstance(other, array):
            return array.__eq__(self, other)  # type: ignore[operator]
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # type: ignore[assignment]  # mutable, like the list it stands for

    def __getitem__(self, index: Any) -> Any:
        item = array.__getitem__(self, index)  # type: ignore[call-overload]
        return type(self)(item) if isinstance(index, slice) else item

    def __copy__(self: _A) -> _A:
        return type(self)(self)  # type: ignore[arg-type]

    def __deepcopy__(self: _A, memo: dict[int, Any]) -> _A:
        return type(self)(self)  # type: ignore[arg-type]

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self).from_le_bytes, (self.le_bytes(),))

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return self.__reduce__()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tolist()!r})"  # type: ignore[attr-defined]


class U32Array(_Packed, _IntArray):
    """Token ids: unsigned 32-bit, enough for any vocabulary."""

    __slots__ = ()
    TYPECODE = _U32
    ITEMSIZE = 4


class U8Array(_Packed, _IntArray):
    """0/1 masks."""

    __slots__ = ()
    TYPECODE = "B"
    ITEMSIZE = 1


class F64Array(_Packed, _FloatArray):
    """Log-probs: doubles, so v1 (JSON numbers, Python floats) and v2 carry the same values."""

    __slots__ = ()
    TYPECODE = "d"
    ITEMSIZE = 8


PACKED_TYPES: dict[str, type[_Packed]] = {"uint32": U32Array, "uint8": U8Array, "float64": F64Array}


def json_default(obj: Any) -> Any:
    """orjson's ``default``: a packed array as its list (the v1 JSON layout)."""
    if isinstance(obj, _Packed):
        return obj.tolist()  # type: ignore[attr-defined]
    raise TypeError(f"Type is not JSON serializable: {type(obj).__name__}")
