"""The service benchmark's pieces that can be checked without a load run: the profile summary
(against hand-made collapsed stacks), the load generator (against a real bare server is
the benchmark's own job; here, a loopback server of the test's own), the budget with
which budgetserve does the bare app's work (through the real handler) and goal 4's verdict
on goodput under overload."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.loadgen import run
from benchmarks.service import SAME_WORK_RESERVE_MS, goal_lines, summarize, thumbnail_only_ms
from service.registry import CalibrationSettings, load_bundle
from tests.conftest import digit_image, png_b64
from tests.service.test_deadline import ask_all, make_handler


def test_summary_counts_each_sample_for_its_innermost_category() -> None:
    stacks = "\n".join(
        [
            "main;uvicorn/protocols/http/h11_impl.py:490 (send) 6",
            "main;starlette/routing.py;service/items.py:143 (grayscale) 3",
            "main;starlette/routing.py (app) 1",
            "main;mystery (x) 2",
            "not a line",
        ]
    )
    lines = summarize(stacks, top=2)
    assert lines[0] == "12 samples:"
    assert "- HTTP parsing and protocol (uvicorn, h11, httptools): 50.0 %" in lines
    assert "- PNG decoding: 25.0 %" in lines  # inside starlette, but decoding is innermost
    assert "- FastAPI / Starlette routing and middleware: 8.3 %" in lines
    assert "- other: 16.7 %" in lines
    assert lines[-2:] == [
        "- `uvicorn/protocols/http/h11_impl.py:490 (send)`: 50.0 %",
        "- `service/items.py:143 (grayscale)`: 25.0 %",
    ]
    assert summarize("") == ["(no samples)"]


@pytest.fixture
def echo_port() -> Iterator[int]:
    """An HTTP/1.1 server answering every request with its body, after 2 ms."""
    loop = asyncio.new_event_loop()
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                await asyncio.sleep(0.002)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        server.close()
        for writer in writers:
            writer.close()
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()

        async def drain() -> None:
            await asyncio.gather(*pending, return_exceptions=True)
            await server.wait_closed()

        loop.run_until_complete(drain())
        loop.close()


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_load_generator_sends_fresh_ids_and_times_answers(echo_port: int, mode: str) -> None:
    spec = {
        "port": echo_port,
        "templates": ['{"id": "%s", "n": 0}', '{"id": "%s", "n": 1}'],
        "duration_s": 0.5,
        "warmup_s": 0.1,
        "mode": mode,
        "clients": 2,
        "rate": 100.0,
        "id_prefix": "t",
    }
    results = asyncio.run(run(spec))
    assert len(results) >= 10
    assert all(r.status == 200 for r in results)
    assert all(r.latency_ms >= 2.0 for r in results)  # the server's 2 ms at least
    bodies = [r.body for r in results]
    assert len(set(bodies)) == len(bodies), "every request has a fresh id"
    assert {r.template for r in results} == {0, 1}
    for r in results:
        assert f'"n": {r.template}'.encode() in r.body
    if mode == "open":  # sent on schedule: 100/s over 0.5 s after the warm-up
        assert 45 <= len(results) <= 51


def test_the_same_work_budget_buys_thumbnail_alone(digits_bundle_dir: Path) -> None:
    """The CPU table's "budgetserve, the bare app's work" row: with the profiled costs (live
    calibration off), a fixed reserve and "work" accounting, a budget of the reserve plus
    ``thumbnail_only_ms`` buys ``thumbnail`` and nothing else (or, at a slow moment of a
    busy machine, nothing: the benchmark counts what its answers computed); 1 ms more buys
    something else."""
    bundle = load_bundle(digits_bundle_dir, 1 << 20, calibration=CalibrationSettings(enabled=False))
    handler = make_handler(bundle)
    handler.floor.fixed_reserve_ms = SAME_WORK_RESERVE_MS
    plannable = thumbnail_only_ms()
    costs = sorted(bundle.costs.at(128.0 * 128.0).items(), key=lambda kv: kv[1])
    assert dict(costs)["thumbnail"] < plannable < costs[0][1] + costs[1][1]
    pngs = [png_b64(digit_image(d, 128)) for d in range(10)]

    def ask(budget: float, tag: str) -> list[list[str]]:
        asked = [
            {"png": png, "budget": budget, "id": f"{tag}{k}", "accounting": "work"}
            for k, png in enumerate(pngs)
        ]
        return [r.cost.extracted for r in ask_all(handler, asked)]

    ask(SAME_WORK_RESERVE_MS + plannable, "warm")  # a fresh process's first requests are slow
    bought = ask(SAME_WORK_RESERVE_MS + plannable, "same")
    assert all(b in ([], ["thumbnail"]) for b in bought), bought
    assert bought.count(["thumbnail"]) >= 8, bought
    richer = ask(SAME_WORK_RESERVE_MS + 1.0, "rich")
    assert sum(b not in ([], ["thumbnail"]) for b in richer) >= 8, richer


def open_loop_found(goodputs: dict[float, float]) -> dict[str, object]:
    """What goal 4's lines read from a run: the open loop's cells and one client's answers."""
    cells = {
        (f, "budgetserve"): {"goodput": g, "within1": 1.0, "accuracy": 0.95}
        for f, g in goodputs.items()
    }
    one = {"budgetserve @ 1 ms": {"accuracy": 0.93, "within05": 1.0}}
    one["budgetserve @ 5 ms"] = {"accuracy": 0.96, "within05": 1.0}
    return {"open": {"cells": cells}, "one_128": one}


def test_goal_4_counts_a_fall_as_the_load_grows_not_a_rise() -> None:
    """Goodput still rising past the bare app's measured saturation (the server answered
    everything at 110 %) is no collapse; goodput falling as the load grows is."""
    rising = "\n".join(goal_lines(open_loop_found({0.7: 550, 1.1: 811, 1.5: 991, 2.0: 939})))
    assert "at worst 95% of the best at any rate up to it (939/s at 200% vs 991/s" in rising
    assert "the lowest above saturation 811/s against the run's peak of 991/s (82%)" in rising
    falling = "\n".join(goal_lines(open_loop_found({0.7: 550, 1.1: 750, 1.5: 838, 2.0: 420})))
    assert "at worst 50% of the best at any rate up to it (420/s at 200% vs 838/s" in falling
    nothing = "\n".join(goal_lines(open_loop_found({0.7: 0.0, 1.1: 0.0, 2.0: 0.0})))
    assert "at worst 100% of the best at any rate up to it (0/s at 110% vs 0/s" in nothing
