"""``budgetserve-serve`` with several workers: no Nagle delay on reused connections.

uvicorn's own listening socket for several workers has no ``TCP_NODELAY``; asyncio then leaves
Nagle's algorithm on for accepted connections, and every response on a kept-alive connection
waits for the client's delayed ACK (~40 ms). ``service.server.listening_socket`` sets it, for
any number of workers; these tests check the option on the socket and on what it accepts, and
the latency a client sees from a real 2-worker server.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from service.server import listening_socket
from tests.conftest import DIGITS_BUNDLE, ROOT, digit_image, free_port, png_b64


def _read_response(conn: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length body (what uvicorn sends here)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the response head")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length = next(
        int(line.split(b":", 1)[1])
        for line in lines[1:]
        if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("closed mid-body")
        body += chunk
    return status, body


def test_listening_socket_and_accepted_connections_have_nodelay() -> None:
    sock = listening_socket("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert sock.get_inheritable(), "worker processes inherit the socket"
        sock.listen(1)
        client = socket.create_connection(sock.getsockname()[:2], timeout=5)
        accepted, _ = sock.accept()
        try:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        finally:
            accepted.close()
            client.close()
    finally:
        sock.close()


@pytest.fixture
def two_workers() -> Iterator[int]:
    port = free_port()
    env = dict(
        os.environ,
        BUDGETSERVE_HOST="127.0.0.1",
        BUDGETSERVE_PORT=str(port),
        BUDGETSERVE_WORKERS="2",
        BUDGETSERVE_MODELS_DIR=str(DIGITS_BUNDLE.parent),
    )
    env.pop("REDIS_URL", None)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "service"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "budgetserve-serve exited during start-up"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                    conn.sendall(b"GET /readyz HTTP/1.1\r\nHost: t\r\n\r\n")
                    if _read_response(conn)[0] == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "not ready within 120 s"
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_small_requests_on_a_reused_connection_with_two_workers(two_workers: int) -> None:
    """A 1 ms-budget prediction of a 32 px digit, 41 times on one kept-alive connection: the
    median answer comes well under Nagle's ~40 ms (a few ms even on a loaded 2-core VM)."""
    body = json.dumps(
        {"model": "digits", "item": {"png_base64": png_b64(digit_image(5, 32))}, "budget": 1}
    ).encode()
    request = (
        b"POST /predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    health = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
    times: dict[bytes, list[float]] = {request: [], health: []}
    with socket.create_connection(("127.0.0.1", two_workers), timeout=60) as conn:
        for _ in range(41):
            for sent in (request, health):
                t0 = time.perf_counter()
                conn.sendall(sent)
                status, payload = _read_response(conn)
                times[sent].append(time.perf_counter() - t0)
                assert status == 200, payload
                if sent is request:
                    # the protocol stamped the receipt: the deadline counts from it
                    answer = json.loads(payload)
                    assert answer["cost"]["accounting"] == "deadline"
                    assert answer["timings_ms"]["since_received"] >= answer["cost"]["spent"]
    for sent, label in ((request, "predict"), (health, "healthz")):
        p50 = sorted(times[sent][1:])[20]
        assert p50 < 0.02, f"{label} p50 {p50 * 1e3:.1f} ms on a reused connection (Nagle: ~40 ms)"
