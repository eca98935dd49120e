"""The held-out report of ``budgetserve-train images`` (:mod:`training.bundles.folder`, step 6).

Every held-out image goes through the serving loop (:func:`service.execution.execute`,
measured extraction times, the service's default reserve, calibration off) at each budget;
accuracy and cost are reported per size range (:func:`size_ranges`: the ranges the folder's
sizes cluster in), next to the best fixed extractor set a user would deploy for that budget
instead: the exported set with the highest a(F) whose profiled cost at the range's largest
size fits the budget, scored on the same held-out images with its ONNX model.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from service.bundle import CostPolynomial, Manifest
from service.decoded import DecodedItem
from training.bundles.images import FeatureData
from training.data.image_folder import load_image

Progress = Callable[[str, int, int], None]


def _noop(stage: str, done: int, total: int) -> None:
    return None


class ReportSettings(Protocol):
    max_pixels: int
    min_side: int
    reserve_ms: float


def size_ranges(sizes: npt.NDArray[np.int64], most: int = 4) -> list[tuple[int, int]]:
    """Up to ``most`` ranges [lo, hi] of pixel counts that split ``sizes`` at their widest
    gaps in log n (wider than twice the median gap: the breaks between the sizes a folder
    clusters at), each range holding at least a tenth of the items; every distinct size its
    own range when there are no more than ``most``."""
    values = np.sort(np.asarray(sizes, dtype=np.int64))
    distinct = np.unique(values)
    if len(distinct) <= most:
        return [(int(v), int(v)) for v in distinct]
    gaps = np.diff(np.log(distinct.astype(np.float64)))
    floor = max(1, len(values) // 10)
    cuts: list[int] = []  # cut after distinct[c]
    for g in np.argsort(-gaps, kind="stable"):
        if gaps[g] <= 2 * np.median(gaps) or len(cuts) == most - 1:
            break
        trial = sorted([*cuts, int(g)])
        ends = np.searchsorted(values, [distinct[c] for c in trial], side="right")
        if np.diff(np.concatenate(([0], ends, [len(values)]))).min() >= floor:
            cuts = trial
    bounds = [0, *[c + 1 for c in cuts], len(distinct)]
    return [(int(distinct[a]), int(distinct[b - 1])) for a, b in itertools.pairwise(bounds)]


def budget_grid(
    costs: Mapping[str, CostPolynomial],
    sizes: npt.NDArray[np.int64],
    reserve: float,
    points: int = 6,
) -> tuple[float, ...]:
    """``points`` budgets, geometric, from the cheapest extractor at the smallest size to
    every extractor at the largest (×1.25), each plus the reserve; 2 significant digits."""
    lo = min(c(float(sizes.min())) for c in costs.values()) + reserve
    hi = 1.25 * sum(c(float(sizes.max())) for c in costs.values()) + reserve
    grid = np.geomspace(lo, max(hi, lo * 1.01), points)
    return tuple(sorted({float(f"{b:.2g}") for b in grid}))


@dataclass
class EvaluationRow:
    sizes: tuple[int, int]
    budget: float
    items: int
    accuracy: float
    expected: float
    mean_spent: float
    p95_spent: float
    overrun_rate: float
    fixed_set: str
    fixed_accuracy: float
    fixed_cost: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _fixed_accuracies(
    folder: Path, manifest: Manifest, data: FeatureData
) -> dict[str, npt.NDArray[np.bool_]]:
    """Per exported model: whether it is right on each held-out row (ONNX, as served)."""
    from training.export.sklearn import onnx_probabilities

    y = data.labels[data.test]
    present = [data.classes.index(c) for c in manifest.classes]
    right: dict[str, npt.NDArray[np.bool_]] = {}
    for model in manifest.models:
        if model.file is None:
            assert model.prior is not None
            guess = present[int(np.argmax(model.prior))]
            right[model.id] = y == guess
            continue
        p = onnx_probabilities(
            (folder / model.file).read_bytes(), data.matrix(model.features, data.test)
        )
        right[model.id] = y == np.asarray(present)[np.argmax(p, axis=1)]
    return right


def evaluate_folder_bundle(
    folder: Path,
    manifest: Manifest,
    data: FeatureData,
    files: Sequence[Path],
    config: ReportSettings,
    budgets: Sequence[float],
    progress: Progress = _noop,
) -> list[EvaluationRow]:
    """Every held-out file through the serving loop at each budget (see the module, 6)."""
    from service.execution import execute
    from training.evaluate import load

    bundle = load(folder)
    channels = manifest.item.channels
    right = _fixed_accuracies(folder, manifest, data)
    costs = {e.name: e.cost for e in manifest.extractors}
    ranges = size_ranges(data.sizes[data.test])
    test_sizes = data.sizes[data.test]
    served = {b: np.zeros(len(data.test), dtype=bool) for b in budgets}
    spent = {b: np.zeros(len(data.test)) for b in budgets}
    expected = {b: np.zeros(len(data.test)) for b in budgets}
    over = {b: np.zeros(len(data.test), dtype=bool) for b in budgets}
    classes = manifest.classes
    total = len(data.test) * len(budgets)
    for i, row in enumerate(data.test):
        image = load_image(
            files[row], max_pixels=config.max_pixels, min_side=config.min_side, channels=channels
        )
        item = DecodedItem(image, int(image.shape[0] * image.shape[1]), f"eval:{row}")
        label = data.classes[int(data.labels[row])]
        for j, budget in enumerate(budgets):
            run = execute(
                bundle, item, budget, {}, time.perf_counter(), reserve_ms=config.reserve_ms
            )
            served[budget][i] = classes[int(np.argmax(run.probabilities))] == label
            spent[budget][i] = run.spent
            over[budget][i] = run.over_budget(budget)
            expected[budget][i] = manifest.model(run.answer).accuracy
            progress("evaluate", i * len(budgets) + j + 1, total)
    rows = []
    for lo, hi in ranges:
        mask = (test_sizes >= lo) & (test_sizes <= hi)
        for budget in budgets:
            fits = [
                m
                for m in manifest.models
                if not m.features  # the prior answers whatever the budget
                or sum(costs[f](float(hi)) for f in m.features) + config.reserve_ms <= budget
            ]
            best = max(fits, key=lambda m: (m.accuracy, -len(m.features)))
            rows.append(
                EvaluationRow(
                    sizes=(lo, hi),
                    budget=float(budget),
                    items=int(mask.sum()),
                    accuracy=float(served[budget][mask].mean()),
                    expected=float(expected[budget][mask].mean()),
                    mean_spent=float(spent[budget][mask].mean()),
                    p95_spent=float(np.percentile(spent[budget][mask], 95)),
                    overrun_rate=float(over[budget][mask].mean()),
                    fixed_set=best.id if best.features else "(prior)",
                    fixed_accuracy=float(right[best.id][mask].mean()),
                    fixed_cost=float(sum(costs[f](float(hi)) for f in best.features)),
                )
            )
    return rows


def describe_range(lo: int, hi: int) -> str:
    """A size range for tables: ``n`` or ``lo–hi`` px, with the side of a square."""
    if lo == hi:
        return f"{lo} px (≈{math.isqrt(lo)}²)"
    return f"{lo}–{hi} px (≈{math.isqrt(lo)}²–{math.isqrt(hi)}²)"
