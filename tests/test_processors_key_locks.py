"""Per-key locks: holders of one key take turns, other keys do not wait, free locks go."""

from __future__ import annotations

import asyncio

from pipeline.processors.key_locks import KeyLocks


def test_holders_of_one_key_take_turns_and_other_keys_do_not_wait() -> None:
    async def run() -> list[str]:
        locks, order = KeyLocks(), []
        release = asyncio.Event()

        async def hold(key: bytes, name: str, wait: bool) -> None:
            async with locks.hold(key):
                order.append(f"{name} in")
                if wait:
                    await release.wait()
                order.append(f"{name} out")

        first = asyncio.create_task(hold(b"s", "a", True))
        await asyncio.sleep(0)
        second = asyncio.create_task(hold(b"s", "b", False))
        other = asyncio.create_task(hold(b"t", "c", False))
        await asyncio.sleep(0.01)
        assert len(locks) == 1 and other.done() and not second.done()
        release.set()
        await asyncio.gather(first, second, other)
        assert len(locks) == 0  # nobody holds or waits: dropped
        return order

    order = asyncio.run(run())
    assert order == ["a in", "c in", "c out", "a out", "b in", "b out"]


def test_a_holder_that_raises_releases_the_key() -> None:
    async def run() -> int:
        locks = KeyLocks()
        try:
            async with locks.hold(b"s"):
                raise ValueError("boom")
        except ValueError:
            pass
        async with locks.hold(b"s"):  # would hang if the lock were still held
            pass
        return len(locks)

    assert asyncio.run(asyncio.wait_for(run(), 5)) == 0
