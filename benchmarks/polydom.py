"""Benchmark Poly-Dom on the paper's synthetic workload (paper 002, Metrics 1-3).

For m = 4..14 features, γ ∈ {0, 1} and ε ∈ {0.01, 0} (fixed seed) it measures

* Metric 1, expansions: Poly-Dom vs Naive-Expand-All (2^m);
* Metric 2, index size: Poly-Dom vs Poly-Dom-Index-All vs Naive-Lookup (candidate count);
* Metric 3, lookup time per query: the Poly-Dom index vs Naive-Lookup, side by side on the
  same random (size, budget) queries, checking both return the same accuracy.

``python -m benchmarks.polydom`` writes ``docs/benchmarks/polydom.md``.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.report import prose
from service.strategies.polydom_index import naive_lookup
from training.polydom import PolyDom, expand_all, index_all_size
from training.polydom.poly import set_costs
from training.polydom.synthetic import SIZE_DOMAIN, make_workload

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "polydom.md"
SEED = 2024
EPSILONS = (0.01, 0.0)
QUERIES = 20_000
REPEATS = 3


@dataclass(frozen=True)
class Row:
    m: int
    gamma: float
    epsilon: float
    naive_expansions: int
    expansions: int
    closure: int
    candidates: int
    index_size: int
    ranges: int
    all_size: int
    all_ranges: int
    index_us: float
    naive_us: float
    fit_s: float


def _queries(costs: np.ndarray, m: int, count: int, seed: int) -> tuple[list[float], list[float]]:
    rng = np.random.default_rng(seed)
    ns = rng.uniform(*SIZE_DOMAIN, count)
    full = set_costs(np.array([(1 << m) - 1]), costs)[0]
    tops = np.polynomial.polynomial.polyval(ns, full)
    budgets = rng.uniform(0.0, 1.0, count) * tops
    return ns.tolist(), budgets.tolist()


def _time_per_query(
    fn: Callable[[float, float], int | None], pairs: list[tuple[float, float]]
) -> tuple[float, list[int | None]]:
    t0 = time.perf_counter()
    out = [fn(n, b) for n, b in pairs]
    return time.perf_counter() - t0, out


def run_one(m: int, gamma: float, epsilon: float, queries: int = QUERIES, seed: int = SEED) -> Row:
    """One configuration: fit, baselines and side-by-side lookup timing.

    Lookup times are the best of :data:`REPEATS` interleaved runs of each method.
    """
    work = make_workload(m, gamma, seed=seed + m)
    naive = expand_all(m, work.evaluate)
    t0 = time.perf_counter()
    model = PolyDom(epsilon=epsilon).fit(work.evaluate, work.costs, SIZE_DOMAIN)
    fit_s = time.perf_counter() - t0
    acc, costs = model.candidate_accuracies_, model.candidate_costs_
    all_size, all_ranges = index_all_size(acc, costs, SIZE_DOMAIN)

    ns, budgets = _queries(work.costs, m, queries, seed)
    compiled = model.compiled_
    pairs = list(zip(ns, budgets, strict=True))
    index_s = naive_s = float("inf")
    got: list[int | None] = []
    ref: list[int | None] = []
    for _ in range(REPEATS):
        t, got = _time_per_query(compiled.lookup, pairs)
        index_s = min(index_s, t)
        t, ref = _time_per_query(lambda n, b: naive_lookup(acc, costs, n, b), pairs)
        naive_s = min(naive_s, t)
    for a, b in zip(got, ref, strict=True):
        if (a is None) != (b is None) or (a is not None and b is not None and acc[a] != acc[b]):
            raise AssertionError(f"index and Naive-Lookup disagree at m={m}, gamma={gamma}")
    s = model.stats_
    return Row(
        m=m,
        gamma=gamma,
        epsilon=epsilon,
        naive_expansions=naive.expansions,
        expansions=s.expansions,
        closure=s.closure_expansions,
        candidates=s.candidates,
        index_size=s.index_size,
        ranges=s.ranges,
        all_size=all_size,
        all_ranges=all_ranges,
        index_us=1e6 * index_s / queries,
        naive_us=1e6 * naive_s / queries,
        fit_s=fit_s,
    )


def _table(rows: list[Row]) -> list[str]:
    out = [
        "| m | Naive-Expand-All | Poly-Dom expansions | ratio | closure | "
        "Naive-Lookup (candidates) | Poly-Dom index (ranges) | Index-All (ranges) | "
        "lookup Poly-Dom µs | lookup Naive µs | speed-up | fit s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r.m} | {r.naive_expansions} | {r.expansions} | "
            f"{r.naive_expansions / r.expansions:.1f}× | {r.closure} | {r.candidates} | "
            f"{r.index_size} ({r.ranges}) | {r.all_size} ({r.all_ranges}) | "
            f"{r.index_us:.2f} | {r.naive_us:.2f} | {r.naive_us / r.index_us:.1f}× | "
            f"{r.fit_s:.2f} |"
        )
    return out


def render(rows: list[Row], queries: int, elapsed_s: float) -> str:
    lines = prose(
        "polydom", date=dt.date.today().isoformat(), platform=platform.platform(),
        processor=platform.processor() or platform.machine(), cpus=os.cpu_count(),
        python=platform.python_version(), elapsed=f"{elapsed_s:.1f}", seed=SEED,
        queries=queries, repeats=REPEATS,
    )
    for eps in sorted({r.epsilon for r in rows}, reverse=True):
        for gamma in sorted({r.gamma for r in rows}):
            lines += [f"## ε = {eps:g}, γ = {gamma:g}", ""]
            lines += _table([r for r in rows if r.gamma == gamma and r.epsilon == eps])
            lines.append("")
    return "\n".join(lines)


def main(
    out_path: Path | str = DEFAULT_OUT,
    ms: tuple[int, ...] = tuple(range(4, 15)),
    gammas: tuple[float, ...] = (0.0, 1.0),
    epsilons: tuple[float, ...] = EPSILONS,
    queries: int = QUERIES,
) -> list[Row]:
    """Run the benchmark and write the markdown report to ``out_path``."""
    t0 = time.perf_counter()
    rows = [run_one(m, g, e, queries) for e in epsilons for g in gammas for m in ms]
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(rows, queries, time.perf_counter() - t0), encoding="utf-8")
    return rows


if __name__ == "__main__":
    main()
