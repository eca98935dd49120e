"""The event loop's lag (service.loop_lag) and admission counting it as unseen lateness.

A loop kept busy by a callback that holds it (as a flood of requests does) makes bytes wait
unseen in the socket; the timer sees the loop late by about as long.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from service.errors import Overloaded
from service.handler import QUEUE_INTERVAL_S
from service.loop_lag import LoopLag
from service.registry import Bundle, load_bundle
from tests.conftest import digit_image, png_b64
from tests.service.test_deadline import make_handler


@pytest.fixture(scope="module")
def digits_bundle(digits_bundle_dir: Path) -> Bundle:
    return load_bundle(digits_bundle_dir, 1 << 20)


def test_the_lag_is_how_long_the_loop_was_held() -> None:
    async def run() -> tuple[float, float, float, float]:
        lag = LoopLag()
        assert lag.ms() == 0.0, "not started: no lag"
        lag.start(asyncio.get_running_loop())
        await asyncio.sleep(0.05)
        idle = lag.ms()
        time.sleep(0.03)  # the loop held for 30 ms: the next tick is overdue now
        during = lag.ms()
        for _ in range(3):  # let the overdue tick fire (late), and nothing after it yet
            await asyncio.sleep(0)
        after = lag.ms()
        await asyncio.sleep(0.05)
        recovered = lag.ms()
        lag.stop()
        return idle, during, after, recovered

    idle, during, after, recovered = asyncio.run(run())
    assert during >= 25.0
    assert after >= 25.0, "the late tick's lateness is kept until the next tick"
    # idle and recovered: the timer's own jitter only (relative bounds: a shared CI machine
    # may deschedule the loop for a few ms)
    assert idle < during - 10.0
    assert recovered < after - 10.0


def test_admission_counts_the_unseen_wait_behind_a_lagging_loop(digits_bundle: Bundle) -> None:
    """A request seen at once (received 0 ms ago) with a 5 ms budget, while the loop runs
    20 ms behind: its bytes were waiting unseen, so behind a standing queue it is refused
    before any work, and the refusal says how much of its lateness was unseen."""
    handler = make_handler(digits_bundle)
    png = png_b64(digit_image(0, 128))

    async def run() -> None:
        handler.loop_lag.start(asyncio.get_running_loop())
        try:
            for i in range(2):  # the first marks the interval late; the next is refused
                time.sleep(0.02)  # the loop held: the next tick is 20 ms overdue
                try:
                    await handler.predict("digits", {"png_base64": png, "id": f"l{i}"}, None, 5.0)
                except Overloaded as refused:
                    assert refused.details["unseen_ms"] >= 15.0
                    assert refused.details["late_ms"] >= refused.details["unseen_ms"]
                    raise
                time.sleep(QUEUE_INTERVAL_S * 1.2)
        finally:
            handler.loop_lag.stop()

    with pytest.raises(Overloaded, match="unseen in the socket"):
        asyncio.run(run())
    assert handler.held_bytes == 0 and handler.gate.free == handler.gate.threads
