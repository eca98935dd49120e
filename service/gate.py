"""The extraction threads of one process, handed to waiting requests earliest deadline
first (:class:`ThreadGate`)."""

from __future__ import annotations

import asyncio
import heapq
import itertools


class ThreadGate:
    """At most ``threads`` requests extracting at once; the others wait, and a free thread
    goes to the waiter whose deadline comes first (earliest deadline first), not to the
    oldest: a request with time to spare gives way to one about to miss its deadline.
    Waiting is bounded by each waiter's own limit (:meth:`acquire`)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.free = threads
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def available(self) -> bool:
        return self.free > 0 and not self._heap

    def try_acquire(self) -> bool:
        if self.available():
            self.free -= 1
            return True
        return False

    async def acquire(self, deadline: float, wait_limit_s: float | None) -> bool:
        """A thread, within ``wait_limit_s`` (None: no limit): True once granted (the caller
        releases it), False when the limit ran out first."""
        if self.try_acquire():
            return True
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (deadline, next(self._order), granted))
        try:
            async with asyncio.timeout(wait_limit_s):
                await asyncio.shield(granted)
            return True
        except TimeoutError:
            if granted.done():  # granted as the limit ran out: not ours to keep
                self.release()
            else:
                granted.cancel()
            return False
        except BaseException:  # cancelled while waiting
            if granted.done() and not granted.cancelled():
                self.release()
            granted.cancel()
            raise

    def waiting_deadlines(self) -> list[float]:
        """The deadlines of the requests waiting for a thread (safe from any thread)."""
        return [deadline for deadline, _, waiter in list(self._heap) if not waiter.done()]

    def release(self) -> None:
        while self._heap:
            _, _, waiter = heapq.heappop(self._heap)
            if not waiter.done():
                waiter.set_result(None)  # the thread passes to it: ``free`` unchanged
                return
        self.free += 1
