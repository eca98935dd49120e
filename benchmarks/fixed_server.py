"""budgetserve against the servers a user would run instead: one fixed feature set, always.

For the embedded digits bundle at sides 32, 128 and 512, one run starts, each in its own
uvicorn process on a free loopback port:

- **budgetserve**: the real app (``python -m service``, default strategy, in-process cache),
  asked at a grid of budgets;
- one **fixed** server per feature set worth serving (:func:`fixed_model_ids`: the default
  strategy's candidates, the best single feature and the full set): :func:`create_fixed_app`,
  the same HTTP stack (FastAPI on uvicorn with the service's socket and httptools protocol, and
  its process settings: one BLAS thread, the allocator's kept memory) and the same PNG
  decoding (:class:`service.items.ImageDecoder`), no planning and no cache: it always extracts
  that model's features with the bundle's extractor plugins and runs its ONNX model.

Requests are interleaved (item by item, every (server, budget) cell in a rotating order), one at
a time, so every cell sees the same machine. Items are held-out digits only
(:func:`training.evaluate.digit_split`), each request with a fresh id so the cache never helps.
The report also holds the calibration table: a(F) from the manifest against the accuracy each
exported model serves on held-out digits per side (:func:`calibration_table`).

``python -m benchmarks.fixed_server`` writes ``docs/benchmarks/fixed_server.md`` and
``fixed_server.png``; ``python -m benchmarks.fixed_server --serve MODEL_ID --port N`` runs
one fixed server (what the benchmark starts).

The module stays whole (over 450 lines): the fixed servers, the interleaved client schedule
and the report are one experiment whose parts share its request and result types; split,
each part would import the others.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from benchmarks.report import machine, measured_at, prose, wilson

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "models" / "digits"
SIDES = (32, 128, 512)
BUDGETS = (1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 200.0)
CALIBRATION_SIDES = (16, 64, 128, 256)
#: A fixed server nobody would pick alone but the best single feature (greedy's first).
EXTRA_FIXED = ("hog",)
BUDGETSERVE = "budgetserve"


# --------------------------------------------------------------------------- fixed server


class FixedRequest(BaseModel):
    """The same body budgetserve takes; a fixed server reads only ``item``."""

    model_config = ConfigDict(extra="ignore")
    item: Any


def create_fixed_app(bundle_dir: Path, model_id: str, max_pixels: int = 1 << 20) -> Any:
    """A FastAPI app that answers every ``POST /predict`` with ``model_id``'s model of the
    bundle in ``bundle_dir``: decode the PNG as the service does, extract exactly that
    model's features with the bundle's extractor plugins, run its ONNX model. No planning,
    no budget, no cache. The response names the extractors that ran (``extracted``)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from service.bundle import read_manifest
    from service.errors import BudgetServeError
    from service.extractors.base import create_extractor
    from service.inference import LoadedModel
    from service.items import make_decoder

    manifest = read_manifest(bundle_dir)
    specs = {m.id: m for m in manifest.models}
    if model_id not in specs:
        raise KeyError(
            f"bundle {manifest.name!r} has no model {model_id!r}; it has {sorted(specs)}"
        )
    spec = specs[model_id]
    by_name = {e.name: e for e in manifest.extractors}
    extractors = {
        f: create_extractor(by_name[f].entry_point, by_name[f].version, by_name[f].params)
        for f in spec.features
    }
    model = LoadedModel(spec, bundle_dir, len(manifest.classes))
    decoder = make_decoder(manifest.item, max_pixels)
    classes = manifest.classes
    blank = np.zeros((32, 32), dtype=np.float32)
    model.predict_proba(
        {f: np.asarray(e.extract(blank), np.float32) for f, e in extractors.items()}
    )  # warm-up, as the registry does

    app = FastAPI(title=f"fixed {model_id}")

    @app.exception_handler(BudgetServeError)
    async def _error(request: Any, exc: BudgetServeError) -> JSONResponse:
        return JSONResponse({"error": {"type": exc.code, "message": exc.message}}, status_code=422)

    @app.post("/predict")
    def predict(body: FixedRequest) -> dict[str, Any]:
        item = decoder.decode(body.item)
        features = {
            f: np.asarray(e.extract(item.data), dtype=np.float32) for f, e in extractors.items()
        }
        proba = model.predict_proba(features)
        return {
            "prediction": classes[int(np.argmax(proba))],
            "answered_by": model_id,
            "features": list(spec.features),
            "extracted": sorted(features),
        }

    @app.get("/readyz")
    def readyz() -> dict[str, bool]:
        return {"ready": True}

    return app


def serve_fixed(bundle_dir: Path, model_id: str, port: int, host: str = "127.0.0.1") -> None:
    """Run :func:`create_fixed_app` under uvicorn as ``python -m service`` runs budgetserve
    (its TCP_NODELAY socket and uvicorn options, one worker, and its process settings: BLAS
    on one thread, the allocator keeping freed memory, ``service.allocator``)."""
    import uvicorn

    from service.allocator import keep_freed_memory
    from service.inference import limit_blas_threads
    from service.server import listening_socket, uvicorn_options

    limit_blas_threads()
    keep_freed_memory()
    sock = listening_socket(host, port)
    config = uvicorn.Config(
        create_fixed_app(bundle_dir, model_id),
        host=host,
        port=port,
        log_level="warning",
        **uvicorn_options(),
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()


def fixed_model_ids(manifest: Any, extra: Sequence[str] = EXTRA_FIXED) -> list[str]:
    """Feature sets worth serving alone: the default strategy's candidates (the prior aside),
    ``extra`` and the full set, in order of cost at the bundle's largest profiled size."""
    strategy = next(s for s in manifest.strategies if s.name == manifest.default_strategy)
    ids = [c for c in getattr(strategy, "candidates", []) if c != "prior"]
    full = "+".join(sorted(e.name for e in manifest.extractors))
    known = {m.id for m in manifest.models}
    ids += [m for m in (*extra, full) if m in known]
    costs = {e.name: e.cost for e in manifest.extractors}
    size = 512.0 * 512.0

    def cost(model_id: str) -> float:
        return float(sum(costs[f](size) for f in manifest.model(model_id).features))

    return sorted(dict.fromkeys(ids), key=cost)


# --------------------------------------------------------------------------- processes


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """One server process on a loopback port, with one keep-alive connection to it."""

    name: str
    port: int
    process: subprocess.Popen[bytes]
    conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """One request on the kept-alive connection. A connection the server closed while it
        sat idle (uvicorn's keep-alive timeout, 5 s: a rotation of slow cells at 512 px
        takes longer) is opened again and the request sent once more, as HTTP clients do
        with a stale pooled connection; before, those requests counted as errors."""
        reused = self.conn is not None
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = {"content-type": "application/json"} if body is not None else {}
        try:
            self.conn.request(method, path, body=body, headers=headers)
            response = self.conn.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException) as exc:
            self.conn.close()
            self.conn = None
            stale = isinstance(
                exc, http.client.RemoteDisconnected | ConnectionResetError | BrokenPipeError
            )
            if reused and stale:
                return self.request(method, path, body)
            raise

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a wedged server
            self.process.kill()
            self.process.wait()


def start_budgetserve(models_dir: Path) -> Server:
    port = _free_port()
    env = dict(
        os.environ,
        BUDGETSERVE_PORT=str(port),
        BUDGETSERVE_HOST="127.0.0.1",
        BUDGETSERVE_MODELS_DIR=str(models_dir),
        BUDGETSERVE_WORKERS="1",
    )
    env.pop("REDIS_URL", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "service"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return Server(BUDGETSERVE, port, process)


def start_fixed(bundle_dir: Path, model_id: str) -> Server:
    port = _free_port()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.fixed_server",
            "--serve",
            model_id,
            "--port",
            str(port),
            "--bundle",
            str(bundle_dir),
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return Server(f"fixed {model_id}", port, process)


def wait_ready(servers: Sequence[Server], timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    for server in servers:
        while True:
            if server.process.poll() is not None:
                raise RuntimeError(
                    f"{server.name} exited with {server.process.returncode} before it was ready"
                )
            try:
                if server.request("GET", "/readyz")[0] == 200:
                    break
            except (OSError, http.client.HTTPException):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.name} was not ready after {timeout_s:.0f} s")
            time.sleep(0.2)


# --------------------------------------------------------------------------- the run


@dataclass
class Cell:
    """Results of one (server, side, budget): budget is None for a fixed server."""

    server: str
    side: int
    budget: float | None
    latency_ms: list[float] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    features: dict[str, int] = field(default_factory=dict)
    extracted: set[tuple[str, ...]] = field(default_factory=set)
    errors: int = 0

    @property
    def n(self) -> int:
        return len(self.correct)

    @property
    def accuracy(self) -> float:
        return float(np.mean(self.correct)) if self.correct else float("nan")

    def p(self, q: float) -> float:
        return float(np.percentile(self.latency_ms, q)) if self.latency_ms else float("nan")

    @property
    def fixed(self) -> bool:
        return self.budget is None


def held_out_items(count: int, bundle_dir: Path = BUNDLE) -> tuple[np.ndarray, np.ndarray]:
    """Indices (into ``load_digits``) and labels of up to ``count`` held-out digits of the
    bundle's build (its provenance's seed and limit)."""
    from sklearn.datasets import load_digits

    from service.bundle import read_manifest
    from training.evaluate import digit_split

    params = read_manifest(bundle_dir).provenance.parameters
    test = digit_split(int(params.get("seed", 0)), params.get("limit"))[1][:count]
    return test, np.asarray(load_digits().target)[test]


def render_pngs(indices: np.ndarray, side: int) -> list[str]:
    """The digits at ``indices`` rendered at ``side`` (seeded jitter), as base64 PNGs."""
    from sklearn.datasets import load_digits

    from training.data.digits import render_digit, to_png

    images = load_digits().images
    out = []
    for i in indices:
        rng = np.random.default_rng([7, int(i), side])
        out.append(base64.b64encode(to_png(render_digit(images[int(i)], side, rng))).decode())
    return out


def run_cells(
    budgetserve: Server,
    fixed: Sequence[Server],
    sides: Sequence[int],
    budgets: Sequence[float],
    indices: np.ndarray,
    labels: np.ndarray,
    model: str = "digits",
) -> list[Cell]:
    """Send every held-out item to every (server, budget) at every side, interleaved: for
    each item, the cells in an order rotated by one per item; one request at a time."""
    nonce = uuid.uuid4().hex[:12]
    cells: list[Cell] = []
    for side in sides:
        pngs = render_pngs(indices, side)
        plan: list[tuple[Server, Cell]] = [
            (budgetserve, Cell(BUDGETSERVE, side, b)) for b in budgets
        ] + [(s, Cell(s.name, side, None)) for s in fixed]
        for server, cell in plan:  # warm-up: one request per cell, not measured
            _one(server, cell, pngs[0], str(labels[0]), f"warm-{nonce}-{side}", record=False)
        for i, (png, label) in enumerate(zip(pngs, labels, strict=True)):
            k = i % len(plan)
            for j, (server, cell) in enumerate(plan[k:] + plan[:k]):
                _one(server, cell, png, str(label), f"{nonce}-{side}-{i}-{k + j}")
        cells += [cell for _, cell in plan]
    return cells


def _one(
    server: Server, cell: Cell, png: str, label: str, item_id: str, record: bool = True
) -> None:
    body: dict[str, Any] = {"model": "digits", "item": {"id": item_id, "png_base64": png}}
    if cell.budget is not None:
        body["budget"] = cell.budget
    raw_body = json.dumps(body).encode()
    t0 = time.perf_counter()
    try:
        status, raw = server.request("POST", "/predict", raw_body)
    except (OSError, http.client.HTTPException):
        status, raw = 0, b""
    latency = (time.perf_counter() - t0) * 1000.0
    if not record:
        return
    if status != 200:
        cell.errors += 1
        return
    answer = json.loads(raw)
    cell.latency_ms.append(latency)
    cell.correct.append(answer["prediction"] == label)
    key = answer.get("answered_by", "?")
    cell.features[key] = cell.features.get(key, 0) + 1
    if "extracted" in answer:
        cell.extracted.add(tuple(answer["extracted"]))


def compare(
    sides: Sequence[int] = SIDES,
    budgets: Sequence[float] = BUDGETS,
    count: int = 150,
    fixed_ids: Sequence[str] | None = None,
    bundle_dir: Path = BUNDLE,
) -> tuple[list[Cell], list[str]]:
    """Start budgetserve and the fixed servers, run :func:`run_cells`, stop them all."""
    from service.bundle import read_manifest

    manifest = read_manifest(bundle_dir)
    ids = list(fixed_ids) if fixed_ids is not None else fixed_model_ids(manifest)
    indices, labels = held_out_items(count, bundle_dir)
    servers: list[Server] = []
    try:
        servers.append(start_budgetserve(bundle_dir.parent))
        servers += [start_fixed(bundle_dir, m) for m in ids]
        wait_ready(servers)
        cells = run_cells(servers[0], servers[1:], sides, budgets, indices, labels)
    finally:
        for server in servers:
            server.stop()
    return cells, ids


# --------------------------------------------------------------------------- statistics


def best_fixed_within(cells: Sequence[Cell], latency_ms: float) -> Cell | None:
    """The most accurate fixed server whose p95 latency is at most ``latency_ms``."""
    fitting = [c for c in cells if c.fixed and c.p(95) <= latency_ms]
    return max(fitting, key=lambda c: (c.accuracy, -c.p(95)), default=None)


def monotonicity_breaks(cells: Sequence[Cell]) -> list[tuple[Cell, Cell]]:
    """(lower budget, higher budget) pairs of budgetserve rows at one side where the higher
    budget's accuracy is below the Wilson interval of the best lower budget's."""
    out = []
    rows = sorted((c for c in cells if not c.fixed), key=lambda c: c.budget or 0.0)
    for k, cell in enumerate(rows):
        if k == 0:
            continue
        best = max(rows[:k], key=lambda c: c.accuracy)
        lo, _ = wilson(sum(best.correct), best.n)
        if cell.accuracy < lo:
            out.append((best, cell))
    return out


# --------------------------------------------------------------------------- calibration


@dataclass
class CalibrationRow:
    model: str
    estimate: float
    served: dict[int, float]


def calibration_table(
    bundle_dir: Path = BUNDLE, sides: Sequence[int] = CALIBRATION_SIDES, count: int = 360
) -> tuple[list[CalibrationRow], int]:
    """a(F) of every exported model against its accuracy on held-out digits per side: each
    digit rendered at the side, every extractor run once, every model's ONNX inference
    (:class:`service.inference.LoadedModel`) on its features; no budget, no planning."""
    from service.bundle import read_manifest
    from service.extractors.base import create_extractor
    from service.inference import load_models

    manifest = read_manifest(bundle_dir)
    models = {k: v for k, v in load_models(manifest, bundle_dir).items() if v.spec.features}
    extractors = {
        e.name: create_extractor(e.entry_point, e.version, e.params) for e in manifest.extractors
    }
    indices, labels = held_out_items(count, bundle_dir)
    from sklearn.datasets import load_digits

    from training.data.digits import render_digit

    images = load_digits().images
    hits = {(m, s): 0 for m in models for s in sides}
    for side in sides:
        for i, label in zip(indices, labels, strict=True):
            image = render_digit(images[int(i)], side, np.random.default_rng([11, int(i), side]))
            feats = {n: np.asarray(e.extract(image), np.float32) for n, e in extractors.items()}
            for m, model in models.items():
                pred = manifest.classes[int(np.argmax(model.predict_proba(feats)))]
                hits[(m, side)] += int(pred == str(label))
    rows = [
        CalibrationRow(m, model.spec.accuracy, {s: hits[(m, s)] / len(indices) for s in sides})
        for m, model in models.items()
    ]
    return rows, len(indices)


def rank_inversions(
    rows: Sequence[CalibrationRow], side: int, among: Sequence[str], margin: float = 0.02
) -> list[tuple[CalibrationRow, CalibrationRow]]:
    """Pairs (F, G) of ``among`` with a(F) > a(G) but G serving at least ``margin`` more
    than F at ``side``."""
    chosen = [r for r in rows if r.model in among]
    return [
        (f, g)
        for f in chosen
        for g in chosen
        if f.estimate > g.estimate and g.served[side] - f.served[side] >= margin
    ]


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(x, y).statistic)


# --------------------------------------------------------------------------- report


def _label(cell: Cell) -> str:
    return f"budgetserve @ {cell.budget:g} ms" if cell.budget is not None else cell.server


#: Short names of the digits extractors in the plot's labels.
SHORT = {
    "thumbnail": "T",
    "histogram": "Hi",
    "projection": "P",
    "hog": "H",
    "lbp": "L",
    "fft_bands": "F",
    "gabor": "G",
}


def short(model_id: str) -> str:
    """``fft_bands+hog`` → ``F+H`` (names without a short form stay whole)."""
    return "+".join(SHORT.get(f, f) for f in model_id.split("+"))


def plot(cells: Sequence[Cell], sides: Sequence[int], path: Path, floor: float = 0.8) -> None:
    """Accuracy vs client latency p50 (top) and p95 (bottom) per side; fixed servers below
    ``floor`` are drawn on the axis' bottom edge with their accuracy in the label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(2, len(sides), figsize=(5.5 * len(sides), 9), squeeze=False)
    for row, q in enumerate((50, 95)):
        for col, side in enumerate(sides):
            ax = axes[row][col]
            here = [c for c in cells if c.side == side]
            bs = sorted((c for c in here if not c.fixed), key=lambda c: c.budget or 0.0)
            fx = sorted((c for c in here if c.fixed), key=lambda c: c.p(q))
            ax.plot(
                [c.p(q) for c in bs],
                [max(c.accuracy, floor) for c in bs],
                "o-",
                label="budgetserve (label: budget ms)",
            )
            for c in bs:
                ax.annotate(
                    f"{c.budget:g}",
                    (c.p(q), max(c.accuracy, floor)),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(3, -10),
                    color="C0",
                )
            ax.plot(
                [c.p(q) for c in fx],
                [max(c.accuracy, floor) for c in fx],
                "s--",
                label="fixed (label: feature set)",
            )
            for c in fx:
                name = short(c.server.removeprefix("fixed "))
                if c.accuracy < floor:
                    name += f" ({c.accuracy:.2f})"
                ax.annotate(
                    name,
                    (c.p(q), max(c.accuracy, floor)),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(3, 4),
                    color="C1",
                )
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_ylim(floor - 0.01, 1.01)
            ax.set_title(f"{side}×{side} px, p{q}")
            ax.set_xlabel(f"client latency p{q} (ms, log scale)")
            ax.set_ylabel("accuracy on held-out digits")
            ax.grid(alpha=0.3)
            ax.legend(loc="best", fontsize=7)
    fig.suptitle(
        "budgetserve vs fixed-feature-set servers (T thumbnail, Hi histogram, "
        "P projection, H hog, L lbp, F fft_bands, G gabor)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_cells(cells: Sequence[Cell], path: Path) -> None:
    """The raw results (per-request latency and correctness), to re-render without a re-run."""
    path.write_text(
        json.dumps(
            [
                {
                    "server": c.server,
                    "side": c.side,
                    "budget": c.budget,
                    "latency_ms": c.latency_ms,
                    "correct": c.correct,
                    "features": c.features,
                    "extracted": sorted(list(e) for e in c.extracted),
                    "errors": c.errors,
                }
                for c in cells
            ]
        )
    )


def load_cells(path: Path) -> list[Cell]:
    return [
        Cell(
            d["server"],
            d["side"],
            d["budget"],
            d["latency_ms"],
            d["correct"],
            d["features"],
            {tuple(e) for e in d["extracted"]},
            d["errors"],
        )
        for d in json.loads(path.read_text())
    ]


def render(
    cells: Sequence[Cell],
    ids: Sequence[str],
    sides: Sequence[int],
    count: int,
    calibration: tuple[list[CalibrationRow], int] | None,
    wall_s: float,
    candidates: Sequence[str],
) -> list[str]:
    n_fixed = len(ids)
    lines = prose(
        "fixed_server",
        measured_at=measured_at(),
        machine=machine(),
        count=count,
        sides=", ".join(map(str, sides)),
        budgets=", ".join(
            f"{b:g}" for b in sorted({c.budget for c in cells if c.budget is not None})
        ),
        fixed=", ".join(f"`{m}`" for m in ids),
        n_fixed=n_fixed,
        requests=sum(c.n + c.errors for c in cells),
        wall=f"{wall_s:.0f}",
    )
    summary: list[str] = []
    for side in sides:
        here = [c for c in cells if c.side == side]
        lines += [
            "",
            f"### {side}×{side} ({side * side} pixels)",
            "",
            "| server | n | accuracy [95 % CI] | p50 ms | p95 ms | answered by "
            "| best fixed within this p95 | budgetserve ≥ it? |",
            "|---|---|---|---|---|---|---|---|",
        ]
        below = []
        for c in sorted(here, key=lambda c: (c.fixed, c.budget or 0.0, c.p(95))):
            lo, hi = wilson(sum(c.correct), c.n)
            answered = ", ".join(
                f"{k} ×{v}" if len(c.features) > 1 else k
                for k, v in sorted(c.features.items(), key=lambda kv: -kv[1])[:3]
            )
            if len(c.features) > 3:
                answered += ", …"
            best, verdict = "", ""
            if not c.fixed:
                b = best_fixed_within(here, c.p(95))
                if b is None:
                    best, verdict = "none fits", "—"
                else:
                    blo, _ = wilson(sum(b.correct), b.n)
                    best = f"{b.server.removeprefix('fixed ')} ({b.accuracy:.3f})"
                    if c.accuracy >= b.accuracy:
                        verdict = "yes"
                    elif c.accuracy >= blo or hi >= b.accuracy:
                        verdict = "no, within the intervals"
                        below.append((c, b, True))
                    else:
                        verdict = "**no**"
                        below.append((c, b, False))
            errors = f" ({c.errors} errors)" if c.errors else ""
            lines.append(
                f"| {_label(c)} | {c.n}{errors} | {c.accuracy:.3f} [{lo:.3f}, {hi:.3f}] | "
                f"{c.p(50):.2f} | {c.p(95):.2f} | {answered} | {best} | {verdict} |"
            )
        breaks = monotonicity_breaks(here)
        summary.append(
            f"- **{side}×{side}**: budgetserve at least as accurate as the best "
            f"fixed server within its p95 in "
            f"{sum(1 for c in here if not c.fixed) - len(below)} of "
            f"{sum(1 for c in here if not c.fixed)} budgets"
            + (
                ""
                if not below
                else "; below it at "
                + ", ".join(
                    f"{c.budget:g} ms ({c.accuracy:.3f} vs {b.server.removeprefix('fixed ')}"
                    f" {b.accuracy:.3f}{', within the intervals' if soft else ''})"
                    for c, b, soft in below
                )
            )
            + "; accuracy non-decreasing in budget within its interval: "
            + (
                "yes"
                if not breaks
                else "no ("
                + ", ".join(
                    f"{b.budget:g} ms: {b.accuracy:.3f} < {a.budget:g} ms's "
                    f"{wilson(sum(a.correct), a.n)[0]:.3f} lower bound"
                    for a, b in breaks
                )
                + ")"
            )
            + "."
        )
    lines += prose("fixed_server", "summary")
    lines += summary
    lines += prose("fixed_server", "reading")
    if calibration is not None:
        rows, n = calibration
        cal_sides = sorted(rows[0].served)
        lines += prose("fixed_server", "calibration", n=n, sides=", ".join(map(str, cal_sides)))
        lines += [
            "| model | a(F) (manifest) | "
            + " | ".join(f"served @ {s}" for s in cal_sides)
            + " | candidate |",
            "|---|---|" + "---|" * len(cal_sides) + "---|",
        ]
        for r in sorted(rows, key=lambda r: -r.estimate):
            lines.append(
                f"| {r.model} | {r.estimate:.3f} | "
                + " | ".join(f"{r.served[s]:.3f}" for s in cal_sides)
                + f" | {'yes' if r.model in candidates else ''} |"
            )
        estimates = [r.estimate for r in rows]
        rho = {s: spearman(estimates, [r.served[s] for r in rows]) for s in cal_sides}
        lines += [
            "",
            "Rank agreement (Spearman) between a(F) and served accuracy, all models: "
            + ", ".join(f"{s} px: {rho[s]:.2f}" for s in cal_sides)
            + ".",
            "",
        ]
        lines += [
            "Pairs of fixed-server sets (candidates, `hog`, full set) that a(F) ranks "
            "one way and that serve the other way by ≥ 2 points:",
            "",
        ]
        any_pair = False
        for s in cal_sides:
            pairs = rank_inversions(rows, s, ids)
            for f, g in pairs:
                any_pair = True
                lines.append(
                    f"- side {s}: a({f.model}) = {f.estimate:.3f} > "
                    f"a({g.model}) = {g.estimate:.3f}, but it serves "
                    f"{f.served[s]:.3f} < {g.served[s]:.3f}"
                )
        if not any_pair:
            lines.append("- none")
        lines += prose("fixed_server", "calibration-notes", n=n)
    return lines


def main(
    out_path: str = "docs/benchmarks/fixed_server.md",
    count: int = 150,
    sides: Sequence[int] = SIDES,
    budgets: Sequence[float] = BUDGETS,
) -> Path:
    from service.bundle import read_manifest

    t0 = time.perf_counter()
    cells, ids = compare(sides, budgets, count)
    wall = time.perf_counter() - t0
    raw = Path(os.environ.get("FIXED_SERVER_RAW", "/tmp/fixed_server_cells.json"))
    save_cells(cells, raw)
    manifest = read_manifest(BUNDLE)
    strategy = next(s for s in manifest.strategies if s.name == manifest.default_strategy)
    candidates = list(getattr(strategy, "candidates", []))
    calibration = calibration_table()
    path = ROOT / out_path
    path.parent.mkdir(parents=True, exist_ok=True)
    plot(cells, sides, path.with_suffix(".png"))
    lines = render(cells, ids, sides, count, calibration, wall, candidates)
    path.write_text("\n".join(lines) + "\n")
    return path


def _cli(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fixed_server")
    parser.add_argument("--serve", metavar="MODEL_ID", help="run one fixed server and block")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--bundle", type=Path, default=BUNDLE)
    parser.add_argument("--count", type=int, default=150, help="held-out digits per cell")
    args = parser.parse_args(argv)
    if args.serve:
        serve_fixed(args.bundle, args.serve, args.port)
    else:
        print(main(count=args.count))


if __name__ == "__main__":
    _cli()
