"""Cost-sensitive trees and cascades (paper 003): CSTC, CSCC and Cronus against what a user
would run instead, on the quadrant oracle, a synthetic imbalanced cascade, letter ("A" vs
rest at 1:100, and 26 classes) and the MiniBooNE sample with Yahoo feature costs.

``python -m benchmarks.cstc [--datasets quadrants,cascade,letter-a,letter-26,miniboone]``
writes ``docs/benchmarks/cstc.md`` and one plot per data set. Every number is on test rows
that took no part in training or in any choice (points are chosen on validation rows).

The module stays whole (over 450 lines): the data sets, each method's sweep, the choice on
validation and the report (with the served variant's entry point) are one experiment over
shared result types.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import numpy.typing as npt
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LinearRegression, LogisticRegression
from sklearn.metrics import balanced_accuracy_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from benchmarks import served
from benchmarks.report import OUT, machine, measured_at, prose
from training.cstc import CSTCClassifier, CSTCRegressor
from training.cstc.synthetic import QUADRANT_COSTS, imbalanced_cascade, quadrants
from training.data.uci import DATA, Split, load_letter, load_miniboone

Array = npt.NDArray[np.float64]
DATASETS = ("quadrants", "cascade", "letter-a", "letter-26", "miniboone")
LAMBDAS = (0.001, 0.003, 0.01, 0.03, 0.1)
LETTER26_TRAIN = 4000


@dataclass
class Row:
    method: str
    setting: str
    val_score: float
    val_cost: float
    test_score: float
    test_cost: float
    nodes: int = 0


def _score_fn(metric: str) -> Callable[[Any, Any], float]:
    if metric == "balanced accuracy":
        return lambda y, p: float(balanced_accuracy_score(y, p))
    return lambda y, p: float(np.mean(np.asarray(y) == np.asarray(p)))


def _tree_rows(
    split: Split,
    methods: Sequence[str],
    costs: Array,
    metric: str,
    lambdas: Sequence[float] = LAMBDAS,
    **kw: Any,
) -> list[Row]:
    """Fit every (method, λ); costs are normalised to mean 1 for training (λ keeps one
    meaning across data sets) and reported in their own units."""
    score = _score_fn(metric)
    scale = float(np.mean(costs))
    rows = []
    for method in methods:
        for lam in lambdas:
            est = CSTCClassifier(
                costs=costs / scale,
                lam=lam,
                depth=1 if method == "root-only" else kw.get("depth", 3),
                structure="cascade" if method in ("cscc", "cronus") else "tree",
                cost_model="cronus" if method == "cronus" else "paths",
                sharpness=kw.get("sharpness", 10.0),
                class_weight=kw.get("class_weight"),
                n_rounds=kw.get("n_rounds", 2),
            ).fit(split.X_train, split.y_train)
            rows.append(
                Row(
                    method,
                    f"λ={lam:g}",
                    score(split.y_val, est.predict(split.X_val)),
                    est.average_cost(split.X_val) * scale,
                    score(split.y_test, est.predict(split.X_test)),
                    est.average_cost(split.X_test) * scale,
                    len(est.nodes_),
                )
            )
    return rows


def _static_rows(split: Split, costs: Array, metric: str, balanced: bool = False) -> list[Row]:
    """What a user runs instead: logistic regression and gradient boosting on all features."""
    score = _score_fn(metric)
    full = float(costs.sum())
    cw = "balanced" if balanced else None
    out = []
    for name, model in (
        (
            "logistic regression, all features",
            make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, class_weight=cw)),
        ),
        (
            "HistGradientBoosting, all features",
            HistGradientBoostingClassifier(random_state=0, class_weight=cw),
        ),
    ):
        model.fit(split.X_train, split.y_train)
        out.append(
            Row(
                name,
                "",
                score(split.y_val, model.predict(split.X_val)),
                full,
                score(split.y_test, model.predict(split.X_test)),
                full,
            )
        )
    return out


def _early_exit_rows(split: Split, costs: Array, metric: str, balanced: bool = False) -> list[Row]:
    """A confidence-threshold early-exit cascade: logistic regressions on growing prefixes of
    the features (ordered by |coefficient| of a full model on standardised features, per
    unit cost); an item leaves at the first stage whose top probability reaches τ."""
    score = _score_fn(metric)
    cw = "balanced" if balanced else None
    Z = StandardScaler().fit_transform(split.X_train)
    full = LogisticRegression(max_iter=2000, class_weight=cw).fit(Z, split.y_train)
    order = np.argsort(-np.abs(full.coef_).sum(axis=0) / costs)
    d = len(costs)
    sizes = sorted({max(1, d // 8), max(1, d // 4), max(1, d // 2), d})
    stages = []
    for m in sizes:
        cols = order[:m]
        model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, class_weight=cw))
        model.fit(split.X_train[:, cols], split.y_train)
        stages.append((cols, model))

    def run(X: Array, tau: float) -> tuple[npt.NDArray[Any], float]:
        n = len(X)
        pred = np.empty(n, dtype=object)
        cost = np.zeros(n)
        open_ = np.ones(n, dtype=bool)
        for i, (cols, model) in enumerate(stages):
            proba = model.predict_proba(X[:, cols])
            cost[open_] = costs[cols].sum()
            leave = open_ & ((proba.max(axis=1) >= tau) | (i == len(stages) - 1))
            pred[leave] = model.classes_[proba[leave].argmax(axis=1)]
            open_ &= ~leave
        return pred, float(cost.mean())

    out = []
    for tau in (0.6, 0.8, 0.9, 0.95, 0.99, 0.999):
        pv, cv = run(split.X_val, tau)
        pt, ct = run(split.X_test, tau)
        out.append(
            Row(
                "confidence early exit",
                f"τ={tau:g}",
                score(split.y_val, pv.astype(split.y_val.dtype)),
                cv,
                score(split.y_test, pt.astype(split.y_test.dtype)),
                ct,
            )
        )
    return out


def pareto(rows: Sequence[Row]) -> list[Row]:
    """Validation Pareto set (cost ascending, score strictly rising)."""
    out: list[Row] = []
    for r in sorted(rows, key=lambda r: (r.val_cost, -r.val_score)):
        if not out or r.val_score > out[-1].val_score:
            out.append(r)
    return out


def _table(rows: Sequence[Row], metric: str, unit: str) -> list[str]:
    lines = [
        f"| method | setting | nodes | val {metric} | val cost ({unit}) | **test {metric}** "
        f"| **test cost** | on the val front |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fronts: dict[str, list[Row]] = {}
    for r in rows:
        fronts.setdefault(r.method, []).append(r)
    kept = {id(r) for group in fronts.values() for r in pareto(group)}
    for r in rows:
        lines.append(
            f"| {r.method} | {r.setting} | {r.nodes or ''} | {r.val_score:.4f} | "
            f"{r.val_cost:.2f} | **{r.test_score:.4f}** | **{r.test_cost:.2f}** | "
            f"{'yes' if id(r) in kept else ''} |"
        )
    return lines


def _plot(name: str, rows: Sequence[Row], metric: str, unit: str, title: str) -> str:
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.method, []).append(r)
    for method, group in groups.items():
        front = pareto(group)
        xs = [r.test_cost for r in front]
        ys = [r.test_score for r in front]
        style = "o-" if len(front) > 1 else "s"
        ax.plot(xs, ys, style, label=method, markersize=5)
    ax.set_xlabel(f"average feature cost per item ({unit}, test rows)")
    ax.set_ylabel(f"test {metric}")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    file = f"cstc_{name}.png"
    fig.savefig(OUT / file, dpi=110)
    plt.close(fig)
    return file


def _best_at(rows: Sequence[Row], method: str, budget: float) -> Row | None:
    """The validation-front point of ``method`` with the best validation score whose
    validation cost fits ``budget``."""
    front = [r for r in pareto([r for r in rows if r.method == method]) if r.val_cost <= budget]
    return max(front, key=lambda r: r.val_score) if front else None


# ------------------------------------------------------------------------------- data sets


def run_quadrants() -> tuple[list[str], dict[str, Any]]:
    X, y = quadrants(2000, seed=0)
    Xt, yt = quadrants(2000, seed=1)
    lines = [
        "| model | test MSE | average cost | root reads | leaves read |",
        "|---|---|---|---|---|",
    ]
    names = ["z++", "z+-", "z-+", "z--", "sign x", "sign z"]
    for label, kw in (
        ("CSTC (λ = 0.03, depth 3)", {}),
        ("CSTC without the polish step", {"polish": False}),
        ("single cost-sensitive regressor (root only)", {"depth": 1}),
    ):
        params: dict[str, Any] = {
            "costs": QUADRANT_COSTS,
            "lam": 0.03,
            "rho": 0.01,
            "depth": 3,
            "sharpness": 5.0,
            "n_rounds": 3,
            "standardize": False,
        }
        params.update(kw)
        est = CSTCRegressor(**params).fit(X, y)
        mse = float(np.mean((est.predict(Xt) - yt) ** 2))
        nodes = est.export_nodes_
        leaves = [nd for nd in nodes if not nd.routes]
        lines.append(
            f"| {label} | {mse:.4f} | {est.average_cost(Xt):.2f} | "
            f"{', '.join(names[c] for c in nodes[0].columns) or '—'} | "
            f"{'; '.join(', '.join(names[c] for c in nd.columns) for nd in leaves)} |"
        )
    lr = LinearRegression().fit(X, y)
    mse = float(np.mean((lr.predict(Xt) - yt) ** 2))
    lines.append(f"| linear regression, all features | {mse:.4f} | 42.00 | all | — |")
    return lines, {}


def run_cascade() -> tuple[list[str], dict[str, Any]]:
    X, y = imbalanced_cascade(4000, seed=0)
    Xv, yv = imbalanced_cascade(2000, seed=2)
    Xt, yt = imbalanced_cascade(4000, seed=1)
    split = Split(X, y, Xv, yv, Xt, yt)
    costs = np.asarray([1.0, 10.0, 10.0, 10.0])
    rows = _tree_rows(
        split,
        ("cscc", "cronus", "cstc"),
        costs,
        "accuracy",
        (0.001, 0.01, 0.03, 0.1),
        sharpness=20.0,
    )
    rows += _static_rows(split, costs, "accuracy")
    rows += _early_exit_rows(split, costs, "accuracy")
    plot = _plot("cascade", rows, "accuracy", "units", "synthetic 1:19 cascade (costs 1,10,10,10)")
    return [*_table(rows, "accuracy", "units"), "", f"![cascade]({plot})"], {}


def _letter_a(split: Split, ratio: int = 100, seed: int = 0) -> Split:
    """'A' vs the rest, positives subsampled to 1 per ``ratio`` negatives in every part."""
    rng = np.random.default_rng(seed)

    def part(X: Array, y: npt.NDArray[Any]) -> tuple[Array, npt.NDArray[Any]]:
        pos = np.flatnonzero(y == "A")
        neg = np.flatnonzero(y != "A")
        keep = rng.choice(pos, size=max(1, len(neg) // ratio), replace=False)
        idx = np.sort(np.concatenate([neg, keep]))
        return X[idx], (y[idx] == "A").astype(int)

    a, b = part(split.X_train, split.y_train)
    c, d = part(split.X_val, split.y_val)
    e, f = part(split.X_test, split.y_test)
    return Split(a, b, c, d, e, f)


def run_letter_a() -> tuple[list[str], dict[str, Any]]:
    splits = load_letter(DATA)
    if splits is None:
        return ["letter is missing from ../shared/datasets/: skipped."], {}
    split = _letter_a(splits[0])
    costs = np.ones(16)
    metric = "balanced accuracy"
    rows = _tree_rows(
        split, ("cscc", "cronus"), costs, metric, (0.003, 0.03, 0.1), class_weight="balanced"
    )
    rows += _static_rows(split, costs, metric, balanced=True)
    rows += _early_exit_rows(split, costs, metric, balanced=True)
    plot = _plot("letter-a", rows, metric, "features", "letter 'A' vs rest, 1:100 (unit costs)")
    counts = (
        f"train {len(split.y_train)} rows ({int(split.y_train.sum())} positives), "
        f"test {len(split.y_test)} ({int(split.y_test.sum())} positives)"
    )
    return [counts, "", *_table(rows, metric, "features"), "", f"![letter-a]({plot})"], {}


def run_letter_26() -> tuple[list[str], dict[str, Any]]:
    splits = load_letter(DATA)
    if splits is None:
        return ["letter is missing from ../shared/datasets/: skipped."], {}
    full = splits[0]
    # Time box: the trees train on the first LETTER26_TRAIN of the 12,000 training rows (the
    # references on all of them); validation and test rows are the usual 4,000 + 4,000.
    split = Split(
        full.X_train[:LETTER26_TRAIN],
        full.y_train[:LETTER26_TRAIN],
        full.X_val,
        full.y_val,
        full.X_test,
        full.y_test,
    )
    costs = np.ones(16)
    rows = _tree_rows(split, ("cstc", "root-only"), costs, "accuracy", (0.001, 0.01))
    split = full
    rows += _static_rows(split, costs, "accuracy")
    plot = _plot("letter-26", rows, "accuracy", "features", "letter, 26 classes (unit costs)")
    return [*_table(rows, "accuracy", "features"), "", f"![letter-26]({plot})"], {}


def run_miniboone() -> tuple[list[str], dict[str, Any]]:
    loaded = load_miniboone(DATA)
    yahoo = DATA / "yahoo-costs" / "yahoo_cs_cost"
    if loaded is None or not yahoo.is_file():
        return ["MiniBooNE sample or Yahoo costs missing: skipped."], {}
    split = loaded[0][0]
    profile = np.loadtxt(yahoo)
    costs = np.random.default_rng(0).choice(profile, size=split.X_train.shape[1], replace=False)
    rows = _tree_rows(split, ("cstc", "cscc", "root-only"), costs, "accuracy", (0.001, 0.01, 0.1))
    rows += _static_rows(split, costs, "accuracy")
    rows += _early_exit_rows(split, costs, "accuracy")
    plot = _plot("miniboone", rows, "accuracy", "Yahoo cost units", "MiniBooNE sample, Yahoo costs")
    note = (
        f"Feature costs: 50 draws without replacement from the 519 Yahoo costs (seed 0): "
        f"sum {costs.sum():.0f}, values {sorted({int(c) for c in costs})}."
    )
    return [note, "", *_table(rows, "accuracy", "Yahoo units"), "", f"![miniboone]({plot})"], {}


RUNNERS: dict[str, tuple[str, Callable[[], tuple[list[str], dict[str, Any]]]]] = {
    "quadrants": ("The quadrant oracle (§6.1)", run_quadrants),
    "cascade": ("A synthetic imbalanced cascade (known answer)", run_cascade),
    "letter-a": ("letter, 'A' vs the rest at 1:100 (CSCC vs Cronus vs early exit)", run_letter_a),
    "letter-26": ("letter, 26 classes (CSTC)", run_letter_26),
    "miniboone": ("MiniBooNE sample with Yahoo feature costs", run_miniboone),
}


# --------------------------------------------------------------------------------------------
# served: the CSTC bundle against the best fixed subset (issue 25)
# --------------------------------------------------------------------------------------------

SERVED_TASKS = ("letter", "letter-16", "miniboone", "pima", "letter-a")


def cstc_spec(task: Any, methods: Sequence[str]) -> Callable[[str, int], Any]:
    """The CSTC spec of a served task, per split seed: tuned node models, the fixed subsets
    beside the points."""
    from training.bundles.cstc import CstcSpec

    lambdas = {
        "letter": [0.003, 0.03, 0.3],
        "letter-16": [0.003, 0.03, 0.3],
        "miniboone": [0.001, 0.01, 0.1],
    }.get(task.key, [0.001, 0.01, 0.1, 1.0])

    def make(name: str, seed: int) -> Any:
        return CstcSpec(
            name=name,
            label="label",
            sensors=task.sensors,
            costs=task.costs,
            methods=list(methods),
            lambdas=lambdas,
            fixed=served.FIXED_26 if task.key in ("letter", "letter-16") else None,
            seed=seed,
        )

    return make


def served_main(keys: Sequence[str] = SERVED_TASKS, out: Path = OUT) -> Path:
    """Build CSTC / CSCC bundles with the real builder, serve them over HTTP with every
    sensor read from Redis, and compare with the best fixed subset at every budget
    (``cstc_served.md``); on letter-A, CSCC's and Cronus's cascades are served without the
    fixed subsets, against each other."""
    from training.bundles.cstc import build_cstc_bundle

    found, skipped = served.tasks(keys)
    runs = []
    for task in found:
        if task.key == "letter-a":
            for method in ("cscc", "cronus"):
                runs.append(
                    served.Run(
                        task,
                        f"{method} (cascade alone)",
                        cstc_spec(task, [method]),
                        build_cstc_bundle,
                        {"adaptive_only": True, "variants": (served.Variant(""),)},
                    )
                )
            continue
        methods = ["cstc", "cscc", "root-only"] if task.key == "pima" else ["cstc", "root-only"]
        runs.append(
            served.Run(
                task,
                "CSTC",
                cstc_spec(task, methods),
                build_cstc_bundle,
                {"notes": _tree_notes},
            )
        )
    return served.write_report(
        "cstc",
        "CSTC / CSCC bundles served over HTTP against the best fixed sensor subset (issue 25)",
        "CSTC bundle",
        runs,
        skipped,
        out,
        _balanced_lines,
    )


def _tree_notes(result: Any, task: Any, share: float = 0.6) -> list[str]:
    """The trees' own points (``cstc``, ``cstc-exit``) in the bundle: the one chosen on
    validation (the best validation accuracy at a validation cost within ``share`` of every
    sensor's cost) and its test numbers from the build's sweep (walks equal to the served
    ones: ``tests/service/test_cstc_service.py``)."""
    sweep = result.manifest.provenance.parameters["sweep"]
    kept = {p.id for s in result.manifest.strategies for p in getattr(s, "points", [])}
    trees = [r for r in sweep if r["method"] in ("cstc", "cstc-exit") and r["id"] in kept]
    if not trees:
        return ["No tree point is in the bundle (none on the validation Pareto set)."]
    cap = share * task.full_cost
    fits = [r for r in trees if r["validation_cost"] <= cap + 1e-9]
    line = (
        f"Tree points in the bundle: {len(trees)} "
        f"({sum(r['method'] == 'cstc-exit' for r in trees)} with confidence exits). "
    )
    if not fits:
        return [line + f"None costs at most {100 * share:.0f} % of every sensor's cost ({cap:g})."]
    best = max(fits, key=lambda r: (r["validation_accuracy"], -r["validation_cost"]))
    return [
        line + f"At most {100 * share:.0f} % of every sensor's cost ({cap:g}), the tree point "
        f"chosen on validation is `{best['id']}`: test {100 * best['test_accuracy']:.2f} % at "
        f"an average cost of {best['test_cost']:.2f} (validation "
        f"{100 * best['validation_accuracy']:.2f} % at {best['validation_cost']:.2f}; from the "
        "build's sweep: the point pinned alone, its walks the served ones)."
    ]


def _balanced_lines(res: Any) -> list[str]:
    """Letter 'A': the balanced accuracy at each budget (the offline benchmark's metric)."""
    from benchmarks.served import balanced

    if res.task.key != "letter-a":
        return []
    cells = ", ".join(
        f"{b:g}: {100 * balanced(res.right[b], res.labels):.2f} % at {res.spent[b].mean():.2f}"
        for b in res.task.budgets
    )
    return [f"Balanced accuracy (budget: served, average spent): {cells}.", ""]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--datasets", default=None)
    parser.add_argument(
        "--served",
        action="store_true",
        help="the CSTC bundle served against the best fixed subset (cstc_served.md); "
        "--datasets picks tasks (letter,letter-16,miniboone,pima,letter-a)",
    )
    args = parser.parse_args(argv)
    if args.served:
        picked = args.datasets.split(",") if args.datasets else SERVED_TASKS
        print(served_main([d for d in picked if d]))
        return
    chosen = [d for d in (args.datasets or ",".join(DATASETS)).split(",") if d]
    unknown = [d for d in chosen if d not in RUNNERS]
    if unknown:
        raise SystemExit(f"unknown data sets {unknown}; known: {list(RUNNERS)}")
    OUT.mkdir(parents=True, exist_ok=True)
    lines = prose("cstc", measured_at=measured_at(), machine=machine(), scope=", ".join(chosen))
    t_all = time.perf_counter()
    for name in chosen:
        title, run = RUNNERS[name]
        t0 = time.perf_counter()
        body, _ = run()
        lines += ["", f"## {title}", "", *body, "", f"({time.perf_counter() - t0:.0f} s)"]
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    lines += ["", *prose("cstc", "after", total=f"{time.perf_counter() - t_all:.0f}")]
    (OUT / "cstc.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
