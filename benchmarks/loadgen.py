"""A lean HTTP/1.1 load generator on asyncio (uvloop when installed): closed loop (N clients,
each one request at a time on its own kept-alive connection) or open loop (requests sent at a
fixed rate whatever the answers, latency measured from each request's scheduled time, so a
slow server cannot slow the schedule down: no coordinated omission).

Run as a separate process (``python -m benchmarks.loadgen < spec.json > results.json``), so
the client's work is not the server's. wrk is not installed on our machines; this client is
the benchmark's own. Each request body is ``template % id`` with a fresh id per request (the
feature cache never helps).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Result:
    start: float  # seconds since the run began (scheduled time in open loop)
    latency_ms: float
    status: int
    body: bytes
    template: int  # which template the body was made from


async def _request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, body: bytes
) -> tuple[int, bytes]:
    writer.write(head + body)
    line = await reader.readline()
    if not line:
        raise ConnectionError("closed")
    status = int(line.split()[1])
    length = 0
    while True:
        header = await reader.readline()
        if header in (b"\r\n", b""):
            break
        name, _, value = header.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    payload = await reader.readexactly(length) if length else b""
    return status, payload


def _head(method: str, path: str, length: int | None) -> bytes:
    if length is None:
        return f"{method} {path} HTTP/1.1\r\nHost: b\r\n\r\n".encode()
    return (
        f"{method} {path} HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def run(spec: dict[str, Any]) -> list[Result]:
    port = int(spec["port"])
    path = spec.get("path", "/predict")
    method = spec.get("method", "POST")
    templates: list[str] = spec.get("templates", [])
    duration = float(spec["duration_s"])
    warmup = float(spec.get("warmup_s", 0.5))
    prefix = spec.get("id_prefix", "r")
    counter = itertools.count()

    def next_body() -> tuple[int, bytes]:
        k = next(counter)
        if not templates:
            return 0, b""
        which = k % len(templates)
        return which, (templates[which] % f"{prefix}{k}").encode()

    results: list[Result] = []
    t0 = time.perf_counter()
    end = t0 + warmup + duration

    async def one(reader: Any, writer: Any, scheduled: float) -> None:
        which, body = next_body()
        head = _head(method, path, len(body) if templates else None)
        try:
            status, payload = await _request(reader, writer, head, body)
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            status, payload = 0, b""
        done = time.perf_counter()
        if scheduled >= t0 + warmup:
            latency = (done - scheduled) * 1e3
            results.append(Result(scheduled - t0 - warmup, latency, status, payload, which))

    if spec["mode"] == "closed":

        async def client() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                while time.perf_counter() < end:
                    await one(reader, writer, time.perf_counter())
            finally:
                writer.close()

        await asyncio.gather(*(client() for _ in range(int(spec["clients"]))))
    else:
        rate = float(spec["rate"])
        pool: list[tuple[Any, Any]] = []
        tasks: set[asyncio.Task[None]] = set()

        async def fire(scheduled: float) -> None:
            if pool:
                reader, writer = pool.pop()
            else:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await one(reader, writer, scheduled)
            pool.append((reader, writer))

        k = 0
        while True:
            scheduled = t0 + k / rate
            if scheduled >= end:
                break
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.ensure_future(fire(scheduled))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            k += 1
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        for _, writer in pool:
            writer.close()
    return results


def main() -> None:
    spec = json.load(sys.stdin)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        pass
    results = asyncio.run(run(spec))
    keep = spec.get("keep", [])
    out = []
    for r in results:
        row: dict[str, Any] = {
            "t": r.start,
            "ms": r.latency_ms,
            "status": r.status,
            "template": r.template,
        }
        if keep and r.status == 200:
            try:
                answer = json.loads(r.body)
            except ValueError:
                answer = {}
            for field in keep:
                value: Any = answer
                for part in field.split("."):  # keys, and list indices ("outputs.0.data.0")
                    if isinstance(value, list) and part.isdigit():
                        value = value[int(part)] if int(part) < len(value) else None
                    else:
                        value = value.get(part) if isinstance(value, dict) else None
                row[field] = value
        out.append(row)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
