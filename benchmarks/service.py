"""Service overhead under real HTTP load on loopback.

Starts ``budgetserve-serve`` (uvicorn, one worker, in-process cache) on a free port with the
digits bundle, sends requests from a client in this process, and reports per request:
latency seen by the client, the extraction time the service reports, and their difference
(the service's added latency: HTTP, JSON, decoding, planning, cache, inference).
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks.report import machine, measured_at, prose

ROOT = Path(__file__).resolve().parents[1]


def _png_b64(image: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.clip(image * 255 + 0.5, 0, 255).astype(np.uint8), mode="L").save(
        buf, format="PNG"
    )
    return base64.b64encode(buf.getvalue()).decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Series:
    label: str
    latency_ms: list[float]
    extraction_ms: list[float]
    spent_ms: list[float]
    overruns: int
    errors: int

    def overhead(self) -> np.ndarray:
        diff: np.ndarray = np.asarray(self.latency_ms) - np.asarray(self.extraction_ms)
        return diff


class _Client:
    """One keep-alive HTTP/1.1 connection per thread (``http.client``: a lean client, so
    the numbers are the server's, not the client library's)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            self._local.conn = conn
        return conn

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        conn = self._conn()
        headers = {"content-type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()


def _run(client: _Client, bodies: Sequence[bytes], label: str, concurrency: int) -> Series:
    def one(body: bytes) -> tuple[float, float, float, bool, bool]:
        t0 = time.perf_counter()
        status, raw = client.request("POST", "/predict", body)
        latency = (time.perf_counter() - t0) * 1000.0
        if status != 200:
            return latency, 0.0, 0.0, False, True
        answer = json.loads(raw)
        cost, extraction = answer["cost"], answer["timings_ms"]["extraction"]
        return latency, extraction, cost["spent"], cost["spent"] > cost["budget"], False

    if concurrency == 1:
        results = [one(b) for b in bodies]
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, bodies))
    return Series(
        label=label,
        latency_ms=[r[0] for r in results if not r[4]],
        extraction_ms=[r[1] for r in results if not r[4]],
        spent_ms=[r[2] for r in results if not r[4]],
        overruns=sum(r[3] for r in results),
        errors=sum(r[4] for r in results),
    )


def _floor(client: _Client, count: int) -> list[float]:
    """Latency of ``GET /healthz``: the HTTP framework's own per-request cost."""
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        client.request("GET", "/healthz")
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def main(out_path: str = "docs/benchmarks/service.md", requests: int = 500) -> Path:
    from sklearn.datasets import load_digits

    from training.data.digits import render_digit

    port = _free_port()
    env = dict(
        os.environ,
        BUDGETSERVE_PORT=str(port),
        BUDGETSERVE_HOST="127.0.0.1",
        BUDGETSERVE_MODELS_DIR=str(ROOT / "models"),
    )
    env.pop("REDIS_URL", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "service"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = _Client(port)
        for _ in range(200):
            try:
                if client.request("GET", "/readyz")[0] == 200:
                    break
            except OSError:
                client = _Client(port)
            time.sleep(0.1)
        else:
            raise RuntimeError("service did not become ready")
        digits = load_digits().images
        rng = np.random.default_rng(0)
        pngs = {
            side: [
                _png_b64(render_digit(np.asarray(digits[i], float), side, rng)) for i in range(50)
            ]
            for side in (32, 128)
        }
        scenarios: list[tuple[str, int, float, bool, int]] = [
            ("32 px, budget 1 ms, uncached", 32, 1.0, False, 1),
            ("32 px, budget 20 ms, uncached", 32, 20.0, False, 1),
            ("128 px, budget 20 ms, uncached", 128, 20.0, False, 1),
            ("128 px, budget 20 ms, cached", 128, 20.0, True, 1),
            ("128 px, budget 20 ms, uncached, 4 concurrent", 128, 20.0, False, 4),
        ]
        _floor(client, 50)
        floor = _floor(client, requests)
        series = []
        for k, (label, side, budget, cached, conc) in enumerate(scenarios):
            bodies: list[bytes] = []
            for i in range(requests):
                png = pngs[side][i % len(pngs[side])]
                item_id = f"s{k}-{i % 50}" if cached else f"s{k}-{i}"
                bodies.append(
                    json.dumps(
                        {
                            "model": "digits",
                            "budget": budget,
                            "item": {"id": item_id, "png_base64": png},
                        }
                    ).encode()
                )
            _run(client, bodies[:50], label, conc)  # warm-up (also fills the cache)
            series.append(_run(client, bodies[50:] + bodies[:50], label, conc))
    finally:
        server.terminate()
        server.wait(timeout=30)

    lines = prose(
        "service",
        measured_at=measured_at(),
        machine=machine(),
        requests=requests,
        floor_p50=f"{np.percentile(floor, 50):.2f}",
        floor_p99=f"{np.percentile(floor, 99):.2f}",
    )
    lines += [
        "| scenario | latency p50 ms | latency p99 ms | extraction p50 ms | overhead p50 ms "
        "| overhead p99 ms | spent − extraction p50 ms | spent > budget | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in series:
        lat, ext, ovh = np.asarray(s.latency_ms), np.asarray(s.extraction_ms), s.overhead()
        lines.append(
            f"| {s.label} | {np.percentile(lat, 50):.2f} | {np.percentile(lat, 99):.2f} | "
            f"{np.percentile(ext, 50):.2f} | {np.percentile(ovh, 50):.2f} | "
            f"{np.percentile(ovh, 99):.2f} | "
            f"{np.percentile(np.asarray(s.spent_ms) - ext, 50):.2f} | "
            f"{s.overruns}/{len(lat)} | {s.errors} |"
        )
    lines += prose("service", "notes")
    path = ROOT / out_path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


if __name__ == "__main__":
    print(main())
