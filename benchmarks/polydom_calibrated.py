"""Planning time per request under uneven calibration: the calibrated index vs the scan.

Loads the digits bundle (``models/digits``), feeds its real calibrator random
measured/profiled ratios per extractor and size bucket (log-uniform in
``[e^-spread, e^spread]``, fixed seed), builds the calibrated index once, then times, on the
same random (size, budget) queries and interleaved over rounds:

* ``scan``: what planning did before (``index_scale`` finds the factors uneven, then a
  scan of every model), and
* ``index``: ``PolyDomRuntime.plan`` (factors at the size, the validity check, the walk
  down the calibrated index's list),

checking on every query that both return the same model and cost. Per-feature costs are
computed once per query outside the timing (both paths get them from ``begin``).

``python -m benchmarks.polydom_calibrated [--queries N] [--rounds R]`` prints a table.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import numpy as np

from service.registry import CalibrationSettings, load_bundle
from service.strategies.polydom import PolyDomRuntime

ROOT = Path(__file__).resolve().parents[1]


def run(queries: int, rounds: int, spread: float, seed: int) -> list[str]:
    bundle = load_bundle(ROOT / "models" / "digits", 1 << 24, CalibrationSettings(min_samples=5))
    runtime = bundle.runtimes["polydom"]
    assert isinstance(runtime, PolyDomRuntime)
    rng = np.random.default_rng(seed)
    for k in range(8, 17):
        profiled = bundle.costs.profiled_at(2**k)
        for name in bundle.extractors:
            ratio = math.exp(rng.uniform(-spread, spread))
            for _ in range(5):
                bundle.calibrator.record(name, 2**k, profiled[name] * ratio)
    started = time.perf_counter()
    index = runtime.calibrated_index.rebuild_now()
    build_ms = (time.perf_counter() - started) * 1e3
    assert index is not None
    lo, hi = runtime.size_domain
    sizes = rng.integers(int(lo), int(hi) + 1, queries).tolist()
    sizes[: queries // 2] = [16384] * (queries // 2)  # half at the served 128 px digits
    budgets = np.exp(rng.uniform(math.log(0.05), math.log(20.0), queries)).tolist()
    per_feature = [bundle.costs.at(n) for n in sizes]
    none: frozenset[str] = frozenset()
    work = list(zip(sizes, budgets, per_feature, strict=True))

    def scan() -> list[tuple[str, float]]:
        out = []
        for n, b, pf in work:
            assert runtime.index_scale(n, none) is None
            out.append(runtime.scan(b, none, pf))
        return out

    def indexed() -> list[tuple[str, float]]:
        return [runtime.plan(n, b, none, pf) for n, b, pf in work]

    times: dict[str, list[float]] = {"scan": [], "index": []}
    for _ in range(rounds):
        for label, fn in (("scan", scan), ("index", indexed)):
            t0 = time.perf_counter()
            result = fn()
            times[label].append((time.perf_counter() - t0) / queries * 1e6)
            if label == "scan":
                expected = result
            else:
                assert result == expected, "the calibrated index must plan as the scan"
    # Calibration factors decay toward the profile from 5 s after their last sample, so
    # over a longer run they move and the index is rebuilt (in the background) meanwhile.
    rebuilds = runtime.calibrated_index.builds - 1
    models = len(runtime.model_features)
    lines = [
        f"digits bundle, {models} models, {index.n_ranges} ranges, kept per range "
        f"{index.size / index.n_ranges:.1f} of {models} (mean); build {build_ms:.1f} ms; "
        f"{queries} queries x {rounds} rounds, interleaved; same plans on every query; "
        f"{rebuilds} background rebuilds during the run (factors decaying)",
        "",
        "| planner | µs per plan (min / median / max over rounds) |",
        "|---|---|",
    ]
    for label, values in times.items():
        lines.append(
            f"| {label} | {min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f} |"
        )
    ratio = statistics.median(times["scan"]) / statistics.median(times["index"])
    lines.append("")
    lines.append(f"scan / index (medians): {ratio:.2f}x")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queries", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--spread", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print("\n".join(run(args.queries, args.rounds, args.spread, args.seed)))


if __name__ == "__main__":
    main()
