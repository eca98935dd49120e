"""Tables with gaps: the three tabular builders (DAG, gating, CSTC) on pima with a tenth of its
feature cells blanked at random, served with the gaps left in the held-out rows.

``python -m benchmarks.tabular_gaps`` blanks 10 % of pima's feature cells (seeded; half written
empty, half ``NA``), builds each bundle with the README's spec plus ``impute: median``, and
sends every held-out row through the real app (``service.http.create_app``) with its gaps as
JSON ``null`` at the full budget: a gap is a sensor not sent, so the strategy answers from what
is in hand. Compared, on the same rows, with what a user would run instead: scikit-learn's
``HistGradientBoostingClassifier`` (takes gaps natively) and a median-imputed logistic
regression, on every feature. Writes ``docs/benchmarks/tabular_gaps.md``.
"""

from __future__ import annotations

import csv
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import OUT, ROOT, machine, measured_at, prose, wilson
from training.data.tabular import TabularSpec, read_csv

PIMA = ROOT.parent / "shared" / "datasets" / "pima" / "pima-indians-diabetes.csv"
WORK = ROOT / ".bench-tmp" / "tabular-gaps"
COLUMNS = ["pregnancies", "glucose", "pressure", "skin", "insulin", "bmi", "pedigree", "age"]
ONE_EACH = {c: [c] for c in COLUMNS}
COST_EACH = {"pregnancies": 1, "age": 1, "pedigree": 1, "pressure": 2, "bmi": 2, "skin": 2}
COST_EACH |= {"glucose": 5, "insulin": 10}
COMMON: dict[str, Any] = {
    "label": "outcome",
    "columns": [*COLUMNS, "outcome"],
    "unit": "units",
    "impute": "median",
}
SPECS: dict[str, dict[str, Any]] = {
    "dag": {
        "name": "pima-gaps-dag",
        "sensors": {
            "questionnaire": ["pregnancies", "age", "pedigree"],
            "vitals": ["pressure", "bmi", "skin"],
            "glucose": ["glucose"],
            "insulin": ["insulin"],
        },
        "costs": {"questionnaire": 1, "vitals": 2, "glucose": 5, "insulin": 10},
        "cost_scales": [0, 0.003, 0.01, 0.03, 0.1],
        "learner": "poly2",
        "policy_learner": "linear",
    },
    "gating": {"name": "pima-gaps-gating", "sensors": ONE_EACH, "costs": COST_EACH},
    "cstc": {
        "name": "pima-gaps-cstc",
        "sensors": ONE_EACH,
        "costs": COST_EACH,
        "lambdas": [0.001, 0.01, 0.03, 0.1],
    },
}


def blank(source: Path, target: Path, fraction: float = 0.1, seed: int = 0) -> int:
    """Copy pima with ``fraction`` of its feature cells blanked (empty or NA); the count."""
    rows = [r for r in csv.reader(source.read_text().splitlines()) if r]
    rng = np.random.default_rng(seed)
    gaps = rng.random((len(rows), len(COLUMNS))) < fraction
    for i, row in enumerate(rows):
        for j in np.flatnonzero(gaps[i]):
            row[j] = "" if (i + j) % 2 else "NA"
    target.write_text("\n".join(",".join(r) for r in rows) + "\n")
    return int(gaps.sum())


@dataclass
class Outcome:
    builder: str
    build_s: float
    budget: float
    items: int
    with_gaps: int
    accuracy: float
    interval: tuple[float, float]
    answered_short: int  # answers with a next_sensor (a wanted sensor was a gap)
    statuses: dict[int, int]
    mean_spent: float


def _builders() -> dict[str, tuple[Callable[[dict[str, Any]], TabularSpec], Callable[..., Any]]]:
    from training.bundles.cstc import CstcSpec, build_cstc_bundle
    from training.bundles.dag import DagSpec, build_dag_bundle
    from training.bundles.gating import GatingSpec, build_gating_bundle

    def make(cls: type[TabularSpec]) -> Callable[[dict[str, Any]], TabularSpec]:
        def spec(raw: dict[str, Any]) -> TabularSpec:
            made = cls(**raw)
            made.check()
            return made

        return spec

    return {
        "dag": (make(DagSpec), build_dag_bundle),
        "gating": (make(GatingSpec), build_gating_bundle),
        "cstc": (make(CstcSpec), build_cstc_bundle),
    }


def run_builder(name: str, csv_path: Path, models: Path) -> tuple[Outcome, TabularSpec]:
    from fastapi.testclient import TestClient

    from service.cache import InProcessCache
    from service.http import create_app
    from service.settings import Settings

    make_spec, build = _builders()[name]
    spec = make_spec(COMMON | SPECS[name])
    x, y, columns = read_csv(csv_path, spec)
    start = time.perf_counter()
    build(models / spec.name, spec, x, y, columns)
    build_s = time.perf_counter() - start
    test = spec.split_indices(y)[2]
    budget = float(sum(spec.sensor_costs().values()))
    statuses: dict[int, int] = {}
    right = short = 0
    spent = []
    app = create_app(Settings(models_dir=models), cache=InProcessCache(1 << 20))
    with TestClient(app) as client:
        for row in test:
            values = {
                c: None if math.isnan(v) else float(v) for c, v in zip(columns, x[row], strict=True)
            }
            r = client.post(
                "/predict",
                json={"model": spec.name, "budget": budget, "item": {"values": values}},
            )
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code != 200:
                continue
            body = r.json()
            right += body["prediction"] == y[row]
            short += body["next_sensor"] is not None
            spent.append(body["cost"]["spent"])
    gappy = int(np.isnan(x[test]).any(axis=1).sum())
    return (
        Outcome(
            name,
            build_s,
            budget,
            len(test),
            gappy,
            right / len(test),
            wilson(right, len(test)),
            short,
            statuses,
            float(np.mean(spent)) if spent else math.nan,
        ),
        spec,
    )


def baselines(csv_path: Path, spec: TabularSpec) -> dict[str, float]:
    """What a user would run instead, on the same train and test rows, every feature."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.impute import SimpleImputer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x, y, _ = read_csv(csv_path, spec)
    train, val, test = spec.split_indices(y)
    fit = np.concatenate([train, val])
    models = {
        "HistGradientBoosting (gaps natively)": HistGradientBoostingClassifier(random_state=0),
        "logistic regression (median-imputed)": make_pipeline(
            SimpleImputer(strategy="median"), StandardScaler(), LogisticRegression(max_iter=1000)
        ),
    }
    return {
        name: float(np.mean(model.fit(x[fit], y[fit]).predict(x[test]) == y[test]))
        for name, model in models.items()
    }


def main(argv: Sequence[str] | None = None) -> Path:
    shutil.rmtree(WORK, ignore_errors=True)
    (WORK / "models").mkdir(parents=True)
    csv_path = WORK / "pima-gaps.csv"
    blanked = blank(PIMA, csv_path)
    outcomes = []
    spec = None
    for name in SPECS:
        outcome, spec = run_builder(name, csv_path, WORK / "models")
        outcomes.append(outcome)
    assert spec is not None
    base = baselines(csv_path, spec)
    lines = prose(
        "tabular_gaps",
        measured_at=measured_at(),
        machine=machine(),
        blanked=blanked,
        cells=768 * len(COLUMNS),
        share=f"{blanked / (768 * len(COLUMNS)):.1%}",
    )
    lines += [
        "",
        "| builder | build s | held-out rows | with a gap | budget | accuracy [95 %] | "
        "answered with a next_sensor | mean spent | HTTP statuses |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(o.statuses.items()))
        lines.append(
            f"| {o.builder} | {o.build_s:.0f} | {o.items} | {o.with_gaps} | {o.budget:g} | "
            f"{o.accuracy:.3f} [{o.interval[0]:.3f}, {o.interval[1]:.3f}] | {o.answered_short} | "
            f"{o.mean_spent:.2f} | {statuses} |"
        )
    lines += prose("tabular_gaps", "baselines")
    lines += ["", "| instead | accuracy |", "|---|---|"]
    lines += [f"| {name} | {acc:.3f} |" for name, acc in base.items()]
    lines += prose("tabular_gaps", "after")
    path = OUT / "tabular_gaps.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
