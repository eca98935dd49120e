"""An outside probe of a real ``budgetserve-serve`` (issue 27's, at a smaller scale).

    nice -n 10 .venv/bin/python scripts/probe_reliability.py [--seed 27] [--fuzz 1500]

What it starts, all on loopback: a real redis-server (the feature cache, and the feature
store one sensor reads), a stub HTTP upstream (rows, a source that drips its answer a byte
every 0.15 s, one that never answers, a redirect to an internal path, a 500), and
``budgetserve-serve`` with 2 workers, serving the shipped digits bundle and a small DAG
bundle (the router problem of the tests, built here) whose three sensors are read from
Redis, the fast upstream and the dripping one. Then, phase by phase:

1. fuzzing ``POST /predict`` (single and batch), the v2 infer route and the admin API with
   seeded malformed requests (types, NaN and huge numbers, bad base64 and PNG headers,
   control characters and NUL in names and ids, nesting, wrong content types, cap-breaking
   batches) — every answer is classified, and a 5xx or a connection without an answer is a
   finding;
2. model management under it: a bundle with NaN weights, a 24 MiB manifest and a symlink
   loop copied in (the watcher polls every second), then ``POST /-/reload``: the old
   versions must keep serving;
3. the slow source: tabular requests that need the dripping sensor, timed by the client,
   until its circuit breaker opens and while it is open, then the hung source the same way;
4. memory: 8 concurrent batches of 60 compressible 1024² PNGs; the RSS of every process of
   the server is sampled every 50 ms, against ``BUDGETSERVE_MAX_QUEUED_BYTES`` (64 MiB here);
5. SIGTERM under overload: 120 client threads, then SIGTERM to the server: every request
   sent must get an answer (a refused connection is an answer: nothing was sent).

It prints one JSON report (and writes it with ``--out``). Exit status 1 if any 5xx or any
request without an answer was seen.

Why one file over 450 lines: it is one script run from outside, whose phases share the
processes it starts (Redis, the upstream, the service) and the client that keeps their counts.
"""

from __future__ import annotations

import argparse
import base64
import collections
import http.client
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SERVE = Path(sys.executable).with_name("budgetserve-serve")
ROUTER_COLUMNS = ["r", "a1", "a2", "b1", "b2"]
TOKEN = "probe-token"
MAX_QUEUED_BYTES = 64 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def png_b64(image: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.clip(image * 255.0 + 0.5, 0, 255).astype(np.uint8), mode="L").save(
        buf, format="PNG"
    )
    return base64.b64encode(buf.getvalue()).decode()


SMALL_PNG = png_b64(np.random.default_rng(0).random((64, 64)))


# --- the stub upstream ----------------------------------------------------------------------


class Upstream(BaseHTTPRequestHandler):
    """/rows/<id>: the row; /drip/<id>: the row a byte every 0.15 s; /hang/<id>: nothing for
    30 s; /redirect/<id>: 302 to /internal; /internal: a value nobody should see; else 500."""

    rows: ClassVar[dict[str, dict[str, float]]] = {}
    calls: ClassVar[collections.Counter[str]] = collections.Counter()
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        kind, _, rest = self.path.strip("/").partition("/")
        self.calls[kind] += 1
        item_id = rest.partition("?")[0]
        if kind == "hang":
            time.sleep(30)
            return
        if kind == "redirect":
            self._send(302, b"", {"Location": "/internal/x"})
            return
        if kind == "internal":
            self._send(200, json.dumps({c: 999.0 for c in ROUTER_COLUMNS}).encode())
            return
        row = self.rows.get(item_id)
        if kind not in ("rows", "drip") or row is None:
            self._send(500 if kind not in ("rows", "drip") else 404, b"{}")
            return
        body = json.dumps(row).encode()
        if kind == "rows":
            self._send(200, body)
            return
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for byte in body:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.15)
        except OSError:
            return

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            return

    def log_message(self, format: str, *args: Any) -> None:
        return None


# --- the server and what it holds -----------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    out = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for child in map(int, children):
        out += process_tree(child)
    return out


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


class RssSampler:
    """The RSS of each process of the server's tree, every 50 ms: the peak per process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak: dict[int, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            for pid in process_tree(self.pid):
                self.peak[pid] = max(self.peak.get(pid, 0.0), rss_mib(pid))

    def __enter__(self) -> RssSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def build_router(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    from training.bundles.dag import DagSpec, build_dag_bundle
    from training.data.synthetic import make_router_data

    spec = DagSpec(
        name="router",
        label="label",
        sensors={"r": ["r"], "a": ["a1", "a2"], "b": ["b1", "b2"]},
        costs={"r": 1.0, "a": 5.0, "b": 5.0},
        cost_scales=[0.0, 0.03, 0.3],
    )
    x, y = make_router_data(2500, seed=2)
    build_dag_bundle(folder, spec, x, y.astype(str), ROUTER_COLUMNS)
    return x, y


# --- requests -------------------------------------------------------------------------------


class Client:
    """Counts every answer by status, and every request that got none."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.statuses: collections.Counter[str] = collections.Counter()
        self.no_answer: list[str] = []
        self.server_errors: list[str] = []
        self.lock = threading.Lock()

    def send(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        what: str = "",
        timeout: float = 60,
    ) -> tuple[int, bytes] | None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        sent = False
        try:
            conn.putrequest(method, path, skip_accept_encoding=True)
            for k, v in {"Content-Length": str(len(body or b"")), **(headers or {})}.items():
                conn.putheader(k, v)
            conn.endheaders(body)
            sent = True
            response = conn.getresponse()
            payload = response.read()
        except ConnectionRefusedError:
            with self.lock:
                self.statuses["refused"] += 1
            return None
        except (OSError, http.client.HTTPException) as exc:
            with self.lock:
                if sent:
                    self.no_answer.append(f"{what or path}: {type(exc).__name__}: {exc}")
                else:
                    self.statuses[f"not sent: {type(exc).__name__}"] += 1
            return None
        finally:
            conn.close()
        with self.lock:
            self.statuses[str(response.status)] += 1
            if response.status >= 500 and response.status != 503:
                self.server_errors.append(f"{response.status} {what or path}: {payload[:300]!r}")
        return response.status, payload

    def post_json(self, path: str, body: Any, what: str = "", **kw: Any) -> tuple[int, Any]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        answer = self.send(
            "POST", path, raw, {"Content-Type": "application/json", **kw}, what or path
        )
        if answer is None:
            return 0, None
        status, payload = answer
        try:
            return status, json.loads(payload)
        except ValueError:
            return status, payload


NASTY = ["\x00", "a\nb", "..", "../../etc", "%2e%2e", "x" * 300, "é\u2028", "", " ", "$(id)"]


def fuzz_bodies(
    rng: random.Random, image: str, row: dict[str, float]
) -> Iterator[tuple[str, bytes, str]]:
    """(path, raw body, content type) of malformed or odd requests, forever."""
    numbers: list[Any] = [0, -1, 1e308, -1e-300, "5", True, None, [1], {"a": 1}, 10**30]
    raw_numbers = ["NaN", "Infinity", "-Infinity", "1" * 5000, "1e999"]
    items: list[Any] = [
        {"png_base64": image},
        {"png_base64": "!!!"},
        {"png_base64": base64.b64encode(b"\xff\xd8\xff\xe0JFIF").decode()},
        {
            "png_base64": base64.b64encode(
                b"\x89PNG\r\n\x1a\n" + b"\x00" * 8 + b"IHDR" + (100000).to_bytes(4, "big") * 2
            ).decode()
        },
        {"values": row},
        {"values": {"r": "high"}},
        {"values": {"zz": 1.0}},
        {"id": rng.choice(NASTY) or "x"},
        {"id": "ok", "values": {"r": 1e39}},
        [],
        "item",
        {"png_base64": image, "id": "\x00"},
    ]
    while True:
        kind = rng.randrange(9)
        model = rng.choice(["digits", "router", "digits", "router", *NASTY])
        if kind == 0:  # a single prediction, one field odd
            body: dict[str, Any] = {"model": model, "item": rng.choice(items), "budget": 5.0}
            field = rng.choice(["budget", "size", "strategy", "version", "accounting", "extra"])
            body[field] = rng.choice(numbers + NASTY)
            yield "/predict", json.dumps(body).encode(), "application/json"
        elif kind == 1:  # raw numbers JSON cannot carry
            text = (
                f'{{"model": "digits", "item": {json.dumps(rng.choice(items))}, '
                f'"budget": {rng.choice(raw_numbers)}}}'
            )
            yield "/predict", text.encode(), "application/json"
        elif kind == 2:  # batches
            n = rng.choice([0, 1, 3, 129])
            batch: dict[str, Any] = {"model": model, "items": [rng.choice(items)] * n}
            choice = rng.randrange(4)
            if choice in (0, 2):
                batch["budget"] = rng.choice([1.0, 9000.0, -1.0])
            if choice in (1, 2):
                batch["total_budget"] = rng.choice([5.0, 1e9])
            yield "/predict", json.dumps(batch).encode(), "application/json"
        elif kind == 3:  # bodies that are not JSON, or not an object
            raw = rng.choice(
                [b"", b"{", b"[]", b"null", b"\xff\xfe", b"[" * 5000 + b"]" * 5000, b'"x"']
            )
            yield "/predict", raw, rng.choice(["application/json", "text/plain", ""])
        elif kind in (4, 5):  # v2
            name = rng.choice(["digits", "router", *NASTY])
            inputs: list[dict[str, Any]] = []
            if rng.random() < 0.5:
                inputs.append(
                    {
                        "name": rng.choice(["VALUES", "IMAGE", "r", "ID", "zz"]),
                        "datatype": rng.choice(["FP32", "BYTES", "INT8", "BOOL", "FP99"]),
                        "shape": rng.choice([[1, 2], [1], [2, 5], [-1], [0], [1, 1000000]]),
                        "parameters": {"columns": rng.choice(["r,r", "r", "r,a1", "", "zz"])},
                        "data": rng.choice([[0.5, 0.1], ["x"], [image], [], [1e39, -1], [[1]]]),
                    }
                )
            if rng.random() < 0.5:
                inputs.append(
                    {"name": "ID", "datatype": "BYTES", "shape": [1], "data": [rng.choice(NASTY)]}
                )
            params = rng.choice([{"budget": 6.0}, {"total_budget": 6.0}, {}, {"budget": "x"}])
            yield (
                f"/v2/models/{quote(name)}/infer",
                json.dumps({"inputs": inputs, "parameters": params}).encode(),
                "application/json",
            )
        elif kind == 6:  # an id that tries to leave its path segment
            item_id = rng.choice([*NASTY, "a/../../internal", "x?y#z", "%00", ".", "\\..\\"])
            body = {"model": "router", "item": {"id": item_id or "z"}, "budget": 6.0}
            yield "/predict", json.dumps(body).encode(), "application/json"
        else:  # GET routes with odd names
            yield f"/models/{quote(model)}/skyline?size={rng.choice(['-1', 'x', '1e99'])}", b"", ""


def quote(text: str) -> str:
    from urllib.parse import quote as q

    return q(text, safe="")


# --- the phases -----------------------------------------------------------------------------


def phase_fuzz(
    client: Client, n: int, seed: int, image: str, row: dict[str, float]
) -> dict[str, Any]:
    rng = random.Random(seed)
    bodies = fuzz_bodies(rng, image, row)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    before = sum(client.statuses.values())

    def worker(k: int) -> None:
        for i in range(k, n, 4):
            path, raw, ctype = next(bodies)
            headers = {"Content-Type": ctype} if ctype else {}
            method = "GET" if path.startswith("/models/") else "POST"
            client.send(method, path, raw if method == "POST" else None, headers, f"fuzz {i}")
            if i % 25 == 0:  # the admin API with odd names, with and without the token
                # (names no folder has: a full reload's memory is phase 2's business)
                name = quote(rng.choice(NASTY) or "x")
                client.send("POST", f"/models/{name}/reload", b"", auth, "admin reload")
                client.send("DELETE", f"/models/{quote(rng.choice(NASTY) or 'y')}", None, auth)
                wrong = rng.choice([{}, {"Authorization": "Bearer wrong"}])
                client.send("POST", "/-/reload", b"", wrong, "admin all")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"requests": sum(client.statuses.values()) - before}


def phase_management(client: Client, models: Path) -> dict[str, Any]:
    """A new version of digits2 with NaN weights, a huge manifest and a symlink loop copied
    in (the watcher reloads every second), then POST /-/reload: digits2's old version keeps
    serving, the others are refused with their reason."""
    import onnx

    out: dict[str, Any] = {}
    folder = models / "digits2"
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["version"] = "nan-weights"
    for file in folder.glob("*.onnx"):
        graph = onnx.load(file)
        for node in graph.graph.node:
            for attr in node.attribute:
                if attr.name == "coefficients":
                    attr.floats[:] = [float("nan")] * len(attr.floats)
        onnx.save(graph, file)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    huge = models / "huge"
    shutil.copytree(ROOT / "models" / "digits", huge)
    text = (huge / "manifest.json").read_text().replace('"name": "digits"', '"name": "huge"')
    (huge / "manifest.json").write_text(text[:-1] + " " * (24 << 20) + text[-1])
    (models / "router" / "loop1").symlink_to(".", target_is_directory=True)
    (models / "router" / "loop2").symlink_to("..", target_is_directory=True)
    time.sleep(3)  # the watcher (every 1 s) sees all three
    status, report = client.post_json("/-/reload", b"", Authorization=f"Bearer {TOKEN}")
    out["reload_status"] = status
    if isinstance(report, dict):
        out["failed"] = {
            f["folder"]: {"serving": f["serving"], "error": f["error"][:140]}
            for f in report.get("failed", [])
        }
    status, body = client.post_json(
        "/predict", {"model": "digits2", "item": {"png_base64": SMALL_PNG}, "budget": 5.0}
    )
    out["digits2_after"] = {"status": status, "version": (body or {}).get("model_version")}
    status, body = client.post_json(
        "/predict", {"model": "router", "item": {"values": {"r": 0.5}}, "budget": 6.0}
    )
    out["router_after"] = status
    return out


def phase_slow_source(client: Client, x: np.ndarray, kind: str, n: int) -> dict[str, Any]:
    """Requests that need sensor b, read from the dripping (or hung) upstream."""
    latencies: list[float] = []
    reasons: collections.Counter[str] = collections.Counter()
    to_b = [i for i, row in enumerate(x) if row[0] <= 0]
    calls_before = Upstream.calls[kind]
    for i in to_b[:n]:
        t0 = time.perf_counter()
        status, body = client.post_json(
            "/predict", {"model": "router", "item": {"id": f"{kind}-{i}"}, "budget": 6.0}
        )
        latencies.append((time.perf_counter() - t0) * 1000.0)
        if status == 200 and isinstance(body, dict):
            reason = body["unavailable"].get("b", "b available (cached or acquired)")
            reasons[reason.split(":")[0]] += 1
    lat = np.asarray(latencies)
    return {
        "requests": len(latencies),
        "client_ms_p50": round(float(np.median(lat)), 1),
        "client_ms_max": round(float(lat.max()), 1),
        "upstream_calls": Upstream.calls[kind] - calls_before,
        "reasons": dict(reasons),
    }


def phase_batches(client: Client, sampler: RssSampler) -> dict[str, Any]:
    squares = []
    for i in range(60):
        img = np.zeros((1024, 1024))
        img[8 * i : 8 * i + 200, 300:500] = 1.0
        squares.append(png_b64(img))
    body = json.dumps(
        {"model": "digits", "items": [{"png_base64": p} for p in squares], "budget": 1.0}
    ).encode()
    results: list[int] = []
    refusals: list[str] = []
    baseline = dict(sampler.peak)

    def one() -> None:
        status, answer = client.post_json("/predict", body, what="batch of 60 1024²")
        results.append(status)
        if status != 200 and isinstance(answer, dict):
            refusals.append(answer["error"]["message"][:120])

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "body_bytes": len(body),
        "statuses": dict(collections.Counter(results)),
        "refusals": refusals,
        "rss_before_mib": {p: round(v) for p, v in baseline.items()},
    }


def phase_sigterm(client: Client, proc: subprocess.Popen[bytes], image: str) -> dict[str, Any]:
    body = json.dumps({"model": "digits", "item": {"png_base64": image}, "budget": 20.0}).encode()
    stop = threading.Event()
    before = len(client.no_answer)

    def hammer() -> None:
        while not stop.is_set():
            if (
                client.send(
                    "POST", "/predict", body, {"Content-Type": "application/json"}, "under SIGTERM"
                )
                is None
                and client.statuses["refused"]
            ):
                time.sleep(0.05)

    threads = [threading.Thread(target=hammer) for _ in range(120)]
    for t in threads:
        t.start()
    time.sleep(3.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    stopped_s = time.monotonic() - t0
    stop.set()
    for t in threads:
        t.join()
    return {
        "exit": code,
        "stop_s": round(stopped_s, 2),
        "no_answer": len(client.no_answer) - before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--fuzz", type=int, default=1500, help="malformed requests to send")
    parser.add_argument("--out", type=Path, help="write the JSON report here too")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="probe-"))
    models = work / "models"
    models.mkdir()
    shutil.copytree(ROOT / "models" / "digits", models / "digits")
    shutil.copytree(ROOT / "models" / "digits", models / "digits2")
    second = json.loads((models / "digits2" / "manifest.json").read_text())
    (models / "digits2" / "manifest.json").write_text(json.dumps({**second, "name": "digits2"}))
    x, _ = build_router(models / "router")
    Upstream.rows = {
        f"{kind}-{i}": dict(zip(ROUTER_COLUMNS, map(float, row), strict=True))
        for i, row in enumerate(x)
        for kind in ("drip", "hang")
    }
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    upstream.daemon_threads = True
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    up = f"http://127.0.0.1:{upstream.server_address[1]}"
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}
    sys.path.insert(0, str(ROOT))  # the checkout's benchmarks package (not installed)
    from benchmarks.served import redis_server

    with redis_server() as redis_url:
        import redis

        store = redis.Redis.from_url(redis_url)
        for i, row in enumerate(x):
            for kind in ("drip", "hang"):
                store.hset(f"row:{kind}-{i}", mapping={"r": repr(float(row[0]))})
        port = free_port()

        def sources(b_kind: str) -> str:
            return json.dumps(
                {
                    "router": {
                        "r": {"plugin": "redis_hash", "url": redis_url, "key": "row:{id}"},
                        "a": {"plugin": "http", "url": up + "/rows/{id}", "timeout_ms": 1000},
                        "b": {
                            "plugin": "http",
                            "url": up + f"/{b_kind}/{{id}}",
                            "timeout_ms": 300,
                            "failures": 3,
                            "retry_s": 2,
                        },
                    }
                }
            )

        def start(b_kind: str) -> subprocess.Popen[bytes]:
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("BUDGETSERVE_")},
                "PYTHONPATH": str(ROOT),
                "REDIS_URL": redis_url,
                "BUDGETSERVE_MODELS_DIR": str(models),
                "BUDGETSERVE_PORT": str(port),
                "BUDGETSERVE_WORKERS": "2",
                "BUDGETSERVE_ADMIN_TOKEN": TOKEN,
                "BUDGETSERVE_WATCH_INTERVAL_S": "1",
                "BUDGETSERVE_MAX_QUEUED_BYTES": str(MAX_QUEUED_BYTES),
                "BUDGETSERVE_MAX_BODY_BYTES": str(8 << 20),
                "BUDGETSERVE_SENSOR_SOURCES": sources(b_kind),
            }
            log = (work / f"serve-{b_kind}.log").open("ab")
            proc = subprocess.Popen([str(SERVE)], env=env, stdout=log, stderr=subprocess.STDOUT)
            client = Client(port)
            for _ in range(600):
                answer = client.send("GET", "/readyz")
                if answer is not None and answer[0] == 200:
                    return proc
                time.sleep(0.1)
            raise RuntimeError("the server did not become ready")

        image = SMALL_PNG
        row = dict(zip(ROUTER_COLUMNS, map(float, x[0]), strict=True))
        proc = start("drip")
        client = Client(port)
        with RssSampler(proc.pid) as sampler:
            t0 = time.monotonic()
            report["fuzz"] = phase_fuzz(client, args.fuzz, args.seed, image, row)
            report["fuzz"]["seconds"] = round(time.monotonic() - t0, 1)
            phases = report["rss_peak_mib_after"] = {}
            phases["fuzz"] = {p: round(v) for p, v in sampler.peak.items()}
            report["management"] = phase_management(client, models)
            phases["management"] = {p: round(v) for p, v in sampler.peak.items()}
            report["slow_source_drip"] = phase_slow_source(client, x, "drip", 12)
            time.sleep(2.2)  # the breaker's retry_s: one probe, then open again
            report["slow_source_drip_after_retry"] = phase_slow_source(client, x[200:], "drip", 4)
            idle = {p: round(v) for p, v in sampler.peak.items()}
            report["batches"] = phase_batches(client, sampler)
            report["batches"]["rss_idle_peak_mib"] = idle
            report["rss_peak_mib"] = {p: round(v) for p, v in sampler.peak.items()}
            report["sigterm"] = phase_sigterm(client, proc, image)
        proc = start("hang")
        hung = Client(port)
        report["hung_source"] = phase_slow_source(hung, x, "hang", 10)
        proc.send_signal(signal.SIGTERM)
        report["hung_sigterm_exit"] = proc.wait(60)
        client.no_answer += hung.no_answer
        client.server_errors += hung.server_errors
        client.statuses.update(hung.statuses)
    upstream.shutdown()
    report["statuses"] = dict(sorted(client.statuses.items()))
    report["5xx_not_503"] = client.server_errors[:20]
    report["5xx_count"] = len(client.server_errors)
    report["no_answer"] = client.no_answer[:20]
    report["no_answer_count"] = len(client.no_answer)
    report["limits"] = {"max_queued_bytes_mib": MAX_QUEUED_BYTES >> 20, "workers": 2}
    report["logs"] = str(work)
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    sys.exit(1 if client.server_errors or client.no_answer else 0)


if __name__ == "__main__":
    main()
