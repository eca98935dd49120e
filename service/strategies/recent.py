"""The most of recent samples, forgotten with time: what a session sets aside for work it
cannot price from the bundle (a parser policy's own time), per size bucket."""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class RecentMost:
    """Per key, the largest sample seen, halving every ``half_life_s`` seconds since it was
    last raised. A slow stretch (a stall, another thread holding the GIL) weighs only while
    it lasts; and when a caller stops sampling because the estimate priced the work out,
    the estimate still falls, so the work is done, and timed, again. Keys are size buckets,
    ``n.bit_length()``: work whose time grows with the size is priced at its own size.
    (Threads may race on a key: one lost update of a decaying maximum is harmless.)"""

    def __init__(
        self, half_life_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not (math.isfinite(half_life_s) and half_life_s > 0):
            raise ValueError(f"half_life_s must be a finite number > 0, got {half_life_s!r}")
        self.half_life_s = half_life_s
        self.clock = clock
        self._most: dict[int, tuple[float, float]] = {}  # bucket -> (sample, when)

    def at(self, n: int) -> float:
        """The estimate for size ``n`` now (0 before any sample in its bucket)."""
        got = self._most.get(int(n).bit_length())
        if got is None:
            return 0.0
        value, when = got
        return float(value * 0.5 ** (max(self.clock() - when, 0.0) / self.half_life_s))

    def note(self, n: int, sample: float) -> None:
        """One sample at size ``n``."""
        if math.isfinite(sample) and sample > self.at(n):
            self._most[int(n).bit_length()] = (sample, self.clock())

    def clear(self) -> None:
        self._most.clear()
