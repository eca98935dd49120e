"""Issue 14, side by side: CSTC, CSCC and the single cost-sensitive classifier (paper 003)
against the sensor-acquisition DAG (paper 000), ADAPT-GBRT gating (paper 001) and logistic
regression on all features, on the *same* train / validation / test split and the *same*
feature costs as ``benchmarks/cstc.py``'s MiniBooNE run (the MiniBooNE sample, 50 draws from
the Yahoo cost vector with seed 0).

Every method is trained on the training rows with the costs normalised to mean 1 (one meaning
of each method's λ) and reported in Yahoo units; operating points are chosen on validation rows
only (each method's validation Pareto set; at a budget T, its best validation point whose
validation cost is <= T) and every reported number is on test rows.

``python -m benchmarks.cstc_side_by_side [--jobs N]`` writes
``docs/benchmarks/cstc_side_by_side.md`` and ``docs/benchmarks/cstc_side_by_side.png``.

The module stays whole (over 450 lines): it is one benchmark, whose six methods share one
split, one cost vector and one row type, and whose table, "where each loses" text and plot
all read those rows.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from sklearn.exceptions import ConvergenceWarning

from benchmarks.cstc import Array, Row, _best_at, _static_rows, _table, _tree_rows, pareto
from benchmarks.dag import REFINE
from benchmarks.gating import BENCH_GBRT, F0_GRID
from benchmarks.report import OUT, machine, measured_at, prose, wilson
from training.dag import DagClassifier
from training.dag import sweep as dag_sweep
from training.data.uci import DATA, Split, load_miniboone
from training.executor import INLINE, Executor, make_executor
from training.gating import F0Choice, FittedF0, tune_gbrt_f0
from training.gating.sweep import Config
from training.gating.sweep import sweep as gating_sweep

#: benchmarks/cstc.py's MiniBooNE λ grid and methods (the trees: depth 3, 2 rounds).
TREE_METHODS = ("cstc", "cscc", "root-only")
TREE_LAMBDAS = (0.001, 0.01, 0.1)
#: DAG cost scales (λ per unit of normalised cost, in misclassifications) and, as in
#: benchmarks/dag.py, up to REFINE scales :func:`training.dag.sweep` adds where neighbouring
#: validation costs are far apart.
DAG_SCALES = (0.0, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 1.0)
DAG_REFINE = REFINE
#: benchmarks/dag.py's MiniBooNE DAG: Alg. 2 with 7 subsets, LightGBM bank, linear policies.
DAG_PARAMS: dict[str, Any] = {
    "n_subsets": 7,
    "learner": "gbrt",
    "policy_learner": "linear",
    "folds": 3,
    "policy_inputs": "features+confidence",
}
#: ADAPT-GBRT: benchmarks/gating.py's P_full values, λ up to 0.03 (non-uniform costs).
GATING_GRID = [Config("adapt-gbrt", p, lam) for p in (0.2, 0.4) for lam in (1e-3, 3e-3, 1e-2, 3e-2)]
#: Budgets (Yahoo units) of the side-by-side table; the full cost is added.
BUDGETS = (10.0, 25.0, 50.0, 100.0, 200.0, 400.0, 800.0)

DAG = "DAG (paper 000)"
GATING = "ADAPT-GBRT (paper 001)"
LR = "logistic regression, all features"
LABELS = {
    "cstc": "CSTC",
    "cscc": "CSCC",
    "root-only": "root-only (single cost-sensitive classifier)",
}
METRIC = "accuracy"
UNIT = "Yahoo units"


def label(method: str) -> str:
    return LABELS.get(method, method)


@contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=ConvergenceWarning)
        yield


# ------------------------------------------------------------------------------- data


def load(root: Path = DATA) -> tuple[Split, Array, dict[str, int]] | None:
    """benchmarks/cstc.py's MiniBooNE split and costs: 50 draws without replacement from the
    Yahoo cost vector (seed 0), one per column; None when the data are missing."""
    loaded = load_miniboone(root)
    yahoo = root / "yahoo-costs" / "yahoo_cs_cost"
    if loaded is None or not yahoo.is_file():
        return None
    (split, *_), dropped = loaded
    profile = np.loadtxt(yahoo)
    costs = np.random.default_rng(0).choice(profile, size=split.X_train.shape[1], replace=False)
    return split, costs, dropped


# ------------------------------------------------------------------------------- methods


def _one_tree(split: Split, costs: Array, item: tuple[str, float]) -> list[Row]:
    """One (method, λ) of :func:`benchmarks.cstc._tree_rows` (a task for an executor)."""
    method, lam = item
    with _quiet():
        return _tree_rows(split, (method,), costs, METRIC, (lam,))


def tree_rows(
    split: Split,
    costs: Array,
    methods: Sequence[str] = TREE_METHODS,
    lambdas: Sequence[float] = TREE_LAMBDAS,
    executor: Executor = INLINE,
) -> list[Row]:
    """CSTC / CSCC / root-only exactly as benchmarks/cstc.py fits them, one task per λ."""
    items = [(m, lam) for m in methods for lam in lambdas]
    return [r for rows in executor.map(_one_tree, items, shared=(split, costs)) for r in rows]


def dag_rows(
    split: Split,
    costs: Array,
    scales: Sequence[float] = DAG_SCALES,
    refine: int = DAG_REFINE,
    executor: Executor = INLINE,
    **params: Any,
) -> tuple[list[Row], DagClassifier]:
    """The DAG sweep with one sensor per column at its cost (normalised to mean 1 for training,
    reported in the costs' own units): one row per cost scale, sorted by scale, and the first
    model (its groups and states are shared by every scale). ``params``, when given, replace
    :data:`DAG_PARAMS` as the DAG's settings."""
    scale = float(np.mean(costs))
    sensors = {f"f{i + 1}": [i] for i in range(len(costs))}
    sensor_costs = {f"f{i + 1}": float(c) / scale for i, c in enumerate(costs)}
    with _quiet():
        out = dag_sweep(
            split.X_train,
            split.y_train,
            split.X_val,
            split.y_val,
            scales,
            sensors=sensors,
            costs=sensor_costs,
            random_state=0,
            refine=refine,
            executor=executor,
            **(params or DAG_PARAMS),
        )
    rows = []
    for cs, model, val_cost, val_error in sorted(out, key=lambda p: p[0]):
        pred, spent, _ = model.predict_with_cost(split.X_test)
        rows.append(
            Row(
                DAG,
                f"λ={cs:.3g}",
                1.0 - val_error,
                val_cost * scale,
                float(np.mean(pred == split.y_test)),
                float(np.mean(spent)) * scale,
            )
        )
    return rows, out[0][1]


def gating_rows(
    split: Split,
    costs: Array,
    grid: Sequence[Config] = GATING_GRID,
    executor: Executor = INLINE,
) -> tuple[list[Row], F0Choice]:
    """ADAPT-GBRT as benchmarks/gating.py runs it (f0 = LightGBM on all features tuned on
    validation rows, f1's losses cross-fitted on 2 folds, every routing rule and routed
    fraction of each fit), with per-feature costs normalised to mean 1."""
    scale = float(np.mean(costs))
    ytr, yv, yt = (np.asarray(y) for y in (split.y_train, split.y_val, split.y_test))
    choice = tune_gbrt_f0(split.X_train, ytr, split.X_val, yv, random_state=0, **F0_GRID)
    f0 = FittedF0.fit(choice.estimator(), split.X_train, ytr, random_state=0)
    points = gating_sweep(
        split.X_train,
        ytr,
        split.X_val,
        yv,
        costs=np.asarray(costs, dtype=np.float64) / scale,
        f0=f0,
        grid=grid,
        X_test=split.X_test,
        y_test=yt,
        gbrt_params=BENCH_GBRT,
        random_state=0,
        executor=executor,
    )
    rows = [
        Row(
            GATING,
            p.id.removeprefix("adapt-gbrt-"),
            p.val_accuracy,
            p.val_cost * scale,
            p.test_accuracy,
            p.test_cost * scale,
        )
        for p in points
    ]
    return rows, choice


# ------------------------------------------------------------------------------- comparison


def picks(rows: Sequence[Row], budgets: Sequence[float]) -> dict[str, dict[float, Row | None]]:
    """Per method (in order of first appearance) and budget: its best validation-front point
    whose validation cost fits the budget (None when none does)."""
    methods = list(dict.fromkeys(r.method for r in rows))
    return {m: {t: _best_at(rows, m, t) for t in budgets} for m in methods}


def where_each_loses(rows: Sequence[Row], budgets: Sequence[float]) -> list[str]:
    """One line per method, computed from the numbers: the budgets it cannot answer (its
    cheapest validation point is dearer), the budgets where another method's chosen point has
    a higher test accuracy (and the largest such gap), where it is the most accurate (or the
    only one with a point), and where its test cost runs more than 5 % over the budget."""
    table = picks(rows, budgets)
    out = []
    for m, at in table.items():
        cheapest = min(r.val_cost for r in rows if r.method == m)
        missing = [t for t in budgets if at[t] is None]
        losses: list[tuple[float, float, Row, str, Row]] = []
        best = []
        alone = []
        over = []
        for t in budgets:
            mine = at[t]
            if mine is None:
                continue
            if mine.test_cost > 1.05 * t:
                over.append(t)
            others = [(o, r) for o, a in table.items() if o != m and (r := a[t]) is not None]
            if not others:
                alone.append(t)
                continue
            o, r = max(others, key=lambda x: x[1].test_score)
            if r.test_score > mine.test_score:
                losses.append((r.test_score - mine.test_score, t, mine, o, r))
            else:
                best.append(t)
        answered = len(budgets) - len(missing)
        parts = [f"**{label(m)}**: cheapest validation point {cheapest:.1f}"]
        if missing:
            parts.append(f"no point within T = {', '.join(f'{t:g}' for t in missing)}")
        if losses:
            gap, t, mine, o, r = max(losses, key=lambda x: x[0])
            parts.append(
                f"another method is more accurate on test at {len(losses)} of the {answered} "
                f"budgets it answers (T = {', '.join(f'{x[1]:g}' for x in losses)}); largest gap "
                f"{100 * gap:.2f} points at T = {t:g} ({mine.test_score:.4f} @ "
                f"{mine.test_cost:.1f} against {label(o)} {r.test_score:.4f} @ {r.test_cost:.1f})"
            )
        else:
            parts.append(f"no other method is more accurate on test at any of its {answered}")
        if best:
            parts.append(f"most accurate (or tied) at T = {', '.join(f'{t:g}' for t in best)}")
        if alone:
            parts.append(
                f"the only method with a point at T = {', '.join(f'{t:g}' for t in alone)}"
            )
        if over:
            parts.append(
                f"test cost more than 5 % over T at T = {', '.join(f'{t:g}' for t in over)}"
            )
        out.append("* " + "; ".join(parts) + ".")
    return out


def budget_table(rows: Sequence[Row], budgets: Sequence[float]) -> list[str]:
    """Methods × budgets: test accuracy @ test cost of the point chosen on validation."""
    lines = [
        "| method | " + " | ".join(f"T = {t:g}" for t in budgets) + " |",
        "|---|" + "---:|" * len(budgets),
    ]
    for m, at in picks(rows, budgets).items():
        cells = [
            "—" if (r := at[t]) is None else f"{r.test_score:.4f} @ {r.test_cost:.1f}"
            for t in budgets
        ]
        lines.append(f"| {label(m)} | " + " | ".join(cells) + " |")
    return lines


# ------------------------------------------------------------------------------- report

STYLES: dict[str, dict[str, Any]] = {
    "cstc": {"color": "tab:red", "marker": "o"},
    "cscc": {"color": "tab:orange", "marker": "v"},
    "root-only": {"color": "tab:brown", "marker": "s", "linestyle": "--"},
    DAG: {"color": "tab:blue", "marker": "D"},
    GATING: {"color": "tab:green", "marker": "^"},
    LR: {"color": "tab:purple", "marker": "X", "markersize": 10, "linestyle": "none"},
}


def plot(rows: Sequence[Row], path: Path) -> list[Row]:
    """Each method's validation Pareto set with test numbers, cost on a log axis; returns the
    front points left out because their test cost is 0 (no place on a log axis)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    dropped: list[Row] = []
    for m in dict.fromkeys(r.method for r in rows):
        front = pareto([r for r in rows if r.method == m])
        dropped += [r for r in front if r.test_cost <= 0]
        shown = [r for r in front if r.test_cost > 0]
        if not shown:
            continue
        style = {"markersize": 5, "linestyle": "-", **STYLES.get(m, {"marker": "*"})}
        ax.plot(
            [r.test_cost for r in shown], [r.test_score for r in shown], label=label(m), **style
        )
    ax.set_xscale("log")
    ax.set_xlabel(f"average feature cost per test item ({UNIT}, log scale)")
    ax.set_ylabel("test accuracy")
    ax.set_title("MiniBooNE sample, Yahoo costs: one split, every method", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.text(
        0.01,
        0.005,
        "each curve: the method's validation Pareto points, plotted with their test numbers",
        fontsize=7,
        color="0.35",
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return dropped


def _noise(rows: Sequence[Row], n_test: int) -> str:
    """The 95 % Wilson half-width of one test accuracy at the median accuracy."""
    acc = float(np.median([r.test_score for r in rows]))
    lo, hi = wilson(round(acc * n_test), n_test)
    return f"{100 * (hi - lo) / 2:.1f}"


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="joblib workers (default 2)")
    args = parser.parse_args(argv)
    from threadpoolctl import threadpool_limits

    OUT.mkdir(parents=True, exist_ok=True)
    md = OUT / "cstc_side_by_side.md"
    data = load(DATA)
    if data is None:
        md.write_text(
            "# CSTC side by side\n\nMiniBooNE sample or Yahoo costs missing under "
            "../shared/datasets: nothing run.\n",
            encoding="utf-8",
        )
        return md
    split, costs, dropped = data
    full = float(costs.sum())
    seconds: dict[str, float] = {}
    t_all = time.perf_counter()

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        result = fn()
        seconds[name] = time.perf_counter() - t0
        print(f"{name}: {seconds[name]:.0f} s", flush=True)
        return result

    with threadpool_limits(1), make_executor("local", n_jobs=args.jobs) as ex:
        rows = timed("trees", lambda: tree_rows(split, costs, executor=ex))
        dag, model = timed("dag", lambda: dag_rows(split, costs, executor=ex))
        gate, f0 = timed("gating", lambda: gating_rows(split, costs, executor=ex))
        with _quiet():
            static = timed("logistic regression", lambda: _static_rows(split, costs, METRIC))
    rows += dag + gate + [r for r in static if r.method == LR]
    budgets = [*BUDGETS, full]
    zero = plot(rows, OUT / "cstc_side_by_side.png")

    groups = "; ".join(
        "{" + ", ".join(g) + "}" + f" = {sum(model.sensor_costs_[s] for s in g) * costs.mean():.0f}"
        for g in model.groups_[:-1]
    )
    lines = prose(
        "cstc_side_by_side",
        measured_at=measured_at(),
        machine=machine(),
        jobs=args.jobs,
        rows=f"{len(split.y_train)} / {len(split.y_val)} / {len(split.y_test)}",
        dropped=f"tr {dropped['tr']}, tv {dropped['tv']}, te {dropped['te']}",
        full=f"{full:.0f}",
        values=sorted({int(c) for c in costs}),
        tree_lambdas=", ".join(f"{v:g}" for v in TREE_LAMBDAS),
        dag_scales=", ".join(f"{v:g}" for v in DAG_SCALES),
        dag_refine=DAG_REFINE,
        dag_added=len(dag) - len(DAG_SCALES),
        n_groups=len(model.groups_) - 1,
        groups=groups,
        n_states=len(model.states_),
        gating_grid=", ".join(f"({c.p_full:g}, {c.regularisation:g})" for c in GATING_GRID),
        f0=f0.describe(),
    )
    lines += [
        "",
        "## Side by side at a budget",
        "",
        f"Test accuracy @ test average cost ({UNIT}) of each method's point chosen on "
        f"validation: the most accurate validation-front point whose validation cost is <= T "
        f"(T = {full:.0f} is the cost of every feature).",
        "",
        *budget_table(rows, budgets),
        "",
        "## Where each loses",
        "",
        f"Computed from the table above (one split, {len(split.y_test)} test rows: a 95 % "
        f"interval on one test accuracy is about ±{_noise(rows, len(split.y_test))} points: gaps "
        'of that size or less are not clear evidence either way). "No point within T" is '
        "about the grid swept: a method's cheapest point is that of its largest λ here.",
        "",
        *where_each_loses(rows, budgets),
        "",
        "![accuracy vs cost](cstc_side_by_side.png)",
        "",
    ]
    if zero:
        lines += [
            "Not on the plot (test cost 0, no place on a log axis): "
            + "; ".join(f"{label(r.method)} {r.setting} ({r.test_score:.4f})" for r in zero)
            + ".",
            "",
        ]
    lines += [
        "## Every point",
        "",
        f"<details><summary>all {len(rows)} fitted points (validation and test numbers)</summary>",
        "",
        *_table(rows, METRIC, UNIT),
        "",
        "</details>",
        "",
        *prose(
            "cstc_side_by_side",
            "after",
            total=f"{time.perf_counter() - t_all:.0f}",
            times=", ".join(f"{k} {v:.0f} s" for k, v in seconds.items()),
            counts=", ".join(
                f"{label(m)} {sum(r.method == m for r in rows)}"
                for m in dict.fromkeys(r.method for r in rows)
            ),
        ),
    ]
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return md


if __name__ == "__main__":
    print(main())
