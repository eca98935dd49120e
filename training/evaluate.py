"""Evaluate a bundle the way the service runs it: for held-out digits rendered at a given
side, plan with the bundle's strategy, extract with real timings, infer with ONNX."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.execution import execute
from service.floor import FALLBACK_RESERVE_MS
from service.items import DecodedItem
from service.registry import Bundle, CalibrationSettings, load_bundle


@dataclass(frozen=True)
class EvalPoint:
    strategy: str
    side: int
    budget: float
    accuracy: float
    expected_accuracy: float
    mean_spent: float
    p95_spent: float
    overrun_rate: float
    n: int


def digit_split(seed: int = 0, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Indices into scikit-learn's ``load_digits`` of the train and held-out digits of a
    digits build made with ``seed`` and ``limit`` (:func:`training.bundles.digits.
    digits_features` renders each source digit once, at one side, in the order of
    :func:`~training.bundles.digits.digit_order`; :func:`~training.bundles.digits.split_rows`
    keeps the first 80 % for training and cross-validation). The held-out digits are the last
    20 % of scikit-learn's digits (without ``limit``); a digit not in the train indices was
    never seen at any side."""
    from sklearn.datasets import load_digits

    from training.bundles.digits import digit_order, split_rows

    n = len(load_digits().target)
    order = digit_order(n, np.random.default_rng(seed), limit)
    train, test = split_rows(len(order))
    return order[train], order[test]


def held_out_digits(
    count: int, seed: int = 0, limit: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Up to ``count`` digits of the test split of a build made with ``seed`` and ``limit``
    (never trained on nor used in cross-validation)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    chosen = digit_split(seed, limit)[1][:count]
    return np.asarray(digits.images[chosen], dtype=np.float64), digits.target[chosen]


def evaluate_bundle(
    bundle: Bundle,
    sides: Sequence[int],
    budgets: Sequence[float],
    *,
    strategies: Sequence[str] | None = None,
    count: int = 200,
    reserve_ms: float | None = None,
) -> Iterable[EvalPoint]:
    """Yield one :class:`EvalPoint` per (side, budget, strategy), strategies defaulting to
    the bundle's default one. Every held-out item is run through each strategy in turn, so
    they are compared under the same machine conditions. ``reserve_ms`` defaults to the
    reserve the service plans with until it has measured its own (``service.floor``)."""
    from training.data.digits import render_digit

    reserve = FALLBACK_RESERVE_MS if reserve_ms is None else reserve_ms
    names = list(strategies) if strategies else [bundle.manifest.default_strategy]
    runtimes = [bundle.strategy(name) for name in names]
    params = bundle.manifest.provenance.parameters
    images8, labels = held_out_digits(count, int(params.get("seed", 0)), params.get("limit"))
    classes = bundle.manifest.classes
    for side in sides:
        rng = np.random.default_rng(1000 + side)
        items = [
            DecodedItem(data=render_digit(img, side, rng), size=side * side, key=f"eval:{i}")
            for i, img in enumerate(images8)
        ]
        for budget in budgets:
            correct = dict.fromkeys(names, 0)
            overruns = dict.fromkeys(names, 0)
            spent: dict[str, list[float]] = {name: [] for name in names}
            expected: dict[str, list[float]] = {name: [] for name in names}
            for item, label in zip(items, labels, strict=True):
                for name, runtime in zip(names, runtimes, strict=True):
                    start = time.perf_counter()
                    run = execute(
                        bundle, item, budget, {}, start, reserve_ms=reserve, runtime=runtime
                    )
                    spent[name].append(run.spent)
                    correct[name] += int(classes[int(np.argmax(run.probabilities))] == str(label))
                    overruns[name] += int(run.over_budget(budget))
                    expected[name].append(bundle.manifest.model(run.answer).accuracy)
            for name in names:
                yield EvalPoint(
                    strategy=name,
                    side=side,
                    budget=budget,
                    accuracy=correct[name] / len(items),
                    expected_accuracy=float(np.mean(expected[name])),
                    mean_spent=float(np.mean(spent[name])),
                    p95_spent=float(np.percentile(spent[name], 95)),
                    overrun_rate=overruns[name] / len(items),
                    n=len(items),
                )


def load(path: Path, *, calibration: bool = False) -> Bundle:
    """Load a bundle for offline evaluation; live calibration is off unless asked for, so
    results describe the bundle's own cost model."""
    return load_bundle(
        path, max_pixels=1 << 24, calibration=CalibrationSettings(enabled=calibration)
    )
