"""Gating benchmark (paper 001, Fig. 4/5): accuracy vs average feature cost on letter (binary
as the paper, and 26-class) and the MiniBooNE sample, for ADAPT-GBRT, ADAPT-LIN, the L1
baseline and GreedyMiser, against what a user would run instead: f0 (LightGBM on all
features, tuned on validation rows), LightGBM on fixed feature sets (the k most important
features of f0), and GreedyMiser's f1 falling back to f0 where it is least confident.

Every method sweeps (P_full, λ/γ/C) and, for gated fits, the fraction of validation items the
gate routes; its operating points are the validation Pareto set. Points are *chosen* on
validation rows and *reported* on test rows (95 % Wilson intervals; differences to f0 with
paired bootstrap intervals), with the fraction of items routed to f0 on both.

``python -m benchmarks.gating [--datasets letter-binary,miniboone,letter-26]`` writes
docs/benchmarks/gating.md and one PNG per data set.

The module stays whole (over 450 lines): the data sets, the sweeps, the choice on validation
and the report with its tables are one experiment over shared result types, read top to
bottom; the report reads every field the run fills.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np
import numpy.typing as npt

from benchmarks import served
from benchmarks.report import machine, measured_at, prose, wilson
from training.data.uci import DATA, Split, load_letter, load_miniboone
from training.gating import F0Choice, FittedF0, tune_gbrt_f0
from training.gating.sweep import (
    METHODS,
    ROUTED_FRACTIONS,
    Config,
    SweepPoint,
    pareto,
    sweep,
    threshold_for_fraction,
)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks"
LABELS = {
    "adapt-gbrt": "ADAPT-GBRT",
    "adapt-lin": "ADAPT-LIN",
    "l1": "L1 baseline",
    "greedymiser": "GreedyMiser",
}
CASCADE = "GreedyMiser f1 + confidence fallback to f0"
FIXED = "LightGBM on the top-k features"
PAPER_REDUCTION = {"letter-binary": 0.31, "miniboone": 0.63}
TOLERANCE = 0.01  # "within 1 %": one accuracy point below f0, as the paper quotes it
BOOTSTRAP = 2000


# --------------------------------------------------------------------------- grids (scoped)

#: The benchmark's grid. Smaller than ``default_grid`` (the machine is shared): P_full and λ
#: for ADAPT-GBRT; the routed fraction is swept after each fit (``ROUTED_FRACTIONS``).
BENCH_GRID = [
    *(Config("adapt-gbrt", p, lam) for p in (0.2, 0.4) for lam in (1e-3, 3e-3, 1e-2)),
    *(Config("greedymiser", 0.0, lam) for lam in (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)),
    *(Config("adapt-lin", 0.4, g) for g in (3e-3, 1e-2, 3e-2)),
    *(Config("l1", 0.0, c) for c in (0.01, 0.1, 1.0)),
]

#: letter with 26 classes: 26 trees per boosting round, so larger λ (each class tree pays a
#: feature's penalty once) and smaller ensembles.
LETTER26_GRID = [
    *(Config("adapt-gbrt", 0.3, lam) for lam in (1e-2, 3e-2, 0.1)),
    *(Config("greedymiser", 0.0, lam) for lam in (1e-2, 3e-2, 0.1)),
    *(Config("adapt-lin", 0.4, g) for g in (3e-3, 3e-2)),
    *(Config("l1", 0.0, c) for c in (0.1, 1.0)),
]
#: ADAPT-GBRT's q-step compares cross-fitted f1 losses with f0's out-of-fold ones (``f1_cv``)
BENCH_GBRT: dict[str, Any] = {"f1_cv": 2}
LETTER26_GBRT: dict[str, Any] = {"n_rounds": 20, "num_leaves": 16, "f1_cv": 2}
#: f0's grid (num_leaves x learning rate; trees chosen along each fit)
F0_GRID: dict[str, Any] = {"num_leaves": (15, 63), "learning_rates": (0.05, 0.1)}
LETTER26_F0_GRID: dict[str, Any] = {
    "num_leaves": (31,),
    "learning_rates": (0.1,),
    "trees": (100, 200, 400),
}


# --------------------------------------------------------------------------- statistics


def paired_diff(
    a: npt.NDArray[np.bool_], b: npt.NDArray[np.bool_], seed: int = 0
) -> tuple[float, float, float]:
    """mean(a) − mean(b) over the same rows and its 95 % paired bootstrap interval."""
    d = a.astype(np.float64) - b.astype(np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(BOOTSTRAP, d.size))
    means = d[idx].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return float(d.mean()), float(lo), float(hi)


# --------------------------------------------------------------------------- runs


@dataclass
class Ref:
    """A reference operating point that is not a gating sweep point (fixed set, cascade)."""

    label: str
    val_accuracy: float
    val_cost: float
    test_accuracy: float
    test_cost: float
    val_routed: float
    test_routed: float
    test_correct: npt.NDArray[np.bool_]


@dataclass
class DatasetRun:
    key: str
    title: str
    n_features: int
    rows: tuple[int, int, int]
    f0_choice: F0Choice
    f0_val: float
    f0_test: float
    f0_test_correct: npt.NDArray[np.bool_]
    points: list[SweepPoint]
    y_test: npt.NDArray[Any]
    X_test: npt.NDArray[np.float64]
    seconds: float
    fixed: list[Ref] = field(default_factory=list)
    cascade: list[Ref] = field(default_factory=list)

    def frontier(self, method: str) -> list[SweepPoint]:
        return pareto([p for p in self.points if p.method == method])

    def within(self, method: str) -> SweepPoint | None:
        """The cheapest frontier point whose validation accuracy is within 1 point of f0's."""
        ok = [p for p in self.frontier(method) if p.val_accuracy >= self.f0_val - TOLERANCE]
        return min(ok, key=lambda p: p.val_cost) if ok else None

    def correct(self, p: SweepPoint) -> npt.NDArray[np.bool_]:
        return np.asarray(p.estimator.predict(self.X_test) == self.y_test, dtype=np.bool_)


def _ref_frontier(refs: Sequence[Ref]) -> list[Ref]:
    """The validation Pareto set of reference points (cheaper and at least as accurate)."""
    out: list[Ref] = []
    for r in sorted(refs, key=lambda r: (r.val_cost, -r.val_accuracy)):
        if not out or r.val_accuracy > out[-1].val_accuracy:
            out.append(r)
    return out


def _ref_within(refs: Sequence[Ref], f0_val: float) -> Ref | None:
    ok = [r for r in _ref_frontier(refs) if r.val_accuracy >= f0_val - TOLERANCE]
    return min(ok, key=lambda r: r.val_cost) if ok else None


def fixed_sets(
    split: Split, f0: FittedF0, choice: F0Choice, ks: Sequence[int], classes: npt.NDArray[Any]
) -> list[Ref]:
    """LightGBM with f0's parameters on the k features f0 splits on most (gain on the training
    rows): the fixed feature sets a user would try instead of an adaptive system."""
    gain = np.asarray(f0.model.booster_.feature_importance("gain"), dtype=np.float64)
    order = np.argsort(-gain, kind="stable")
    y_idx = np.searchsorted(classes, np.asarray(split.y_train))
    out = []
    for k in ks:
        cols = np.sort(order[:k])
        model = lgb.LGBMClassifier(**choice.params).fit(split.X_train[:, cols], y_idx)
        val = classes[model.predict(split.X_val[:, cols])] == np.asarray(split.y_val)
        test = classes[model.predict(split.X_test[:, cols])] == np.asarray(split.y_test)
        acc_val, acc_test = float(val.mean()), float(test.mean())
        out.append(Ref(f"top-{k}", acc_val, float(k), acc_test, float(k), 0.0, 0.0, test))
    return out


def _fallback(
    p1: npt.NDArray[np.float64],
    p0: npt.NDArray[np.float64],
    y: npt.NDArray[Any],
    t: float,
    classes: npt.NDArray[Any],
    low: float,
    full: float,
) -> tuple[npt.NDArray[np.bool_], float, float]:
    """f1 answers unless its top class probability is below −t; then f0 (all features)."""
    routed = -np.max(p1, axis=1) > t
    proba = np.where(routed[:, None], p0, p1)
    ok = np.asarray(classes[np.argmax(proba, axis=1)] == np.asarray(y), dtype=np.bool_)
    return ok, float(np.mean(routed)), low + float(np.mean(routed)) * (full - low)


def confidence_cascade(run_points: Sequence[SweepPoint], split: Split, f0: FittedF0) -> list[Ref]:
    """For every GreedyMiser fit: its f1 answers, except the items where f1's top class
    probability is lowest, which go to f0 (all features); the fraction routed is set on
    validation rows (``ROUTED_FRACTIONS``). Not a paper-001 method and not exportable as a
    gating bundle (the gate is f1's own confidence): the cascade a user would build by hand."""
    out = []
    p0_val = np.asarray(f0.model.predict_proba(split.X_val))
    p0_test = np.asarray(f0.model.predict_proba(split.X_test))
    for p in run_points:
        if p.method != "greedymiser":
            continue
        est = p.estimator
        low, full = float(est.low_cost_), float(est.full_cost_)
        conf_val = -np.max(est.f1_proba(split.X_val), axis=1)  # high = unsure
        p1_test = est.f1_proba(split.X_test)
        p1_val = est.f1_proba(split.X_val)
        for fraction in ROUTED_FRACTIONS:
            t = threshold_for_fraction(conf_val, fraction)
            val_ok, val_r, val_c = _fallback(
                p1_val, p0_val, split.y_val, t, est.classes_, low, full
            )
            test_ok, test_r, test_c = _fallback(
                p1_test, p0_test, split.y_test, t, est.classes_, low, full
            )
            out.append(
                Ref(
                    f"{p.id}-routed{fraction:g}",
                    float(val_ok.mean()),
                    val_c,
                    float(test_ok.mean()),
                    test_c,
                    val_r,
                    test_r,
                    test_ok,
                )
            )
    return out


def run_dataset(
    key: str,
    title: str,
    split: Split,
    *,
    grid: Sequence[Config],
    fixed_ks: Sequence[int],
    seed: int = 0,
    gbrt_params: dict[str, Any] | None = None,
    f0_grid: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> DatasetRun:
    start = time.perf_counter()
    Xtr, ytr = split.X_train, np.asarray(split.y_train)
    yv, yt = np.asarray(split.y_val), np.asarray(split.y_test)
    choice = tune_gbrt_f0(Xtr, ytr, split.X_val, yv, random_state=seed, **(f0_grid or F0_GRID))
    log(f"{key}: f0 {choice.describe()} ({time.perf_counter() - start:.0f} s)")
    f0 = FittedF0.fit(choice.estimator(), Xtr, ytr, random_state=seed)
    classes = np.unique(ytr)
    f0_val = float(np.mean(classes[f0.model.predict(split.X_val)] == yv))
    f0_test_correct = np.asarray(classes[f0.model.predict(split.X_test)] == yt, dtype=np.bool_)
    costs = np.ones(Xtr.shape[1])
    points = sweep(
        Xtr,
        ytr,
        split.X_val,
        yv,
        costs=costs,
        f0=f0,
        grid=grid,
        X_test=split.X_test,
        y_test=yt,
        gbrt_params=gbrt_params,
        random_state=seed,
    )
    log(f"{key}: sweep done ({time.perf_counter() - start:.0f} s)")
    run = DatasetRun(
        key,
        title,
        Xtr.shape[1],
        (len(ytr), len(yv), len(yt)),
        choice,
        f0_val,
        float(f0_test_correct.mean()),
        f0_test_correct,
        points,
        yt,
        split.X_test,
        0.0,
    )
    run.fixed = fixed_sets(split, f0, choice, fixed_ks, classes)
    run.cascade = confidence_cascade(points, split, f0)
    run.seconds = time.perf_counter() - start
    log(f"{key}: done ({run.seconds:.0f} s)")
    return run


def letter_binary(split: Split) -> Split:
    """The paper's binary Letters task: A–M vs N–Z."""

    def b(y: npt.NDArray[Any]) -> npt.NDArray[Any]:
        return np.where(np.asarray(y) >= "N", "N-Z", "A-M")

    return Split(
        split.X_train, b(split.y_train), split.X_val, b(split.y_val), split.X_test, b(split.y_test)
    )


# --------------------------------------------------------------------------- report


def plot(run: DatasetRun, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.8))
    for method in METHODS:
        front = run.frontier(method)
        if front:
            ax.plot(
                [p.test_cost for p in front],
                [p.test_accuracy for p in front],
                marker="o",
                ms=4,
                label=LABELS[method],
            )
    for refs, label, style in ((run.cascade, CASCADE, ":"), (run.fixed, FIXED, "--")):
        front_r = _ref_frontier(refs)
        if front_r:
            ax.plot(
                [r.test_cost for r in front_r],
                [r.test_accuracy for r in front_r],
                ls=style,
                marker="x",
                ms=4,
                color="grey" if refs is run.fixed else "tab:brown",
                label=label,
            )
    ax.scatter(
        [run.n_features],
        [run.f0_test],
        marker="*",
        s=160,
        color="black",
        label="f0 (tuned LightGBM, all features)",
        zorder=5,
    )
    ax.axhline(run.f0_test - TOLERANCE, color="grey", lw=0.8, ls="--", label="f0 − 1 point")
    lo = min(run.f0_test - 0.08, min((p.test_accuracy for p in run.points), default=0.0))
    ax.set_ylim(max(lo, run.f0_test - 0.15), run.f0_test + 0.02)
    ax.set_xlabel("average feature cost per test item (unit costs)")
    ax.set_ylabel("test accuracy (points chosen on validation)")
    ax.set_title(run.title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ci(correct: npt.NDArray[np.bool_]) -> str:
    lo, hi = wilson(int(correct.sum()), int(correct.size))
    return f"{correct.mean():.4f} [{lo:.3f}, {hi:.3f}]"


def _delta(correct: npt.NDArray[np.bool_], run: DatasetRun) -> str:
    d, lo, hi = paired_diff(correct, run.f0_test_correct)
    return f"{100 * d:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}]"


def _verdict(routed_test: float, gain: float) -> str:
    if routed_test <= 0.0:
        return "no: f1 alone answers"
    return f"yes: routes {routed_test:.1%}, {100 * gain:+.2f} points over its f1 alone"


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    order = np.argsort(xs)
    xa, ya = np.asarray(xs)[order], np.asarray(ys)[order]
    if x < xa[0] or x > xa[-1]:
        return math.nan
    return float(np.interp(x, xa, ya))


def matched_costs(run: DatasetRun, a: str, b: str, costs: Sequence[float]) -> list[str]:
    """Each method's test frontier (its validation Pareto points, test numbers), linearly
    interpolated at the same costs."""
    fa, fb = run.frontier(a), run.frontier(b)
    rows = []
    for c in costs:
        ya = _interp([p.test_cost for p in fa], [p.test_accuracy for p in fa], c)
        yb = _interp([p.test_cost for p in fb], [p.test_accuracy for p in fb], c)
        if math.isnan(ya) or math.isnan(yb):
            continue
        rows.append(f"| {c:g} | {ya:.4f} | {yb:.4f} | {100 * (ya - yb):+.2f} |")
    return rows


def report(runs: Sequence[DatasetRun], scope: str) -> list[str]:
    lines = [
        *prose(
            "gating",
            measured_at=measured_at(),
            machine=machine(),
            scope=scope,
            fractions=", ".join(f"{f:g}" for f in ROUTED_FRACTIONS),
        ),
        "",
    ]
    for run in runs:
        full = run.n_features
        best_f1 = max(run.points, key=lambda p: p.val_f1_accuracy)
        stronger = [p for p in run.points if p.val_f1_accuracy > run.f0_val]
        lines += [
            f"## {run.title}",
            "",
            f"Rows train / validation / test: {run.rows[0]} / {run.rows[1]} / {run.rows[2]}; "
            f"{full} features (unit costs). f0: {run.f0_choice.describe()}; test accuracy "
            f"{_ci(run.f0_test_correct)}. Run time {run.seconds:.0f} s.",
            "",
            f"f0 against every f1 of the sweep on validation: the strongest f1 is "
            f"{best_f1.id} at {best_f1.val_f1_accuracy:.4f} (f0 {run.f0_val:.4f}); "
            + (
                "f0 is never weaker."
                if not stronger
                else f"**{len({p.id.rsplit('-', 1)[0] for p in stronger})} f1 beat f0 on "
                f"validation** — f0 is not the strongest model here."
            ),
            "",
            "**Cheapest point within 1 point of f0**, chosen on validation, reported on test "
            "(accuracy with 95 % Wilson interval; Δ vs f0 in points with a 95 % paired "
            "bootstrap interval):",
            "",
            "| method | point | test cost (reduction) | test accuracy | Δ vs f0 | routed val / "
            "test | f1 alone (test) | gating contributes? |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for method in METHODS:
            p = run.within(method)
            if p is None:
                lines.append(f"| {LABELS[method]} | — never within 1 point on validation |||||||")
                continue
            c = run.correct(p)
            lines.append(
                f"| {LABELS[method]} | `{p.id}` | {p.test_cost:.2f} "
                f"({1 - p.test_cost / full:.0%} less) | {_ci(c)} | {_delta(c, run)} | "
                f"{p.val_fraction_full:.1%} / {p.test_fraction_full:.1%} | "
                f"{p.test_f1_accuracy:.4f} | "
                f"{_verdict(p.test_fraction_full, p.test_accuracy - p.test_f1_accuracy)} |"
            )
        for refs, label in ((run.cascade, CASCADE), (run.fixed, FIXED)):
            r = _ref_within(refs, run.f0_val)
            if r is None:
                lines.append(f"| {label} | — never within 1 point on validation |||||||")
                continue
            lines.append(
                f"| {label} | `{r.label}` | {r.test_cost:.2f} ({1 - r.test_cost / full:.0%} "
                f"less) | {_ci(r.test_correct)} | {_delta(r.test_correct, run)} | "
                f"{r.val_routed:.1%} / {r.test_routed:.1%} | | reference |"
            )
        if run.key in PAPER_REDUCTION:
            lines.append(
                f"| *paper, ADAPT-GBRT* | | *≈ {PAPER_REDUCTION[run.key]:.0%} less* ||||||"
            )
        grid_costs = sorted(
            {float(c) for c in np.linspace(1, full, num=min(full, 12), dtype=np.float64).round()}
        )
        matched = matched_costs(run, "adapt-gbrt", "greedymiser", grid_costs)
        lines += [
            "",
            "**ADAPT-GBRT vs GreedyMiser at matched cost** (each method's validation Pareto "
            "points, test numbers, linearly interpolated; at n = "
            f"{run.rows[2]} test rows a 95 % interval is about ±"
            f"{100 * 1.96 * math.sqrt(run.f0_test * (1 - run.f0_test) / run.rows[2]):.1f} "
            "points near f0's accuracy):",
            "",
            "| cost | ADAPT-GBRT | GreedyMiser | difference (points) |",
            "|---|---|---|---|",
            *(matched or ["| — | the frontiers do not overlap | | |"]),
            "",
            "Pareto points (validation Pareto set; test cost → test accuracy, routed to f0 "
            "validation / test):",
            "",
        ]
        for method in METHODS:
            pts = ", ".join(
                f"{p.test_cost:.2f}→{p.test_accuracy:.3f} "
                f"({p.val_fraction_full:.0%}/{p.test_fraction_full:.0%})"
                for p in run.frontier(method)
            )
            lines.append(f"- {LABELS[method]}: {pts}")
        for refs, label in ((run.cascade, CASCADE), (run.fixed, FIXED)):
            pts = ", ".join(
                f"{r.test_cost:.2f}→{r.test_accuracy:.3f} ({r.val_routed:.0%}/{r.test_routed:.0%})"
                for r in _ref_frontier(refs)
            )
            lines.append(f"- {label}: {pts}")
        lines += ["", f"![{run.title}](gating_{run.key}.png)", ""]
    return lines


DATASETS = ("letter-binary", "miniboone", "letter-26")


def main(out: Path = OUT, datasets: Sequence[str] = DATASETS) -> Path:
    unknown = sorted(set(datasets) - set(DATASETS))
    if unknown:
        raise ValueError(f"unknown data sets {unknown}; known: {list(DATASETS)}")
    out.mkdir(parents=True, exist_ok=True)
    runs: list[DatasetRun] = []
    letter = load_letter(DATA)
    if letter is not None and "letter-binary" in datasets:
        runs.append(
            run_dataset(
                "letter-binary",
                "Letters, binary (A–M vs N–Z)",
                letter_binary(letter[0]),
                grid=BENCH_GRID,
                gbrt_params=BENCH_GBRT,
                fixed_ks=(2, 4, 6, 8, 10, 12, 14),
            )
        )
    mb = load_miniboone(DATA)
    if mb is not None and "miniboone" in datasets:
        runs.append(
            run_dataset(
                "miniboone",
                "MiniBooNE sample (2k/1k/2k rows)",
                mb[0][0],
                grid=BENCH_GRID,
                gbrt_params=BENCH_GBRT,
                fixed_ks=(2, 5, 10, 15, 20, 30, 40),
            )
        )
    if letter is not None and "letter-26" in datasets:
        runs.append(
            run_dataset(
                "letter-26",
                "Letters, 26 classes",
                letter[0],
                grid=LETTER26_GRID,
                gbrt_params=LETTER26_GBRT,
                f0_grid=LETTER26_F0_GRID,
                fixed_ks=(6, 10, 14),
            )
        )
    for run in runs:
        plot(run, out / f"gating_{run.key}.png")
    path = out / "gating.md"
    if not runs:
        path.write_text("# Gating benchmark\n\nNo data set found under ../shared/datasets.\n")
        return path
    left_out = [d for d in DATASETS if d not in datasets]
    scope = (
        "all three data sets"
        if not left_out
        else f"{', '.join(r.key for r in runs)} only ({', '.join(left_out)} left out of this "
        "run to keep it under 25 minutes on the shared machine)"
    )
    path.write_text("\n".join(report(runs, scope)) + "\n")
    return path


# --------------------------------------------------------------------------------------------
# served: the gating bundle against the best fixed subset (issue 25)
# --------------------------------------------------------------------------------------------

SERVED_TASKS = ("letter-binary", "letter-binary-16", "miniboone", "letter", "pima")
#: The sweep of the served bundles, cut to fit the shared machine: ADAPT-GBRT and
#: GreedyMiser (the methods that take grouped sensors), 15 or 20 rounds of 10 trees.
SERVED_GRID = [
    {"method": "adapt-gbrt", "p_full": p, "regularisation": lam}
    for p in (0.1, 0.3)
    for lam in (1e-3, 1e-2)
] + [{"method": "greedymiser", "p_full": 0.0, "regularisation": lam} for lam in (1e-3, 1e-2, 0.1)]


def gating_spec(task: Any) -> Any:
    """The gating spec of a served task, per split seed."""
    from training.bundles.gating import GatingSpec

    many = task.key == "letter"

    def make(name: str, seed: int) -> Any:
        return GatingSpec(
            name=name,
            label="label",
            sensors=task.sensors,
            costs=task.costs,
            grid=SERVED_GRID,
            f0="lightgbm" if many else "lightgbm-tuned",
            gbrt={"n_rounds": 15 if many else 20},
            fixed=served.FIXED_26 if many else None,
            seed=seed,
        )

    return make


def f1_alone(result: Any, point_id: str, x: Any) -> Any:
    """The served point's f1 alone on rows ``x`` (None: not a gating point with a gate)."""
    from training.export.gating import system_outputs

    est = result.estimators.get(point_id)
    if est is None or point_id == "f0":
        return None
    proba = system_outputs(est, np.asarray(x, dtype=np.float64))[1]
    return est.classes_[np.argmax(proba, axis=1)]


def routing_lines(res: Any) -> list[str]:
    """Issue 25's routing goal: a served budget whose point sends >= 5 % of the items on,
    against its f1 alone on the same rows."""
    from benchmarks.served import diff_interval

    lines = []
    for b in res.task.budgets:
        routed = float(np.mean(res.routed[b]))
        if routed <= 0:
            continue
        if b not in res.f1_right:
            lines.append(
                f"* Budget {b:g}: {100 * routed:.1f} % of the answers were routed, by a point "
                "that is not the same on every split seed (no one f1 to compare with)."
            )
            continue
        d, lo, hi = diff_interval(res.right[b], res.f1_right[b])
        point = res.points[b].most_common(1)[0][0]
        lines.append(
            f"* Budget {b:g}: `{point}` sends {100 * routed:.1f} % of the items on; served "
            f"{100 * res.accuracy(b):.2f} % against its f1 alone "
            f"{100 * res.f1_right[b].mean():.2f} % ({100 * d:+.2f} points, "
            f"95 % CI [{100 * lo:+.2f}, {100 * hi:+.2f}]"
            + ("; beats f1 alone by more than the interval" if lo > 0 else "")
            + ")."
        )
    met = any(
        float(np.mean(res.routed[b])) >= 0.05
        and b in res.f1_right
        and diff_interval(res.right[b], res.f1_right[b])[1] > 0
        for b in res.task.budgets
    )
    head = (
        f"Routing goal (≥ 5 % routed at some served budget, beating its f1 alone by more than "
        f"the interval) on {res.task.key}: **{'met' if met else 'missed'}**."
    )
    return [head, "", *(lines or ["* No served budget chose a point that routes."]), ""]


def served_main(keys: Sequence[str] = SERVED_TASKS, out: Path = OUT) -> Path:
    """Build gating bundles with the real builder, serve them over HTTP with every sensor read
    from Redis, and compare with the best fixed subset at every budget: ``gating_served.md``."""
    from training.bundles.gating import build_gating_bundle

    found, skipped = served.tasks(keys)
    runs = [
        served.Run(task, "gating", gating_spec(task), build_gating_bundle, {"f1_alone": f1_alone})
        for task in found
    ]
    return served.write_report(
        "gating",
        "Gating bundles served over HTTP against the best fixed sensor subset (issue 25)",
        "gating bundle",
        runs,
        skipped,
        out,
        routing_lines,
    )


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default=None)
    parser.add_argument(
        "--served",
        action="store_true",
        help="the gating bundle served against the best fixed subset (gating_served.md); "
        "--datasets picks tasks (letter-binary,letter-binary-16,miniboone,letter,pima)",
    )
    args = parser.parse_args()
    if args.served:
        picked = args.datasets.split(",") if args.datasets else SERVED_TASKS
        print(served_main([d for d in picked if d]))
    else:
        picked = args.datasets.split(",") if args.datasets else DATASETS
        print(main(datasets=[d for d in picked if d]))
