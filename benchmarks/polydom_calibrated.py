"""Planning time per request under uneven calibration: the calibrated index vs the scan.

Loads the digits bundle (``models/digits``), feeds its real calibrator random
measured/profiled ratios per extractor and size bucket (log-uniform in
``[e^-spread, e^spread]``, fixed seed), builds the calibrated index once, then times, on the
same random (size, budget) queries and interleaved over rounds:

* ``scan``: what planning did before (``index_scale`` finds the factors uneven, then a
  scan of every model), and
* ``index``: ``PolyDomRuntime.plan`` (the validity check against the factors at the size,
  the walk down the calibrated index's list),

checking on every query that both return the same model and cost; once with the
per-feature costs computed outside the timing (the plan alone), once per request as
``begin`` does it (the costs at the size, then the plan: before, ``at`` and the factors
again in ``index_scale``; now ``at_with_factors``, the factors computed once).

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
    # Hold the calibrator's clock still from here: its factors decay with time since the
    # last sample, and both planners must see the same factors to be compared query by query.
    frozen = time.monotonic()
    bundle.calibrator._clock = lambda: frozen
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

    def scan_request() -> list[tuple[str, float]]:  # begin() before: costs, then the scan
        out = []
        for n, b in zip(sizes, budgets, strict=True):
            pf = bundle.costs.at(n)
            assert runtime.index_scale(n, none) is None
            out.append(runtime.scan(b, none, pf))
        return out

    def indexed_request() -> list[tuple[str, float]]:  # begin() now
        out = []
        for n, b in zip(sizes, budgets, strict=True):
            pf, factors = bundle.costs.at_with_factors(n)
            out.append(runtime.plan(n, b, none, pf, factors))
        return out

    pairs = {
        "plan only (per-feature costs given)": (scan, indexed),
        "per request (costs at the size + plan, as begin)": (scan_request, indexed_request),
    }
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for what, fns in pairs.items():
            expected: list[tuple[str, float]] = []
            for label, fn in zip(("scan", "index"), fns, strict=True):
                t0 = time.perf_counter()
                result = fn()
                times.setdefault((what, label), []).append(
                    (time.perf_counter() - t0) / queries * 1e6
                )
                if label == "scan":
                    expected = result
                else:
                    assert result == expected, "the calibrated index must plan as the scan"
    assert runtime.calibrated_index.builds == 1, "factors held still: no rebuild"
    models = len(runtime.model_features)
    lines = [
        f"digits bundle, {models} models, {index.n_ranges} ranges, kept per range "
        f"{index.size / index.n_ranges:.1f} of {models} (mean); build {build_ms:.1f} ms; "
        f"{queries} queries x {rounds} rounds, interleaved; same plans on every query",
        "",
        "| what | planner | µs per request (min / median / max over rounds) |",
        "|---|---|---|",
    ]
    for (what, label), values in times.items():
        lines.append(
            f"| {what} | {label} | {min(values):.2f} / {statistics.median(values):.2f} / "
            f"{max(values):.2f} |"
        )
    lines.append("")
    for what in pairs:
        scan_t, index_t = times[(what, "scan")], times[(what, "index")]
        lines.append(
            f"{what}: scan / index = {min(scan_t) / min(index_t):.2f}x (min), "
            f"{statistics.median(scan_t) / statistics.median(index_t):.2f}x (median)"
        )
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
