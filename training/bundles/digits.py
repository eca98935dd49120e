"""The embedded digits bundle: scikit-learn's digits rendered at several sides, through the
generic Poly-Dom image builder (:mod:`training.bundles.images`).

The steps, each usable on its own:

1. :func:`profile_costs` — time every extractor at several sizes, fit c_f(n) (p95).
2. :func:`digits_features` — render digits at mixed sizes and extract every feature once.
3. :func:`build_bundle` — :func:`training.bundles.images.build_image_bundle` on those:
   Poly-Dom over the lattice (a(F) by :class:`LatticeEvaluator`), ONNX export of the
   candidates (checked against the fitted models), index and manifest written to
   ``models/<name>/``.

A labelled folder of the user's own images takes the same builder through
:mod:`training.bundles.folder` (``budgetserve-train images``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from service.bundle import CostPolynomial
from service.extractors.base import Extractor, create_extractor
from training.bundles.images import (
    VERIFICATION_FILE,
    BuildResult,
    Feature,
    FeatureData,
    ImageBundleConfig,
    LatticeEvaluator,
    Progress,
    build_image_bundle,
    make_strategies,
    mask_features,
    profile_costs,
    subsets_of,
)
from training.executor import INLINE, Executor

__all__ = [
    "DIGITS_EXTRACTORS",
    "VERIFICATION_FILE",
    "BuildConfig",
    "BuildResult",
    "FeatureData",
    "LatticeEvaluator",
    "build_bundle",
    "digit_order",
    "digits_features",
    "make_extractors",
    "make_strategies",
    "mask_features",
    "profile_costs",
    "split_rows",
    "subsets_of",
]

DIGITS_EXTRACTORS = ("thumbnail", "histogram", "projection", "hog", "lbp", "fft_bands", "gabor")


def _noop(stage: str, done: int, total: int) -> None:
    return None


def make_extractors(names: Sequence[str] = DIGITS_EXTRACTORS) -> list[Extractor]:
    return [create_extractor(name) for name in names]


def split_rows(n: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Row positions of the 80 / 20 train / test split (rows are in :func:`digit_order`)."""
    idx = np.arange(n, dtype=np.int64)
    n_train = int(0.8 * n)
    return idx[:n_train], idx[n_train:]


def digit_order(
    n: int, rng: np.random.Generator, limit: int | None = None
) -> npt.NDArray[np.int64]:
    """The indices of scikit-learn's ``n`` digits a build renders, in row order: a seeded
    permutation of the first 80 % (training and cross-validation), then the last 20 % in
    index order, which :func:`split_rows` holds out. So the held-out digits are the last
    20 % of scikit-learn's digits, whatever the seed. With ``limit`` (quick builds), 80 % of
    ``limit`` rows from the first part and the rest from the held-out part."""
    cut = int(0.8 * n)
    head = rng.permutation(cut)
    tail = np.arange(cut, n)
    if limit is not None:
        rows = min(limit, n)
        head, tail = head[: int(0.8 * rows)], tail[: rows - int(0.8 * rows)]
    return np.concatenate([head, tail]).astype(np.int64)


def digits_features(
    extractors: Sequence[Extractor],
    sides: Sequence[int],
    *,
    seed: int = 0,
    limit: int | None = None,
    progress: Progress = _noop,
) -> FeatureData:
    """Render each scikit-learn digit once at a side drawn from ``sides`` and extract."""
    from sklearn.datasets import load_digits

    from training.data.digits import render_digit

    digits = load_digits()
    images8 = np.asarray(digits.images, dtype=np.float64)
    labels = np.asarray(digits.target, dtype=np.int64)
    rng = np.random.default_rng(seed)
    order = digit_order(len(labels), rng, limit)
    images8, labels = images8[order], labels[order]
    chosen = rng.choice(np.asarray(sides, dtype=np.int64), size=len(labels))
    blocks = {e.name: np.zeros((len(labels), e.dims), dtype=np.float32) for e in extractors}
    for i, (pix, side) in enumerate(zip(images8, chosen, strict=True)):
        image = render_digit(pix, int(side), rng)
        for e in extractors:
            blocks[e.name][i] = e.extract(image)
        progress("extract", i + 1, len(labels))
    train, test = split_rows(len(labels))
    h = hashlib.sha256(digits.images.astype(np.float64).tobytes())
    # held out: the last 20 % of scikit-learn's digits (digit_order)
    spec = {"sides": list(map(int, sides)), "seed": seed, "limit": limit, "held_out": "last 20 %"}
    h.update(json.dumps(spec).encode())
    return FeatureData(
        names=[e.name for e in extractors],
        blocks=blocks,
        labels=labels,
        sizes=chosen * chosen,
        train=train,
        test=test,
        fingerprint="sha256:" + h.hexdigest(),
        classes=[str(c) for c in range(10)],
    )


@dataclass
class BuildConfig:
    name: str = "digits"
    train_sides: tuple[int, ...] = (16, 24, 32, 48, 64)
    profile_sides: tuple[int, ...] = (16, 32, 64, 96, 128, 192, 256)
    profile_repeats: int = 31
    quantile: float = 0.95
    epsilon: float = 0.02
    delta: float = 0.01
    seed: int = 0
    limit: int | None = None
    max_pixels: int = 1024 * 1024
    extractors: tuple[str, ...] = DIGITS_EXTRACTORS

    @property
    def size_domain(self) -> tuple[float, float]:
        return (float(min(self.profile_sides) ** 2), float(max(self.profile_sides) ** 2))


def build_bundle(
    out_dir: Path,
    config: BuildConfig,
    *,
    costs: dict[str, CostPolynomial] | None = None,
    data: FeatureData | None = None,
    progress: Progress = _noop,
    profile_progress: bool | Progress = False,
    executor: Executor = INLINE,
) -> BuildResult:
    """Train and write a digits Poly-Dom bundle to ``out_dir`` (replaced atomically).

    The cross-validations and final fits of the lattice run on ``executor`` (in this process
    by default); the bundle is the same whichever executor ran them."""
    features = [Feature.create(name) for name in config.extractors]
    extractors = [f.extractor for f in features]
    if costs is None:
        costs = profile_costs(
            extractors,
            config.profile_sides,
            config.profile_repeats,
            config.quantile,
            progress=profile_progress,
        )
    if data is None:
        data = digits_features(
            extractors, config.train_sides, seed=config.seed, limit=config.limit, progress=progress
        )
    image_config = ImageBundleConfig(
        name=config.name,
        size_domain=config.size_domain,
        epsilon=config.epsilon,
        delta=config.delta,
        seed=config.seed,
        max_pixels=config.max_pixels,
        parameters={
            "train_sides": list(config.train_sides),
            "profile_sides": list(config.profile_sides),
            "profile_repeats": config.profile_repeats,
            "quantile": config.quantile,
            "limit": config.limit,
        },
    )
    return build_image_bundle(
        out_dir, image_config, features, data, costs, progress=progress, executor=executor
    )
