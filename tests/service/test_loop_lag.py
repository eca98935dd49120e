"""The event loop's lag (service.loop_lag), and receipts dated back by it.

A loop kept busy by a callback that holds it (as a flood of requests does) makes bytes wait
unseen in the socket; the timer sees the loop late by about as long, and a request whose
first bytes the loop reads then is taken to have arrived that much earlier.
"""

from __future__ import annotations

import asyncio
import time

from service.loop_lag import LOOP_LAG, LoopLag
from service.server import ConnectionClock

# Ticks every 50 ms here (2 ms in service): a paused test process cannot overwrite a late
# tick's lateness with the next one's before the test reads it.
PERIOD_S = 0.05


def test_the_lag_is_how_long_the_loop_was_held() -> None:
    """Overdue while the loop is held; back to nothing once the loop has run its timers (a
    stale lateness is not kept)."""

    async def run() -> tuple[float, float, float]:
        lag = LoopLag(period_s=PERIOD_S)
        assert lag.overdue_ms() == 0.0, "not started: no lag"
        lag.start(asyncio.get_running_loop())
        await asyncio.sleep(0.12)
        idle = lag.overdue_ms()
        time.sleep(0.1)  # the loop held for 100 ms: the next tick is overdue now
        during = lag.overdue_ms()
        for _ in range(3):  # let the overdue tick fire (late) and schedule the next
            await asyncio.sleep(0)
        after = lag.overdue_ms()
        lag.stop()
        assert lag.overdue_ms() == 0.0, "stopped: no lag"
        return idle, during, after

    idle, during, after = asyncio.run(run())
    assert during >= 40.0
    # idle and after: the timer's own jitter only (relative bounds: a shared CI machine may
    # deschedule the loop for a few ms)
    assert idle < during - 20.0
    assert after < during - 20.0


def test_a_receipt_is_dated_back_by_the_loops_lag() -> None:
    """Bytes read by a loop that was held for 30 ms waited unseen: the connection's receipt
    is that much before the read; read by a loop that keeps up, it is the read."""

    async def run() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        accepted: list[asyncio.StreamWriter] = []

        def accept(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            accepted.append(w)

        server = await asyncio.start_server(accept, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        LOOP_LAG.start(loop)
        try:
            clock = ConnectionClock(loop, writer.transport)
            ages = []
            for hold in (0.0, 0.03):
                await asyncio.sleep(0.01)
                time.sleep(hold)  # the loop held: bytes that arrived meanwhile were unseen
                read = time.perf_counter()
                clock.bytes_arrived()
                ages.append(read - clock.request_began())
                clock.response_done()
            clock.close()
        finally:
            LOOP_LAG.stop()
            for w in [writer, *accepted]:
                w.close()
                await w.wait_closed()
            server.close()
            await server.wait_closed()
        return ages[0], ages[1]

    on_time, held = asyncio.run(run())
    assert held >= 0.025
    assert on_time < held - 0.015
