"""The event loop's lag (service.loop_lag), and receipts dated back by it.

A loop kept busy by a callback that holds it (as a flood of requests does) makes bytes wait
unseen in the socket; the timer sees the loop late by about as long, and a request whose
first bytes the loop reads then is taken to have arrived that much earlier.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from service.loop_lag import LOOP_LAG, LoopLag
from service.server import ConnectionClock
from tests.conftest import digit_image, png_b64

# Ticks every 50 ms here (2 ms in service): a paused test process cannot overwrite a late
# tick's lateness with the next one's before the test reads it.
PERIOD_S = 0.05


@contextlib.asynccontextmanager
async def clocked_connection() -> AsyncIterator[ConnectionClock]:
    """A loopback connection's :class:`ConnectionClock`, with ``LOOP_LAG`` ticking on this
    loop."""
    loop = asyncio.get_running_loop()
    accepted: list[asyncio.StreamWriter] = []

    def accept(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted.append(w)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    LOOP_LAG.start(loop)
    clock = ConnectionClock(loop, writer.transport)
    try:
        yield clock
    finally:
        clock.close()
        LOOP_LAG.stop()
        for w in [writer, *accepted]:
            w.close()
            await w.wait_closed()
        server.close()
        await server.wait_closed()


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
        async with clocked_connection() as clock:
            ages = []
            for hold in (0.0, 0.03):
                await asyncio.sleep(0.01)
                time.sleep(hold)  # the loop held: bytes that arrived meanwhile were unseen
                read = time.perf_counter()
                clock.bytes_arrived()
                ages.append(read - clock.request_began())
                clock.response_done()
        return ages[0], ages[1]

    on_time, held = asyncio.run(run())
    assert held >= 0.025
    assert on_time < held - 0.015


def test_a_receipt_is_never_dated_back_past_the_previous_answer() -> None:
    """A loop that reads the client's next request while it is late for another reason
    (here: it held itself 30 ms for the previous request; in service also a process
    descheduled while idle) is overdue by more than these bytes waited: they were sent
    after the answer, so their receipt is not dated before it (it was: 1-2 % of one
    client's 512 px requests were taken to have arrived 1-1.5 ms before the client sent
    them, and were answered from the prior)."""

    async def run() -> tuple[float, float, float]:
        async with clocked_connection() as clock:
            await asyncio.sleep(0.01)
            clock.bytes_arrived()
            clock.request_began()
            time.sleep(0.03)  # the request's work holds the loop; the timer falls behind
            overdue = LOOP_LAG.overdue_ms()
            clock.response_sent()
            answered = time.perf_counter()
            clock.response_done()
            clock.bytes_arrived()  # the next request, read in the same pass
            receipt = clock.request_began()
        return overdue, answered, receipt

    overdue, answered, receipt = asyncio.run(run())
    assert overdue >= 25.0, "the loop's lag is there to be misread"
    assert receipt >= answered - 0.001


def test_the_app_tells_the_clock_when_each_answer_is_sent(
    digits_bundle_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through uvicorn with the clocked protocol (``service.server.uvicorn_options``): every
    response's last bytes reach :meth:`ConnectionClock.response_sent`, while the request is
    still being served (before ``response_done``), so the bound above is the answer's time."""
    from service.cache import InProcessCache
    from service.http import create_app
    from service.settings import Settings
    from tests.service.serving import post_json, uvicorn_thread

    seen: list[bool] = []
    original = ConnectionClock.response_sent

    def spy(clock: ConnectionClock) -> None:
        seen.append(clock.busy)
        original(clock)

    app = create_app(Settings(models_dir=digits_bundle_dir.parent), cache=InProcessCache(1 << 20))
    body = {"model": "digits", "item": {"png_base64": png_b64(digit_image(3, 64))}, "budget": 5}
    monkeypatch.setattr(ConnectionClock, "response_sent", spy)
    with uvicorn_thread(app) as port:
        statuses = [post_json(port, "/predict", body)[0] for _ in range(2)]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:  # a framework route (not the lean /predict) on a kept-alive connection
            for _ in range(2):
                conn.request("GET", "/healthz")
                response = conn.getresponse()
                response.read()
                statuses.append(response.status)
        finally:
            conn.close()
    assert statuses == [200, 200, 200, 200]
    assert seen == [True, True, True, True]
