"""How far behind its timers the event loop runs.

A request's receipt is stamped when the event loop reads its first bytes
(``service.server``). While the loop is busy, bytes that have arrived wait in the kernel's
socket buffer, unseen, for about as long as the loop is behind; the client counts that wait.
Under an overload that is where the queue forms (each request is answered quickly once seen,
but seen late). So the receipt is dated back by how overdue the loop's timer is at the
moment the bytes are read (``ConnectionClock.bytes_arrived``, :meth:`LoopLag.overdue_ms`),
and the deadline and admission (``PredictHandler._admit_by_deadline``) count that wait too.
``LOOP_LAG`` is the process's instance: the app starts it on its loop.

:class:`LoopLag` keeps a timer every ``period_s`` on the loop; an overdue tick means the
loop is in a long batch of callbacks right now. Lateness up to ``slack_s`` is the timer's own
granularity (uvloop rounds to the millisecond) and is not counted.
"""

from __future__ import annotations

import asyncio
import time

# A tick every 2 ms: ~500 callbacks a second, a few µs each.
PERIOD_S = 0.002
# uvloop's timers fire on millisecond boundaries: this much lateness is the timer's own.
SLACK_S = 0.0015


class LoopLag:
    """The event loop's lag, measured by a repeating timer (see the module)."""

    def __init__(self, period_s: float = PERIOD_S, slack_s: float = SLACK_S) -> None:
        self.period_s = period_s
        self.slack_s = slack_s
        self._due = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start ticking on ``loop`` (the running loop of this process), instead of any loop
        it ticked on before."""
        self.stop()
        self._loop = loop
        self._schedule()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._loop = None

    def _schedule(self) -> None:
        assert self._loop is not None
        self._due = time.perf_counter() + self.period_s
        self._handle = self._loop.call_later(self.period_s, self._tick)

    def _tick(self) -> None:
        if self._loop is not None:
            self._schedule()

    def overdue_ms(self) -> float:
        """How overdue the next tick is now, in milliseconds: how long the loop has been
        busy without getting back to its timers (0 when it is keeping up). Bytes read now
        may have waited that long unseen; a loop back from a long callback has run its
        timers before it reads, so a stale lateness is not counted."""
        if self._loop is None:
            return 0.0
        return max(time.perf_counter() - self._due - self.slack_s, 0.0) * 1000.0


#: The process's lag (one event loop per worker process).
LOOP_LAG = LoopLag()
