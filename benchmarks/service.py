"""The service under HTTP load on loopback: overhead against a bare app, the budget as a
deadline under a load ramp, and where the server's time goes (profiles).

One run starts, each in its own process on a free loopback port, with the same HTTP stack
(uvicorn with ``service.server``'s TCP_NODELAY socket and h11 protocol, uvloop):

- **budgetserve** (``python -m service``, in-process cache, the digits bundle);
- the **bare app** (:func:`bare_app`, here in the benchmark): FastAPI + ONNX Runtime, decoding
  the PNG as the service does and always answering with the ``thumbnail`` model — what a user
  would run instead for the same answer, with nothing to plan, cache or account. It also has
  ``POST /decode`` (decode only): the floor of any answer.

Load comes from :mod:`benchmarks.loadgen` in a separate process (closed loop: N clients;
open loop: a fixed arrival rate). Items are held-out digits (the bundle's own split) at
128 px, every request with a fresh id (no cache hits). Sections:

1. **Overhead**: requests/s of budgetserve (1 ms budget) and the bare app, in interleaved
   rounds (the order alternates), at 1 and 8 clients, with 1 and 2 workers; the ratio's
   min/median/max over rounds. Latency of a prior-only answer against the bare decode.
2. **Load ramp**: 1, 4, 16, 64 clients, then an open-loop rate above capacity, at budgets 2, 5
   and 20 ms, for both accountings: the fraction of answers the client saw within the budget
   (and within budget + 1 ms), accuracy on the held-out labels, throughput, refusals.
3. **Profiles**: ``py-spy`` samples the budgetserve worker under 8 clients at a 1 ms budget:
   this checkout's code and, when ``--before REF`` names a git revision, that revision's
   (the code before issue 17's changes), summarised by where the time goes.

``python -m benchmarks.service`` writes ``docs/benchmarks/service.md``;
``python -m benchmarks.service --serve-bare --port N [--workers W]`` runs the bare app.

The module stays whole (over 450 lines): the bare app, the interleaved rounds, the load ramp
and the profile summary share one process set-up, the load generator's spec, the held-out
items and one report.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import machine, measured_at, prose

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "models" / "digits"
SIDE = 128
KEEP = (
    "prediction",
    "expected_accuracy",
    "cost.spent",
    "cost.extracted",
    "timings_ms.queued",
    "timings_ms.since_received",
)


# --------------------------------------------------------------------------- the bare app


def bare_app() -> Any:
    """FastAPI + ONNX Runtime answering every ``POST /predict`` with the bundle's
    ``thumbnail`` model (decode as the service does, extract, infer), and ``POST /decode``
    (decode only). The bundle is ``BENCH_BUNDLE`` (default: the embedded digits bundle)."""
    from benchmarks.fixed_server import create_fixed_app

    bundle = Path(os.environ.get("BENCH_BUNDLE", str(BUNDLE)))
    app = create_fixed_app(bundle, "thumbnail")

    from service.bundle import read_manifest
    from service.items import make_decoder

    decoder = make_decoder(read_manifest(bundle).item, 1 << 20)

    @app.post("/decode")  # type: ignore[untyped-decorator]
    def decode(body: dict[str, Any]) -> dict[str, int]:
        return {"size": decoder.decode(body["item"]).size}

    return app


def serve_bare(port: int, workers: int) -> None:
    import uvicorn
    from uvicorn.supervisors.multiprocess import Multiprocess

    from service.server import HeadTimeoutH11Protocol, listening_socket

    sock = listening_socket("127.0.0.1", port)
    config = uvicorn.Config(
        "benchmarks.service:bare_app",
        factory=True,
        host="127.0.0.1",
        port=port,
        workers=workers,
        http=HeadTimeoutH11Protocol,
        log_level="warning",
    )
    try:
        if workers > 1:
            Multiprocess(config, sockets=[sock]).run()
        else:
            uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()


# --------------------------------------------------------------------------- processes


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    name: str
    port: int
    process: subprocess.Popen[bytes]

    def worker_pids(self) -> list[int]:
        """The processes that serve requests: the children when there are any (workers)."""
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.process.pid)],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        pids = [int(p) for p in out]
        return pids or [self.process.pid]

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a wedged server
            self.process.kill()
            self.process.wait()


def start_service(workers: int, code: Path = ROOT, **env: str) -> Server:
    port = _free_port()
    environ = dict(
        os.environ,
        BUDGETSERVE_PORT=str(port),
        BUDGETSERVE_HOST="127.0.0.1",
        BUDGETSERVE_MODELS_DIR=str(ROOT / "models"),
        BUDGETSERVE_WORKERS=str(workers),
        PYTHONPATH=str(code),
        **env,
    )
    environ.pop("REDIS_URL", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "service"],
        env=environ,
        cwd=code,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return Server(f"budgetserve ({workers}w)", port, process)


def start_bare(workers: int) -> Server:
    port = _free_port()
    environ = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.service",
            "--serve-bare",
            "--port",
            str(port),
            "--workers",
            str(workers),
        ],
        env=environ,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return Server(f"bare ({workers}w)", port, process)


def wait_ready(servers: Sequence[Server], timeout_s: float = 180.0) -> None:
    import http.client

    deadline = time.monotonic() + timeout_s
    for server in servers:
        while True:
            if server.process.poll() is not None:
                raise RuntimeError(f"{server.name} exited during start-up")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
                conn.request("GET", "/readyz")
                if conn.getresponse().status == 200:
                    conn.close()
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.name} not ready in {timeout_s:.0f} s")
            time.sleep(0.2)


# --------------------------------------------------------------------------- load


@dataclass
class Items:
    pngs: list[str]
    labels: list[int]

    def templates(self, budget: float | None, accounting: str | None = None) -> list[str]:
        out = []
        for png in self.pngs:
            body: dict[str, Any] = {"model": "digits", "item": {"id": "@ID@", "png_base64": png}}
            if budget is not None:
                body["budget"] = budget
            if accounting is not None:
                body["accounting"] = accounting
            out.append(json.dumps(body).replace("%", "%%").replace("@ID@", "%s"))
        return out


def load(
    port: int,
    *,
    templates: list[str],
    duration_s: float,
    clients: int | None = None,
    rate: float | None = None,
    path: str = "/predict",
    keep: Sequence[str] = (),
    prefix: str = "r",
) -> list[dict[str, Any]]:
    spec = {
        "port": port,
        "path": path,
        "method": "POST" if templates else "GET",
        "templates": templates,
        "duration_s": duration_s,
        "warmup_s": 0.5,
        "mode": "closed" if rate is None else "open",
        "clients": clients or 1,
        "rate": rate or 0.0,
        "keep": list(keep),
        "id_prefix": prefix,
    }
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.loadgen"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    rows: list[dict[str, Any]] = json.loads(done.stdout)
    return rows


def throughput(rows: list[dict[str, Any]], duration_s: float) -> float:
    return float(sum(r["status"] == 200 for r in rows)) / duration_s


# --------------------------------------------------------------------------- 1. overhead


def overhead(items: Items, rounds: int, duration_s: float) -> tuple[list[str], dict[str, Any]]:
    lines = [
        "| workers | clients | budgetserve req/s (rounds) | bare req/s (rounds) "
        "| ratio min / median / max |",
        "|---|---|---|---|---|",
    ]
    floor: dict[str, Any] = {}
    for workers in (1, 2):
        service, bare = start_service(workers), start_bare(workers)
        try:
            wait_ready([service, bare])
            ours = items.templates(1.0)
            theirs = items.templates(None)
            for server, t in ((service, ours), (bare, theirs)):  # warm-up
                load(server.port, templates=t, duration_s=1.0, clients=4, prefix="w")
            for clients in (1, 8):
                mine, base, ratios = [], [], []
                for k in range(rounds):
                    order = [(service, ours), (bare, theirs)]
                    if k % 2:
                        order.reverse()
                    got = {}
                    for server, t in order:
                        rows = load(
                            server.port,
                            templates=t,
                            duration_s=duration_s,
                            clients=clients,
                            prefix=f"o{workers}{clients}{k}",
                        )
                        got[server.name] = throughput(rows, duration_s)
                    mine.append(got[service.name])
                    base.append(got[bare.name])
                    ratios.append(got[service.name] / max(got[bare.name], 1e-9))
                lines.append(
                    f"| {workers} | {clients} | {' / '.join(f'{v:.0f}' for v in mine)} | "
                    f"{' / '.join(f'{v:.0f}' for v in base)} | {min(ratios):.2f} / "
                    f"{float(np.median(ratios)):.2f} / {max(ratios):.2f} |"
                )
            if workers == 1:
                prior = load(
                    service.port,
                    templates=items.templates(0.05),
                    duration_s=duration_s,
                    clients=1,
                    keep=("cost.extracted",),
                    prefix="p",
                )
                decode = load(
                    bare.port,
                    templates=items.templates(None),
                    duration_s=duration_s,
                    clients=1,
                    path="/decode",
                    prefix="d",
                )
                health = load(
                    bare.port,
                    templates=[],
                    duration_s=duration_s,
                    clients=1,
                    path="/readyz",
                    prefix="h",
                )
                floor = {
                    "prior_p50": float(np.median([r["ms"] for r in prior if r["status"] == 200])),
                    "prior_extracted": sum(bool(r.get("cost.extracted")) for r in prior),
                    "prior_n": len(prior),
                    "decode_p50": float(np.median([r["ms"] for r in decode if r["status"] == 200])),
                    "health_p50": float(np.median([r["ms"] for r in health if r["status"] == 200])),
                }
        finally:
            service.stop()
            bare.stop()
    return lines, floor


# --------------------------------------------------------------------------- 2. load ramp

RAMP = (1, 4, 16, 64)
BUDGETS = (2.0, 5.0, 20.0)


def _cell(rows: list[dict[str, Any]], items: Items, budget: float, duration_s: float) -> str:
    ok = [r for r in rows if r["status"] == 200]
    lat = np.asarray([r["ms"] for r in rows]) if rows else np.zeros(1)
    within = sum(r["status"] == 200 and r["ms"] <= budget for r in rows)
    within1 = sum(r["status"] == 200 and r["ms"] <= budget + 1.0 for r in rows)
    correct = sum(r["prediction"] == str(items.labels[r["template"]]) for r in ok)
    refused = sum(r["status"] == 503 for r in rows)
    other = len(rows) - len(ok) - refused
    n = max(len(rows), 1)
    acc = correct / len(ok) if ok else float("nan")
    # The server's own view: receipt (first bytes) to the answer's last step, 200s only.
    seen = [r["timings_ms.since_received"] for r in ok if r.get("timings_ms.since_received")]
    server = np.asarray(seen) if seen else np.full(1, np.nan)
    return (
        f"{100 * within / n:.1f} % | {100 * within1 / n:.1f} % | {acc:.3f} | "
        f"{len(ok) / duration_s:.0f} | {np.percentile(lat, 50):.1f} / "
        f"{np.percentile(lat, 99):.1f} | {np.percentile(server, 50):.1f} / "
        f"{np.percentile(server, 99):.1f} | {refused}{f' (+{other} failed)' if other else ''}"
    )


def ramp(items: Items, duration_s: float) -> tuple[list[str], dict[str, int]]:
    """The load-ramp table, and the 503s counted in closed and open loops."""
    refused = {"closed": 0, "open": 0}
    lines = [
        "| budget ms | accounting | load | within budget | within budget + 1 ms | accuracy "
        "| answers/s | client p50 / p99 ms | server p50 / p99 ms | 503 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    service = start_service(1)
    try:
        wait_ready([service])
        load(service.port, templates=items.templates(5.0), duration_s=1.0, clients=4, prefix="w")
        for budget in BUDGETS:
            for accounting in ("deadline", "work"):
                t = items.templates(budget, accounting)
                capacity = 0.0
                for clients in RAMP:
                    rows = load(
                        service.port,
                        templates=t,
                        duration_s=duration_s,
                        clients=clients,
                        keep=KEEP,
                        prefix=f"l{budget}{accounting[0]}{clients}",
                    )
                    capacity = max(capacity, throughput(rows, duration_s))
                    refused["closed"] += sum(r["status"] == 503 for r in rows)
                    cell = _cell(rows, items, budget, duration_s)
                    lines.append(f"| {budget:g} | {accounting} | {clients} clients | {cell} |")
                rate = 1.5 * capacity
                rows = load(
                    service.port,
                    templates=t,
                    duration_s=duration_s,
                    rate=rate,
                    keep=KEEP,
                    prefix=f"r{budget}{accounting[0]}",
                )
                refused["open"] += sum(r["status"] == 503 for r in rows)
                cell = _cell(rows, items, budget, duration_s)
                lines.append(f"| {budget:g} | {accounting} | open loop {rate:.0f}/s | {cell} |")
    finally:
        service.stop()
    return lines, refused


# --------------------------------------------------------------------------- 3. profiles

CATEGORIES = (
    ("HTTP parsing and protocol (uvicorn h11)", ("h11", "uvicorn/protocols")),
    ("thread hand-off (anyio to_thread)", ("to_thread", "anyio/_backends", "threading.py")),
    ("PNG decoding", ("service/items.py", "PIL/")),
    (
        "plan / extract / infer",
        ("service/execution.py", "service/strategies", "service/extractors", "onnxruntime"),
    ),
    ("JSON and validation (pydantic, json)", ("pydantic", "json/")),
    ("FastAPI / Starlette routing and middleware", ("fastapi/", "starlette/")),
    ("event loop (uvloop / asyncio)", ("uvloop", "asyncio/")),
)


def summarize(collapsed: str, top: int = 8) -> list[str]:
    """From py-spy's collapsed stacks: the share of samples per category (a sample counts
    for the innermost frame that matches a category) and the top own-time functions."""
    counts: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        weight = int(n)
        total += weight
        frames = stack.split(";")
        own[frames[-1]] += weight
        label = "other"
        for frame in reversed(frames):
            hit = next((name for name, keys in CATEGORIES if any(k in frame for k in keys)), None)
            if hit is not None:
                label = hit
                break
        counts[label] += weight
    if not total:
        return ["(no samples)"]
    lines = [f"{total} samples:", ""]
    lines += [f"- {name}: {100 * c / total:.1f} %" for name, c in counts.most_common()]
    lines += ["", "Top functions by own time:", ""]
    lines += [f"- `{f}`: {100 * c / total:.1f} %" for f, c in own.most_common(top)]
    return lines


def profile(items: Items, code: Path, duration_s: float, label: str) -> list[str]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        return [f"({label}: py-spy is not installed)"]
    service = start_service(1, code=code)
    try:
        wait_ready([service])
        t = items.templates(1.0)  # (no accounting field: the code before knows none)
        load(service.port, templates=t, duration_s=1.0, clients=4, prefix="w")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "stacks.txt"
            spying = subprocess.Popen(
                [
                    spy,
                    "record",
                    "--pid",
                    str(service.worker_pids()[0]),
                    "--duration",
                    str(int(duration_s)),
                    "--rate",
                    "250",
                    "--format",
                    "raw",
                    "--output",
                    str(out),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            rows = load(
                service.port,
                templates=t,
                duration_s=duration_s,
                clients=8,
                prefix=f"s{label}",
            )
            _, err = spying.communicate(timeout=120)
            rate = throughput(rows, duration_s)
            if not out.exists():
                return [f"({label}: py-spy failed: {err.decode(errors='replace')[-300:]})"]
            summary = summarize(out.read_text())
    finally:
        service.stop()
    return [f"**{label}** ({rate:.0f} req/s while sampled):", "", *summary]


def checkout(ref: str, into: Path) -> Path:
    """The tree of git revision ``ref`` (its ``service`` package), unpacked under ``into``."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref, "service"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    tar_path = into / "ref.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")
    return into


# --------------------------------------------------------------------------- report


def main(
    out_path: str = "docs/benchmarks/service.md",
    rounds: int = 3,
    duration_s: float = 3.0,
    ramp_s: float = 2.5,
    before: str | None = None,
) -> Path:
    from benchmarks.fixed_server import held_out_items, render_pngs

    started = time.perf_counter()
    indices, labels = held_out_items(50, BUNDLE)
    items = Items(render_pngs(indices, SIDE), [int(v) for v in labels])
    profiles: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        if before:
            profiles += profile(items, checkout(before, Path(tmp)), 5.0, f"before ({before})")
            profiles.append("")
        profiles += profile(items, ROOT, 5.0, "after (this checkout)")
    table, floor = overhead(items, rounds, duration_s)
    ramp_lines, refused = ramp(items, ramp_s)
    elapsed = time.perf_counter() - started
    lines = prose(
        "service",
        measured_at=measured_at(),
        machine=machine(),
        rounds=rounds,
        duration=f"{duration_s:g}",
        minutes=f"{elapsed / 60:.1f}",
        load=os.getloadavg()[0],
    )
    lines += table
    lines += prose(
        "service",
        "floor",
        prior_p50=f"{floor['prior_p50']:.2f}",
        prior_extracted=floor["prior_extracted"],
        prior_n=floor["prior_n"],
        decode_p50=f"{floor['decode_p50']:.2f}",
        health_p50=f"{floor['health_p50']:.2f}",
        gap=f"{floor['prior_p50'] - floor['decode_p50']:.2f}",
        ramp_s=f"{ramp_s:g}",
    )
    lines += ramp_lines
    lines += prose("service", "profiles")
    lines += profiles
    lines += prose(
        "service", "notes", refused_closed=refused["closed"], refused_open=refused["open"]
    )
    path = ROOT / out_path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--serve-bare", action="store_true", help="run the bare app")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per overhead cell")
    parser.add_argument("--ramp-duration", type=float, default=2.5, help="seconds per ramp cell")
    parser.add_argument("--before", help="git revision whose service to profile as 'before'")
    parser.add_argument("--out", default="docs/benchmarks/service.md")
    args = parser.parse_args()
    if args.serve_bare:
        serve_bare(args.port, args.workers)
    else:
        print(main(args.out, args.rounds, args.duration, args.ramp_duration, args.before))
