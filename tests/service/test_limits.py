"""What one process will hold: stalled bodies time out (408, connection closed), budgets are
capped (422), queued work is bounded by count and bytes (503 + Retry-After), and small
requests are not kept waiting behind big ones. Through a real uvicorn (the body time-out is
the server's business) or a real ``budgetserve-serve`` process (memory)."""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from service.http import create_app, requestlog
from service.server import header_timeout_s
from service.settings import Settings
from tests.conftest import ROOT, digit_image, free_port, png_b64
from tests.service.serving import metric, post_json, read_one, uvicorn_thread

VENV_BIN = Path(sys.executable).parent


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def test_a_stalled_body_gets_408_and_its_connection_closed(digits_bundle_dir: Path) -> None:
    app = create_app(Settings(models_dir=digits_bundle_dir.parent, body_timeout_s=1.0))
    with uvicorn_thread(app) as port:
        conns = []
        for _ in range(20):  # headers and 9 bytes of a 100,000-byte body, then nothing
            conn = socket.create_connection(("127.0.0.1", port), timeout=15)
            conn.sendall(
                b"POST /predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
                b'\r\nContent-Length: 100000\r\n\r\n{"model":'
            )
            conns.append(conn)
        started = time.monotonic()
        answers = [read_until_closed(c) for c in conns]  # bounded by the socket time-out
        waited = time.monotonic() - started
        for c in conns:
            c.close()
        # A body that does arrive in time is still served.
        body = {
            "model": "digits",
            "item": {"png_base64": png_b64(digit_image(3, 32))},
            "budget": 20,
        }
        status, _, answer = post_json(port, "/predict", body)
        assert status == 200 and answer["prediction"] == "3"
        metrics = post_json_metrics(port)
    assert waited < 10, f"stalled connections were held {waited:.1f} s"
    for raw in answers:
        head, _, payload = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), raw[:200]
        assert b"connection: close" in head.lower()
        error = json.loads(payload)["error"]
        assert error["type"] == "body_timeout" and "BUDGETSERVE_BODY_TIMEOUT_S" in error["message"]
    counted = 'budgetserve_requests_total{model="_unknown",status="body_timeout"}'
    assert metric(metrics, counted) == 20


def test_a_stalled_request_head_closes_the_connection(
    digits_bundle_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half a request head, on a new connection or on a kept-alive one after a response, is
    closed after BUDGETSERVE_HEADER_TIMEOUT_S (uvicorn's keep-alive timer stops at the first
    byte, so it was held for ever)."""
    monkeypatch.setenv("BUDGETSERVE_HEADER_TIMEOUT_S", "1")
    header_timeout_s.cache_clear()
    try:
        app = create_app(Settings(models_dir=digits_bundle_dir.parent))
        with uvicorn_thread(app) as port:
            fresh = [socket.create_connection(("127.0.0.1", port), timeout=15) for _ in range(10)]
            for conn in fresh:
                conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
            reused = socket.create_connection(("127.0.0.1", port), timeout=15)
            reused.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            first = b""
            while not first.endswith(b'{"status":"ok"}'):  # the whole response, then more
                chunk = reused.recv(65536)
                assert chunk, first
                first += chunk
            reused.sendall(b"GET /healthz HTTP/1.1\r\n")
            started = time.monotonic()
            leftovers = [read_until_closed(c) for c in [*fresh, reused]]
            waited = time.monotonic() - started
            for conn in [*fresh, reused]:
                conn.close()
            # A head that arrives within the time-out, in pieces, is served.
            with socket.create_connection(("127.0.0.1", port), timeout=15) as slow:
                for piece in (b"GET /heal", b"thz HTTP/1.1\r\nHost: t\r\n", b"\r\n"):
                    slow.sendall(piece)
                    time.sleep(0.2)
                assert slow.recv(65536).startswith(b"HTTP/1.1 200")  # the status line
    finally:
        header_timeout_s.cache_clear()
    assert first.startswith(b"HTTP/1.1 200")
    assert leftovers == [b""] * 11
    assert waited < 10, f"half-sent heads were held {waited:.1f} s"


def post_json_metrics(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        return read_until_closed(conn).partition(b"\r\n\r\n")[2].decode()


def test_a_budget_over_the_cap_is_refused_with_how_to_change_it(
    digits_bundle_dir: Path, router_bundle_dir: Path
) -> None:
    settings = Settings(models_dir=digits_bundle_dir.parent, max_budget_ms=500)
    item = {"png_base64": png_b64(digit_image(3, 32))}
    with TestClient(create_app(settings)) as client:
        r = client.post("/predict", json={"model": "digits", "item": item, "budget": 500.5})
        ok = client.post("/predict", json={"model": "digits", "item": item, "budget": 500})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request"
    assert "at most 500 ms" in error["message"] and "BUDGETSERVE_MAX_BUDGET_MS" in error["message"]
    assert error["details"] == {"budget": 500.5, "max_budget": 500.0}
    assert ok.status_code == 200
    # Budgets in a declared unit (sensor costs, not time) are not capped in ms.
    declared = Settings(models_dir=router_bundle_dir.parent, max_budget_ms=1)
    row = {"values": {"r": 0.5, "a1": 0.1, "a2": 0.2, "b1": 0.3, "b2": 0.4}}
    with TestClient(create_app(declared)) as client:
        r = client.post("/predict", json={"model": "router", "item": row, "budget": 100})
    assert r.status_code == 200, r.text


def noise_png_b64(side: int, seed: int) -> str:
    """A 1024² picture that does not compress: the body is as big as the pixels."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode()


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@pytest.mark.parametrize(
    ("bound", "max_queued", "max_bytes"),
    [
        ("queue_full", 4, 256 << 20),  # 4 waiting at most
        # 6 MiB of decoded items: one 1024² item (4 MiB) working, none waiting. (A free
        # thread goes to the earliest deadline, so an item decoded for work goes before the
        # decoding of a later one: at most one decoded item waits at a time.)
        ("queue_bytes", 64, 6 << 20),
    ],
)
def test_big_items_with_huge_budgets_do_not_queue_small_requests_or_memory(
    tmp_path: Path, digits_bundle_dir: Path, bound: str, max_queued: int, max_bytes: int
) -> None:
    """The issue's load: many clients send 1024² items with the largest budget, while another
    sends small items with a 5 ms budget, against a real ``budgetserve-serve`` (one worker,
    one extraction thread). Small requests are answered within their budgets (the service's
    own ``queued`` and ``spent``); excess big ones are refused with 503 + Retry-After; the
    server's peak RSS stays bounded."""
    port = free_port()
    env = {
        **os.environ,
        "BUDGETSERVE_HOST": "127.0.0.1",
        "BUDGETSERVE_PORT": str(port),
        "BUDGETSERVE_MODELS_DIR": str(digits_bundle_dir.parent),
        "BUDGETSERVE_WORKERS": "1",
        "BUDGETSERVE_EXTRACTION_THREADS": "1",
        "BUDGETSERVE_MAX_QUEUED": str(max_queued),
        "BUDGETSERVE_MAX_QUEUED_BYTES": str(max_bytes),
        "BUDGETSERVE_MAX_BUDGET_MS": "3000",
        "BUDGETSERVE_CALIBRATION": "false",
        # This test is about the queue for extraction threads; with load shedding on (the
        # default, 1 s) this load also gets big requests shed whenever the event loop, starved
        # by 1024² extractions, falls a second behind (see the shedding test below).
        "BUDGETSERVE_MAX_QUEUE_DELAY_MS": "0",
    }
    env.pop("REDIS_URL", None)
    env["PYTHONPATH"] = str(ROOT)  # this checkout's service, whichever one the venv installed
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(
        [str(VENV_BIN / "budgetserve-serve")],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        for _ in range(1200):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    break
            except OSError:
                assert proc.poll() is None, (tmp_path / "server.log").read_text()
                time.sleep(0.05)
        big = [{"png_base64": noise_png_b64(1024, s)} for s in range(4)]
        small = [{"png_base64": png_b64(digit_image(i, 32))} for i in range(8)]
        # Warm up: one big request through, so the baseline holds what one request needs.
        status, _, _ = post_json(
            port, "/predict", {"model": "digits", "item": big[0], "budget": 3000}, timeout=120
        )
        assert status == 200
        baseline = rss_kib(proc.pid)

        big_results: list[tuple[int, dict[str, str], dict[str, Any]]] = []
        small_results: list[dict[str, Any]] = []
        stop = threading.Event()

        def big_client(k: int) -> None:
            # At least 3 each, and on until the small client has its samples under this
            # load: refused big requests come back at once, so 3 each can be over in a
            # fraction of a second, before the small client has sent 10 (seen in CI).
            j = 0
            deadline = time.monotonic() + 120
            while j < 3 or (len(small_results) < 20 and time.monotonic() < deadline):
                j += 1
                big_results.append(
                    post_json(
                        port,
                        "/predict",
                        {"model": "digits", "item": big[(k + j) % len(big)], "budget": 3000},
                        timeout=120,
                    )
                )

        def small_client() -> None:
            i = 0
            while not stop.is_set() and i < 60:
                status, _, body = post_json(
                    port,
                    "/predict",
                    # work accounting: this test is about admission; the event loop blocked
                    # by other requests' 1.4 MB bodies is charged by deadline accounting
                    # (measured there: median 7 ms of a 5 ms budget)
                    {
                        "model": "digits",
                        "item": small[i % len(small)],
                        "budget": 5,
                        "accounting": "work",
                    },
                    timeout=120,
                )
                assert status == 200, body
                small_results.append(body)
                i += 1
                time.sleep(0.02)

        bigs = [threading.Thread(target=big_client, args=(k,)) for k in range(12)]
        smalls = threading.Thread(target=small_client)
        for t in bigs:
            t.start()
        time.sleep(0.3)  # the big ones hold the thread and fill the queue
        smalls.start()
        for t in bigs:
            t.join(timeout=300)
        stop.set()
        smalls.join(timeout=300)
        peak = rss_kib(proc.pid, "VmHWM")
        metrics = post_json_metrics(port)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()

    statuses = [s for s, _, _ in big_results]
    assert len(statuses) >= 36 and set(statuses) <= {200, 503}, statuses
    refused = [(h, b) for s, h, b in big_results if s == 503]
    assert refused, "no big request was refused: the queue is not bounded"
    for headers, body in refused:
        assert headers.get("retry-after") == "1"
        assert body["error"]["type"] == "overloaded"
        assert body["error"]["details"]["retry_after_s"] == 1
    assert statuses.count(200) >= 4

    # Small requests: the service says (nearly) none waited longer than its budget, and the
    # ones that found the thread busy answered at once from what they had. The event loop
    # itself is blocked while it reads other requests' 1.4 MB bodies, which admission cannot
    # see (docs/operating.md#limits says so): on a loaded machine one small request in a run
    # was seen at 12 ms, so the bound is on the 90th percentile and a max far below the
    # 1.27 s these requests waited before the queue was bounded.
    assert len(small_results) >= 10
    queued = sorted(b["timings_ms"]["queued"] for b in small_results)
    assert queued[int(0.9 * (len(queued) - 1))] <= 5 + 2, queued
    assert queued[-1] <= 100, queued
    spent = sorted(b["cost"]["spent"] for b in small_results)
    assert spent[len(spent) // 2] <= 5, spent
    # Small requests that found the thread busy did not wait for it: they answered at once
    # from what they had, or (the process behind a standing queue, its loop blocked by the
    # big bodies) ran a plan cut to the inline size on the loop.
    unqueued = metric(metrics, 'budgetserve_admission_total{result="answered_unqueued"}')
    expired = metric(metrics, 'budgetserve_admission_total{result="wait_expired"}')
    behind = metric(metrics, 'budgetserve_admission_total{result="inline_behind"}')
    assert unqueued + expired + behind > 0
    rejected = {
        r: metric(metrics, f'budgetserve_admission_total{{result="{r}"}}')
        for r in ("queue_full", "queue_bytes")
    }
    assert rejected[bound] > 0 and sum(rejected.values()) == len(refused), rejected
    assert metric(metrics, 'budgetserve_requests_total{model="digits",status="overloaded"}') == len(
        refused
    )

    grown_mib = (peak - baseline) / 1024
    print(
        f"RSS baseline {baseline / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB, "
        f"refused {len(refused)}/36, small answered at once {unqueued + expired:.0f}"
    )
    assert grown_mib < 400, f"RSS grew {grown_mib:.0f} MiB under load (bounded queue)"


def late_prediction_parts() -> tuple[bytes, bytes]:
    """A prediction request's headers after its request line, and its body (a 32 px digit,
    50 ms budget): sent after the request line with a pause, it reaches the app late."""
    item = {"png_base64": png_b64(digit_image(4, 32)), "id": "late"}
    body = json.dumps({"model": "digits", "item": item, "budget": 50}).encode()
    head = (
        b"Host: t\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
    )
    return head, body


def test_a_prediction_the_event_loop_reaches_too_late_is_shed_cheaply(
    digits_bundle_dir: Path,
) -> None:
    """The delay between a request's first bytes and the app's first sight of it is what an
    event loop that is behind adds; here a head sent in two pieces 0.4 s apart stands in for
    it, through the real server and protocol. Over BUDGETSERVE_MAX_QUEUE_DELAY_MS the
    request is refused with 503 and Retry-After, its body still read (the connection goes
    on serving), and counted; requests that are not predictions are never shed."""
    app = create_app(Settings(models_dir=digits_bundle_dir.parent, max_queue_delay_ms=100))
    head, body = late_prediction_parts()
    with uvicorn_thread(app) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"POST /predict HTTP/1.1\r\n")
            time.sleep(0.4)
            conn.sendall(head + body)
            shed = read_one(conn)
            conn.sendall(b"POST /predict HTTP/1.1\r\n" + head + body)  # on time, same socket
            served = read_one(conn)
            conn.sendall(b"GET /heal")
            time.sleep(0.4)
            conn.sendall(b"thz HTTP/1.1\r\nHost: t\r\n\r\n")
            probe = read_one(conn)
            conn.sendall(b"POST /v2/models/digits/infer HTTP/1.1\r\n")
            time.sleep(0.4)
            conn.sendall(head + body)  # any body: it is refused before it is read as v2
            shed_v2 = read_one(conn)
        metrics = post_json_metrics(port)
    status, headers, payload = shed
    assert status == 503 and headers["retry-after"] == "1"
    error = json.loads(payload)["error"]
    assert error["type"] == "overloaded"
    assert "BUDGETSERVE_MAX_QUEUE_DELAY_MS=100" in error["message"]
    assert error["details"]["queue_delay_ms"] >= 300
    answer = json.loads(served[2])
    assert served[0] == 200 and answer["prediction"] in answer["probabilities"]
    assert probe[0] == 200
    # The Open Inference Protocol's own error shape, which its clients read.
    assert shed_v2[0] == 503 and shed_v2[1]["retry-after"] == "1"
    assert "BUDGETSERVE_MAX_QUEUE_DELAY_MS" in json.loads(shed_v2[2])["error"]
    assert metric(metrics, 'budgetserve_admission_total{result="queue_delay"}') == 2


def test_overload_refusals_have_their_own_lines_only_up_to_a_rate(
    digits_bundle_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under overload a log line per refusal takes the CPU the answers need: refusals get
    their own line up to BUDGETSERVE_LOG_REFUSALS_PER_S a second and the rest are counted in
    one line, through the real server (the refusals: heads that reach the app too late, as
    in the test above). Answers always have their line."""
    monkeypatch.setattr(requestlog, "REFUSALS", requestlog.RefusalLines(per_s=0.2))
    app = create_app(Settings(models_dir=digits_bundle_dir.parent, max_queue_delay_ms=50))
    head, body = late_prediction_parts()
    caplog.set_level(logging.INFO)
    statuses = []
    with (
        uvicorn_thread(app) as port,
        socket.create_connection(("127.0.0.1", port), timeout=30) as conn,
    ):
        for _ in range(3):
            conn.sendall(b"POST /predict HTTP/1.1\r\n")
            time.sleep(0.15)
            conn.sendall(head + body)
            statuses.append(read_one(conn)[0])
        conn.sendall(b"POST /predict HTTP/1.1\r\n" + head + body)  # on time: answered
        statuses.append(read_one(conn)[0])
        time.sleep(1.3)  # the window's count is said by the loop's timer
    lines = [r.getMessage() for r in caplog.records if r.name == "budgetserve.request"]
    assert statuses == [503, 503, 503, 200]
    refused = [line for line in lines if "status=503" in line]
    answered = [line for line in lines if "status=200" in line]
    counted = [line for line in lines if "more overload refusals" in line]
    assert len(refused) == 1 and len(answered) == 1, lines
    assert len(counted) == 1 and counted[0].startswith("2 more overload refusals"), lines
    assert "BUDGETSERVE_LOG_REFUSALS_PER_S=0.2" in counted[0]
