"""One asyncio lock per key, for read-modify-write of a table value across awaits.

A session agent's batch reads a session's state, awaits its sends, then writes the state
back; a timer (the idle sweep, the state expiry) that ran in between on the same session
would have its write overwritten by the batch's (a close, an assembly, a dead letter that is
then done again). Each holds the session's lock from its read to its write. A holder takes
one key at a time, so no two wait on each other; a lock nobody holds or waits for is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Hashable


class KeyLocks:
    def __init__(self) -> None:
        self._locks: dict[Hashable, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)
