"""The embedded digits bundle: what each (size, budget) buys (``docs/benchmarks/digits.md``) and
every strategy's accuracy and overruns vs budget (``docs/benchmarks/digits_strategies.md``).

``python -m benchmarks.digits`` writes both; ``python -m benchmarks`` runs it with the others.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.report import machine, measured_at, prose

ROOT = Path(__file__).resolve().parents[1]


def digits_report(out_path: str = "docs/benchmarks/digits.md") -> Path:
    """The embedded digits bundle: lattice statistics and served accuracy at (size, budget)."""
    from training.evaluate import evaluate_bundle, load

    bundle = load(ROOT / "models" / "digits")
    m = bundle.manifest
    stats = m.polydom().stats
    m_features = len(m.extractors)
    polydom = m.polydom()
    lines = prose(
        "digits",
        name=m.name,
        version=m.version,
        measured_at=measured_at(),
        machine=machine(),
        features=m_features,
        lattice=2**m_features,
        expansions=int(stats.get("expansions", 0)),
        closure_expansions=int(stats.get("closure_expansions", 0)),
        candidates=len(polydom.candidates),
        ranges=len(polydom.index.breakpoints),
        skyline_entries=sum(len(s) for s in polydom.index.skylines),
        epsilon=polydom.epsilon,
        delta=polydom.delta,
    )
    from benchmarks.polydom import digits_epsilon_sweep, render_digits

    lines += render_digits(*digits_epsilon_sweep()).splitlines()
    lines += prose(
        "digits",
        "epsilon",
        epsilon=polydom.epsilon,
        delta=polydom.delta,
        half_epsilon=f"{polydom.epsilon / 2:g}",
    )
    lines += [
        "| extractor | dims | c(n) coefficients (1, n, n², …) | fit error | c(16²) | c(256²) |",
        "|---|---|---|---|---|---|",
    ]
    for e in m.extractors:
        coeffs = ", ".join(f"{c:.3g}" for c in e.cost.coefficients)
        lines.append(
            f"| {e.name} | {e.dims} | {coeffs} | {e.cost.fit_error:.3f} | "
            f"{e.cost(256):.3f} | {e.cost(65536):.2f} |"
        )
    lines += prose("digits", "accuracy")
    lines += [
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
    points = list(
        evaluate_bundle(
            bundle,
            (32, 128, 256),
            (0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0),
            strategies=names,
            count=200,
        )
    )
    _, md = write_strategy_report(points, ROOT / "docs" / "benchmarks", "digits", 200)
    return md


def main() -> list[Path]:
    return [digits_report(), strategies_report()]


if __name__ == "__main__":
    print(main())
