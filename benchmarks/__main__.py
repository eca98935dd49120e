"""``make bench``: every benchmark, each writing its markdown file to docs/benchmarks/."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
console = Console()


def digits_report(out_path: str = "docs/benchmarks/digits.md") -> Path:
    """The embedded digits bundle: lattice statistics and served accuracy at (size, budget)."""
    from training.evaluate import evaluate_bundle, load

    bundle = load(ROOT / "models" / "digits")
    m = bundle.manifest
    stats = m.polydom().stats
    m_features = len(m.extractors)
    lines = [
        "# Digits bundle: what each (size, budget) buys",
        "",
        f"Bundle `{m.name}` {m.version}; measured "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.platform()} "
        f"({os.cpu_count()} CPUs) with `python -m benchmarks`.",
        "",
        "## Lattice",
        "",
        f"- features (extractors): {m_features}; lattice: {2 ** m_features} sets",
        f"- Poly-Dom expansions: {int(stats.get('expansions', 0))} "
        f"(Naive-Expand-All: {2 ** m_features}); closure expansions: "
        f"{int(stats.get('closure_expansions', 0))}",
        f"- candidates: {len(m.polydom().candidates)}; index: "
        f"{len(m.polydom().index.breakpoints)} size ranges, "
        f"{sum(len(s) for s in m.polydom().index.skylines)} skyline entries",
        f"- ε = {m.polydom().epsilon}, δ = {m.polydom().delta}",
        "",
        "## Cost model (p95 fit, ms)",
        "",
        "| extractor | dims | c(n) coefficients (1, n, n², …) | fit error | c(16²) | c(256²) |",
        "|---|---|---|---|---|---|",
    ]
    for e in m.extractors:
        coeffs = ", ".join(f"{c:.3g}" for c in e.cost.coefficients)
        lines.append(f"| {e.name} | {e.dims} | {coeffs} | {e.cost.fit_error:.3f} | "
                     f"{e.cost(256):.3f} | {e.cost(65536):.2f} |")
    lines += [
        "",
        "## Served accuracy on held-out digits",
        "",
        "Each row: 200 held-out digits rendered at that side, run through the serving path "
        "(plan within budget − 0.5 ms reserve, extract with real timings, ONNX inference) with "
        "no cache. *expected* is the cross-validated accuracy of the chosen models; *overruns* "
        "counts requests whose measured time (planning + extraction + inference) exceeded the "
        "budget.",
        "",
        "| side | n | budget ms | accuracy | expected | mean spent ms | p95 spent ms | overruns |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in evaluate_bundle(bundle, (16, 64, 128, 256), (0.6, 1.0, 2.0, 5.0, 20.0)):
        lines.append(
            f"| {p.side} | {p.side * p.side} | {p.budget:g} | {p.accuracy:.3f} | "
            f"{p.expected_accuracy:.3f} | {p.mean_spent:.2f} | {p.p95_spent:.2f} | "
            f"{p.overrun_rate:.1%} |"
        )
    path = ROOT / out_path
    path.write_text("\n".join(lines) + "\n")
    return path


def strategies_report() -> Path:
    """Every strategy of the digits bundle: accuracy and overruns vs budget at 3 sizes."""
    from training.evaluate import evaluate_bundle, load
    from training.plots import write_strategy_report

    bundle = load(ROOT / "models" / "digits")
    names = [s.name for s in bundle.manifest.strategies]
    points = list(evaluate_bundle(bundle, (32, 128, 256),
                                  (0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0),
                                  strategies=names, count=200))
    _, md = write_strategy_report(points, ROOT / "docs" / "benchmarks", "digits", 200)
    return md


def main() -> None:
    from benchmarks import (
        anytime,
        calibration,
        dag,
        extractors,
        gating,
        polydom,
        service,
    )

    for name, run in (
        ("extractors", lambda: extractors.main()),
        ("polydom", lambda: polydom.main()),
        ("digits", digits_report),
        ("strategies", strategies_report),
        ("anytime (synthetic)", lambda: anytime.main()),
        ("calibration", lambda: calibration.main()),
        ("dag", lambda: dag.main()),
        ("gating", lambda: gating.main()),
        ("service", lambda: service.main()),
    ):
        t0 = time.perf_counter()
        run()
        console.print(f"[bold]{name}[/] done ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
