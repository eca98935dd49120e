"""Wall time of the parallel training work on each executor, and proof that the outputs match.

``python -m benchmarks.executor [--rows N] [--n-jobs J] [--address HOST:PORT]`` builds the
digits Poly-Dom bundle (all seven extractors, N rendered digits, the cost curves of
``models/digits`` so that no profiling runs) and a DAG bundle (the router problem, eight cost
scales) inline, on J joblib workers and on Ray (a local instance with J CPUs, or the cluster at
``--address``), and prints a markdown table: seconds per build and a digest of everything the
bundle holds (manifest less its date, ONNX files, verification rows) — one digest per row
means the executors wrote the same bundle.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.bundle import read_manifest
from training.bundles.dag import DagSpec, build_dag_bundle
from training.bundles.digits import BuildConfig, build_bundle
from training.data.synthetic import make_router_data
from training.executor import Executor, make_executor

ROOT = Path(__file__).resolve().parents[1]
ROUTER_SPEC = DagSpec(
    name="router",
    label="label",
    sensors={"r": ["r"], "a": ["a1", "a2"], "b": ["b1", "b2"]},
    costs={"r": 1.0, "a": 5.0, "b": 5.0},
    cost_scales=[0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0],
)


def bundle_digest(folder: Path) -> str:
    """sha256 over the manifest (less version and creation time) and every other file."""
    manifest = read_manifest(folder).model_dump(mode="json")
    manifest.pop("version")
    manifest["provenance"].pop("created_at")
    h = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode())
    for path in sorted(folder.iterdir()):
        if path.name != "manifest.json":
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:12]


def run(rows: int, n_jobs: int, address: str | None) -> list[dict[str, Any]]:
    costs = {e.name: e.cost for e in read_manifest(ROOT / "models" / "digits").extractors}
    config = BuildConfig(name="digits", limit=rows)
    x, y = make_router_data(20000, seed=2)
    y_text = y.astype(str)
    columns = ["r", "a1", "a2", "b1", "b2"]
    executors: list[tuple[str, Callable[[], Executor]]] = [
        ("inline", lambda: make_executor("local")),
        (f"joblib, {n_jobs} workers", lambda: make_executor("local", n_jobs=n_jobs)),
        (
            f"ray, {address}" if address else f"ray, local instance, {n_jobs} CPUs",
            lambda: make_executor("ray", address=address, n_jobs=None if address else n_jobs),
        ),
    ]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, make) in enumerate(executors):
            folder = Path(tmp) / str(i)
            folder.mkdir()
            with make() as ex:
                t0 = time.perf_counter()
                build_bundle(folder / "digits", config, costs=costs, executor=ex)
                t1 = time.perf_counter()
                build_dag_bundle(folder / "router", ROUTER_SPEC, x, y_text, columns, executor=ex)
                t2 = time.perf_counter()
            results.append(
                {
                    "executor": label,
                    "digits_s": t1 - t0,
                    "digits": bundle_digest(folder / "digits"),
                    "dag_s": t2 - t1,
                    "dag": bundle_digest(folder / "router"),
                }
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=800, help="digits rendered (<= 1797)")
    parser.add_argument("--n-jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--address", default=None, help="Ray cluster (default: local)")
    args = parser.parse_args()
    results = run(args.rows, args.n_jobs, args.address)
    print(
        f"{platform.platform()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; digits: {args.rows} rows, 7 extractors; "
        f"DAG: router, 20000 rows, {len(ROUTER_SPEC.cost_scales)} cost scales\n"
    )
    print("| executor | digits build s | digits bundle | DAG build s | DAG bundle |")
    print("| --- | ---: | --- | ---: | --- |")
    for r in results:
        print(
            f"| {r['executor']} | {r['digits_s']:.1f} | `{r['digits']}` | {r['dag_s']:.1f} "
            f"| `{r['dag']}` |"
        )


if __name__ == "__main__":
    main()
