"""Policy backends behind one interface (see :mod:`.base`)."""

from .base import Backend, Done, Piece, SamplingParams

__all__ = ["Backend", "Done", "Piece", "SamplingParams"]
