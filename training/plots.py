"""Accuracy-vs-budget plots and tables (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from training.evaluate import EvalPoint

STYLE = {
    "polydom-anytime": {"color": "tab:blue", "marker": "o"},
    "polydom": {"color": "tab:cyan", "marker": "s", "linestyle": "--"},
    "greedy": {"color": "tab:orange", "marker": "^"},
    "greedy-acc": {"color": "tab:red", "marker": "v"},
    "greedy-cost": {"color": "tab:green", "marker": "D"},
}


def plot_accuracy_vs_budget(points: Sequence[EvalPoint], out: Path, title: str) -> Path:
    """One column per item size: test accuracy (top) and overrun rate (bottom) against the
    budget (log scale), one line per strategy."""
    sides = sorted({p.side for p in points})
    strategies = list(dict.fromkeys(p.strategy for p in points))
    fig, axes = plt.subplots(
        2,
        len(sides),
        figsize=(4.2 * len(sides), 6.4),
        squeeze=False,
        sharex=True,
        gridspec_kw={"height_ratios": [3, 1.3]},
    )
    for col, side in enumerate(sides):
        for name in strategies:
            rows = sorted(
                (p for p in points if p.side == side and p.strategy == name), key=lambda p: p.budget
            )
            budgets = [p.budget for p in rows]
            style = STYLE.get(name, {})
            axes[0][col].plot(
                budgets, [p.accuracy for p in rows], label=name, markersize=4, **style
            )
            axes[1][col].plot(budgets, [100 * p.overrun_rate for p in rows], markersize=3, **style)
        axes[0][col].set_title(f"{side}x{side} px (n = {side * side})")
        axes[0][col].set_xscale("log")
        axes[0][col].grid(alpha=0.3)
        axes[1][col].grid(alpha=0.3)
        axes[1][col].set_xlabel("budget (ms)")
    axes[0][0].set_ylabel("test accuracy")
    axes[1][0].set_ylabel("over budget (%)")
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def markdown_table(points: Sequence[EvalPoint]) -> list[str]:
    lines = [
        "| size | budget ms | strategy | accuracy | expected | mean spent ms | p95 spent ms "
        "| over budget |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in sorted(points, key=lambda p: (p.side, p.budget)):
        lines.append(
            f"| {p.side}² | {p.budget:g} | {p.strategy} | {p.accuracy:.3f} | "
            f"{p.expected_accuracy:.3f} | {p.mean_spent:.2f} | {p.p95_spent:.2f} | "
            f"{p.overrun_rate:.1%} |"
        )
    return lines


def write_strategy_report(
    points: Sequence[EvalPoint], out: Path, name: str, count: int
) -> tuple[Path, Path]:
    """``<name>_accuracy_vs_budget.png`` and ``<name>_strategies.md`` in folder ``out``."""
    png = plot_accuracy_vs_budget(
        points,
        out / f"{name}_accuracy_vs_budget.png",
        f"{name}: accuracy vs budget ({count} held-out items per point)",
    )
    md = out / f"{name}_strategies.md"
    md.write_text(
        "\n".join(
            [
                f"# {name}: accuracy vs budget per strategy",
                "",
                "Held-out digits rendered at each size, served through the serving code path "
                "(`service.execution.execute`, 0.5 ms overhead reserve, live calibration off: the "
                "bundle's own p95 cost model), every item run through each strategy in turn. "
                "*expected* is the cross-validated accuracy of the answering models; *over budget* "
                "the share of requests whose measured cost passed the budget.",
                "",
                f"![plot]({png.name})",
                "",
                *markdown_table(points),
                "",
            ]
        )
    )
    return png, md
