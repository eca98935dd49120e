"""The UCI data sets the benchmarks read (letter, pima, a MiniBooNE sample), as train /
validation / test :class:`Split` s. Data are read from ``../shared/datasets/`` relative to the
repository root; a loader returns None when its files are missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.model_selection import StratifiedKFold, train_test_split

from service.types import FloatArray

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "datasets"
RANDOM_STATE = 0


@dataclass
class Split:
    """One train / validation / test split."""

    X_train: FloatArray
    y_train: npt.NDArray[Any]
    X_val: FloatArray
    y_val: npt.NDArray[Any]
    X_test: FloatArray
    y_test: npt.NDArray[Any]


def _read_letter(root: Path) -> tuple[FloatArray, npt.NDArray[Any]] | None:
    path = root / "letter" / "letter-recognition.data"
    if not path.is_file():
        return None
    raw = np.genfromtxt(path, delimiter=",", skip_header=1, dtype=str)
    return raw[:, 1:].astype(np.float64), raw[:, 0]


#: letter attributes (UCI letter-recognition.names), 0-based columns, grouped by what they
#: measure.
LETTER_SENSORS: dict[str, list[int]] = {
    "box": [0, 1, 2, 3],  # x-box, y-box, width, high: position and size of the bounding box
    "ink": [4, 5, 6, 9],  # onpix, x-bar, y-bar, xybar: pixel count, mean position, x-y corr.
    "moments": [7, 8, 10, 11],  # x2bar, y2bar, x2ybr, xy2br: 2nd (variances) and 3rd moments
    "edges": [12, 13, 14, 15],  # x-ege, xegvy, y-ege, yegvx: edge counts and their correlations
}
LETTER_NAMES = [
    "x-box",
    "y-box",
    "width",
    "high",
    "onpix",
    "x-bar",
    "y-bar",
    "x2bar",
    "y2bar",
    "xybar",
    "x2ybr",
    "xy2br",
    "x-ege",
    "xegvy",
    "y-ege",
    "yegvx",
]

#: pima columns (pima-indians-diabetes.names), grouped by how a clinic obtains them.
PIMA_SENSORS: dict[str, list[int]] = {
    "history": [0, 6, 7],  # pregnancies, diabetes pedigree function, age: questionnaire/records
    "exam": [2, 3, 5],  # diastolic blood pressure, triceps skin fold, BMI: physical exam
    "glucose": [1],  # plasma glucose 2 h into an oral glucose tolerance test: lab test
    "insulin": [4],  # 2-hour serum insulin: lab test
}
PIMA_NAMES = [
    "pregnancies",
    "glucose (OGTT)",
    "blood pressure",
    "skin fold",
    "insulin",
    "BMI",
    "pedigree",
    "age",
]


def load_letter(root: Path = DATA) -> list[Split] | None:
    """letter: first 12,000 rows train, next 4,000 validation (together the usual 16,000-row
    training split), last 4,000 test."""
    data = _read_letter(root)
    if data is None:
        return None
    X, y = data
    return [Split(X[:12000], y[:12000], X[12000:16000], y[12000:16000], X[16000:], y[16000:])]


def load_pima(root: Path = DATA, folds: int = 5) -> list[Split] | None:
    """pima: ``folds`` stratified outer folds as test sets (every row tested once); the rest is
    split 75 / 25 (stratified) into train and validation."""
    path = root / "pima" / "pima-indians-diabetes.csv"
    if not path.is_file():
        return None
    raw = np.loadtxt(path, delimiter=",")
    X, y = raw[:, :8], raw[:, 8].astype(np.int64)
    splits = []
    outer = StratifiedKFold(n_splits=folds, shuffle=True, random_state=RANDOM_STATE)
    for rest, test in outer.split(X, y):
        tr, va = train_test_split(rest, test_size=0.25, stratify=y[rest], random_state=RANDOM_STATE)
        splits.append(Split(X[tr], y[tr], X[va], y[va], X[test], y[test]))
    return splits


def _read_sparse(path: Path, n_features: int) -> tuple[FloatArray, npt.NDArray[np.int64]]:
    rows, labels = [], []
    for line in path.read_text().splitlines():
        parts = line.split()
        if not parts:
            continue
        labels.append(int(float(parts[0])))
        row = np.zeros(n_features)
        for item in parts[1:]:
            idx, val = item.split(":")
            row[int(idx) - 1] = float(val)
        rows.append(row)
    return np.array(rows), np.array(labels, dtype=np.int64)


#: MiniBooNE marks events without valid measurements by -999 in every feature.
MBNE_SENTINEL = -999.0


def load_miniboone(root: Path = DATA) -> tuple[list[Split], dict[str, int]] | None:
    """MiniBooNE sample: tr / tv / te as train / validation / test, rows holding the -999
    sentinel dropped (the count per file is returned)."""
    folder = root / "miniboone-sample"
    parts = []
    dropped: dict[str, int] = {}
    for name in ("tr", "tv", "te"):
        path = folder / f"mbne_tiny_{name}"
        if not path.is_file():
            return None
        X, y = _read_sparse(path, 50)
        bad = np.any(X <= MBNE_SENTINEL + 0.5, axis=1)
        dropped[name] = int(bad.sum())
        parts.append((X[~bad], y[~bad]))
    (a, b), (c, d), (e, f) = parts
    return [Split(a, b, c, d, e, f)], dropped
