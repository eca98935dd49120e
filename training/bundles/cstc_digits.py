"""Build a CSTC / CSCC bundle (paper 003) on the image extractors, so the tree can be compared
with Poly-Dom on the same items: for the digits (``budgetserve-train cstc-digits``) or for any
labelled image folder (``budgetserve-train cstc-images``, :func:`folder_rows`).
:func:`build_cstc_image_bundle` is the builder both call, on :class:`ImageRows` (every item's
feature groups, its size n and its fit / validation / test part).

The digits:

The sensors are the digits bundle's image feature groups (thumbnail, histogram, projection,
hog, lbp, fft_bands, gabor), each read whole by its extractor plugin, at the measured cost
c_f(n) of its profiled curve at the item's size n (by default the curves of the embedded
digits bundle, ``models/digits``, so both bundles charge the same). Every source digit is
rendered at each of ``sides`` and sent through a PNG round trip, so the features trained on
are the ones the service extracts from the PNG; the digits are split BY IDENTITY with
:func:`training.evaluate.digit_split` (the digits bundle's split): a held-out digit is
never seen at any side, the same digit at another side is not a held-out item. The train
digits are split again by identity into fitting and validation digits.

An image folder: every image once, at its own size; the held-out images are the folder
builder's (``--test DIR``, or a stratified split that keeps byte-identical files together),
the training images are split again into fitting and validation images.

Costs: the optimiser takes one cost per group, so a tree is trained with each group's cost
averaged over the training items' sizes (the expected cost of the group for an item of the
training mix), normalised to mean 1 so λ keeps the meaning it has on tabular data. The
bundle ships the size-dependent curves; each point carries its ``feature_rates`` (the
fraction of validation items whose walk reads each group), so the service prices a point
at the request's size as Σ rate_f · c_f(n) and picks it under the budget. The points'
``accuracy``, ``mean_cost`` and rates come from validation digits (nothing of the held-out
digits enters a choice); the held-out numbers are in the provenance's sweep and
``result.points``.

The module stays whole (over 450 lines): the digits and an image folder are two sources of
rows (:class:`DigitRows`, :class:`ImageRows`) for one builder, :func:`build_cstc_image_bundle`,
which is most of it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import numpy as np
import numpy.typing as npt

from service.bundle import (
    CostPolynomial,
    CstcPoint,
    CstcStrategy,
    Manifest,
    ModelSpec,
    read_manifest,
    write_manifest,
)
from service.extractors.base import Extractor
from training.bundles.cstc import Config, estimator_for, pareto_points
from training.bundles.digits import DIGITS_EXTRACTORS
from training.bundles.images import Feature, image_item
from training.bundles.writer import bundle_version, provenance, staging
from training.cstc import CSTCClassifier
from training.executor import INLINE, Executor
from training.export.cstc import export_point

Array = npt.NDArray[np.float64]
Progress = Callable[[str, int, int], None]
DIGITS_METHODS = ("cstc", "cscc", "root-only")


def _noop(stage: str, done: int, total: int) -> None:
    return None


@dataclass
class CstcImageConfig:
    """The trees' settings, whatever the images."""

    name: str = "images-cstc"
    extractors: tuple[str, ...] = DIGITS_EXTRACTORS
    methods: tuple[str, ...] = DIGITS_METHODS
    lambdas: tuple[float, ...] = (0.3, 1.0, 1.5, 2.0, 3.0, 10.0)
    n_rounds: int = 1
    depth: int = 3
    sharpness: float = 10.0
    rho: float = 0.001
    seed: int = 0  # the split and the rendering
    validation_fraction: float = 0.2  # of the train items, by identity
    tolerance: float = 0.0
    max_pixels: int = 1024 * 1024
    min_side: int = 8
    channels: Literal["gray", "rgb"] = "gray"

    def check(self) -> None:
        unknown = [m for m in self.methods if m not in ("cstc", "cscc", "cronus", "root-only")]
        if unknown:
            raise ValueError(f"methods {unknown} are unknown; known: cstc, cscc, cronus, root-only")
        if not self.lambdas or any(v < 0 for v in self.lambdas):
            raise ValueError(
                f"lambdas must be a non-empty list of numbers >= 0, got {self.lambdas}"
            )
        if not 0 < self.validation_fraction < 1:
            raise ValueError(
                f"validation_fraction must be in (0, 1), got {self.validation_fraction}"
            )


@dataclass
class CstcDigitsConfig(CstcImageConfig):
    name: str = "digits-cstc"
    sides: tuple[int, ...] = (16, 32, 64, 128)
    limit: int | None = None  # source digits used (all 1797 when None), as the digits build

    def check(self) -> None:
        if not self.sides or any(not isinstance(s, int) or s < 8 for s in self.sides):
            raise ValueError(
                f"sides must be integers >= 8 (the image's min side), got {self.sides}"
            )
        super().check()


@dataclass
class ImageRows:
    """Every item's feature groups: ``X`` holds the groups' columns side by side (``groups``
    lists each group's columns), one row per item, with its label (an index into
    ``classes``), its size n (pixels), its identity (the same picture at another size shares
    it) and its part (fit, validation or test rows)."""

    names: list[str]
    groups: list[list[int]]
    X: Array
    labels: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]
    identity: npt.NDArray[np.int64]
    fit: npt.NDArray[np.int64]  # row positions
    validation: npt.NDArray[np.int64]
    test: npt.NDArray[np.int64]
    fingerprint: str
    classes: list[str]


@dataclass
class DigitRows(ImageRows):
    """Every (digit, side) rendered, PNG round-tripped and extracted; ``identity`` indexes
    ``load_digits``."""

    sides: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def size(self, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        out: npt.NDArray[np.int64] = self.sides[rows] ** 2
        return out


def costs_from_bundle(bundle_dir: Path, names: Sequence[str]) -> dict[str, CostPolynomial]:
    """The measured cost curves of ``names`` in a bundle's manifest (the digits bundle's)."""
    manifest = read_manifest(bundle_dir)
    curves = {e.name: e.cost for e in manifest.extractors}
    missing = [n for n in names if n not in curves]
    if missing:
        raise ValueError(
            f"{bundle_dir} has no cost curve for {missing} (it has {sorted(curves)}); "
            "profile them (budgetserve-train profile) or choose extractors it has"
        )
    return {n: curves[n] for n in names}


def digit_png(index: int, side: int, seed: int) -> bytes:
    """Digit ``index`` (of ``load_digits``) rendered at ``side`` with the jitter of
    ``(seed, index, side)`` (as :func:`training.data.digits.load_digit_images` draws it),
    as the PNG a client sends."""
    from training.data.digits import digits_source, render_digit, to_png

    images, _ = digits_source()
    return to_png(render_digit(images[index], side, np.random.default_rng([seed, index, side])))


def render_png_round_trip(index: int, side: int, seed: int) -> npt.NDArray[np.float32]:
    """:func:`digit_png` decoded the way the service decodes an item: the exact pixels the
    service extracts from."""
    from training.data.digits import from_png

    return from_png(digit_png(index, side, seed))


def digits_rows(
    extractors: Sequence[Extractor],
    sides: Sequence[int],
    *,
    seed: int = 0,
    limit: int | None = None,
    validation_fraction: float = 0.2,
    progress: Progress = _noop,
) -> DigitRows:
    """Render every digit of the split at every side and extract every group once."""
    from training.data.digits import digits_source
    from training.evaluate import digit_split

    _, all_labels = digits_source()
    train_ids, test_ids = digit_split(seed, limit)
    rng = np.random.default_rng([seed, 0xC57C])
    shuffled = rng.permutation(train_ids)
    n_val = max(1, round(validation_fraction * len(shuffled)))
    val_ids, fit_ids = np.sort(shuffled[:n_val]), np.sort(shuffled[n_val:])
    ids = np.concatenate([fit_ids, val_ids, np.sort(test_ids)])
    part = np.repeat([0, 1, 2], [len(fit_ids), len(val_ids), len(test_ids)])
    dims = [e.dims for e in extractors]
    groups, start = [], 0
    for d in dims:
        groups.append(list(range(start, start + d)))
        start += d
    n = len(ids) * len(sides)
    X = np.zeros((n, start), dtype=np.float64)
    identity = np.repeat(ids, len(sides)).astype(np.int64)
    where = np.repeat(part, len(sides))
    side_of = np.tile(np.asarray(sides, dtype=np.int64), len(ids))
    for i in range(n):
        image = render_png_round_trip(int(identity[i]), int(side_of[i]), seed)
        for e, cols in zip(extractors, groups, strict=True):
            # float32, as the extractor serves it
            X[i, cols] = np.asarray(e.extract(image), dtype=np.float32)
        progress("extract", i + 1, n)
    h = hashlib.sha256(np.ascontiguousarray(X).tobytes())
    h.update(json.dumps({"sides": list(map(int, sides)), "seed": seed, "limit": limit}).encode())
    return DigitRows(
        names=[e.name for e in extractors],
        groups=groups,
        X=X,
        labels=np.asarray(all_labels[identity], dtype=np.int64),
        sizes=side_of * side_of,
        sides=side_of,
        identity=identity,
        fit=np.flatnonzero(where == 0).astype(np.int64),
        validation=np.flatnonzero(where == 1).astype(np.int64),
        test=np.flatnonzero(where == 2).astype(np.int64),
        fingerprint="sha256:" + h.hexdigest(),
        classes=[str(c) for c in range(10)],
    )


def training_costs(
    costs: dict[str, CostPolynomial], names: Sequence[str], sizes: Sequence[int]
) -> tuple[Array, float]:
    """Each group's cost averaged over the training items' sizes (pixels), normalised to mean
    1 (and the scale: normalised × scale = ms)."""
    raw = np.asarray(
        [np.mean([costs[n](float(s)) for s in sizes]) for n in names], dtype=np.float64
    )
    scale = float(raw.mean())
    return raw / scale, scale


@dataclass(frozen=True)
class FitParams:
    depth: int
    sharpness: float
    rho: float
    n_rounds: int
    seed: int


def make_digits_estimator(
    params: FitParams, config: Config, groups: list[list[int]], costs: Array
) -> CSTCClassifier:
    return estimator_for(
        config,
        groups,
        costs,
        rho=params.rho,
        depth=params.depth,
        sharpness=params.sharpness,
        n_rounds=params.n_rounds,
        seed=params.seed,
    )


def _fit_digits(
    params: FitParams,
    groups: list[list[int]],
    costs: Array,
    x: Array,
    y: npt.NDArray[Any],
    config: Config,
) -> CSTCClassifier:
    return make_digits_estimator(params, config, groups, costs).fit(x, y)


def walk_costs(
    est: CSTCClassifier,
    data: ImageRows,
    rows: npt.NDArray[np.int64],
    costs: dict[str, CostPolynomial],
) -> tuple[Array, npt.NDArray[np.bool_]]:
    """Each row's walk cost in ms at its own size (the groups it reads, each at c_f(n)),
    and which groups each row reads (rows x groups)."""
    walks = est.walk(data.X[rows])
    read = np.zeros((len(rows), len(data.names)), dtype=bool)
    for i, w in enumerate(walks):
        for acquired in w.acquired:
            read[i, acquired] = True
    per_size = {
        int(n): np.asarray([costs[f](float(n)) for f in data.names])
        for n in set(data.sizes[rows].tolist())
    }
    unit = np.stack([per_size[int(n)] for n in data.sizes[rows]])
    return (read * unit).sum(axis=1), read


Rows = TypeVar("Rows", bound=ImageRows)


@dataclass
class CstcImageResult(Generic[Rows]):
    manifest: Manifest
    path: Path
    points: list[dict[str, Any]]
    estimators: dict[str, CSTCClassifier]
    data: Rows
    costs: dict[str, CostPolynomial]
    sweep: dict[str, CSTCClassifier] = field(default_factory=dict)


CstcDigitsResult = CstcImageResult[DigitRows]


def build_cstc_digits_bundle(
    out_dir: Path,
    config: CstcDigitsConfig,
    costs: dict[str, CostPolynomial],
    *,
    data: DigitRows | None = None,
    executor: Executor = INLINE,
    progress: Progress = _noop,
) -> CstcDigitsResult:
    """Render and extract the digits (unless ``data`` is given), then
    :func:`build_cstc_image_bundle`."""
    config.check()
    features = [Feature.create(n) for n in config.extractors]
    if data is None:
        data = digits_rows(
            [f.extractor for f in features],
            config.sides,
            seed=config.seed,
            limit=config.limit,
            validation_fraction=config.validation_fraction,
            progress=progress,
        )
    return build_cstc_image_bundle(
        out_dir,
        config,
        features,
        costs,
        data,
        executor=executor,
        parameters={
            "sides": list(config.sides),
            "limit": config.limit,
            "split": "by digit identity (training.evaluate.digit_split)",
            "digits": {
                "fit": len(set(data.identity[data.fit].tolist())),
                "validation": len(set(data.identity[data.validation].tolist())),
                "test": len(set(data.identity[data.test].tolist())),
            },
        },
    )


def build_cstc_image_bundle(
    out_dir: Path,
    config: CstcImageConfig,
    features: Sequence[Feature],
    costs: dict[str, CostPolynomial],
    data: Rows,
    *,
    executor: Executor = INLINE,
    parameters: dict[str, Any] | None = None,
) -> CstcImageResult[Rows]:
    """Fit every (method, λ) on the fitting rows, keep the validation Pareto set, export
    every node (checked against the fitted one on the held-out rows) and write the bundle
    atomically. ``parameters`` join the provenance's."""
    config.check()
    names = [f.name for f in features]
    if names != data.names:
        raise ValueError(f"the data's feature groups {data.names} are not the bundle's {names}")
    norm_costs, scale = training_costs(costs, names, data.sizes[data.fit].tolist())
    params = FitParams(config.depth, config.sharpness, config.rho, config.n_rounds, config.seed)
    configs = [Config(m, float(lam)) for m in config.methods for lam in config.lambdas]
    X, y = data.X, data.labels
    fitted = executor.map(
        _fit_digits, configs, shared=(params, data.groups, norm_costs, X[data.fit], y[data.fit])
    )
    rows: list[dict[str, Any]] = []
    for cfg, est in zip(configs, fitted, strict=True):
        val_cost, val_read = walk_costs(est, data, data.validation, costs)
        test_cost, _ = walk_costs(est, data, data.test, costs)
        rows.append(
            {
                "id": cfg.id,
                "method": cfg.method,
                "lam": cfg.lam,
                "validation_accuracy": float(
                    np.mean(est.predict(X[data.validation]) == y[data.validation])
                ),
                "validation_cost": float(val_cost.mean()),
                "feature_rates": {
                    n: float(r) for n, r in zip(names, val_read.mean(axis=0), strict=True) if r > 0
                },
                "test_accuracy": float(np.mean(est.predict(X[data.test]) == y[data.test])),
                "test_cost": float(test_cost.mean()),
                "nodes": len(est.nodes_),
            }
        )
    kept = pareto_points(rows)
    by_id = dict(zip((c.id for c in configs), fitted, strict=True))
    classes = np.unique(y[data.fit])
    prior = np.asarray([np.mean(y[data.fit] == c) for c in classes])
    x_test = X[data.test]  # checks the export only: nothing is chosen on test items
    with staging(out_dir) as tmp:
        models = [
            ModelSpec(
                id="prior",
                features=[],
                accuracy=float(np.mean(y[data.validation] == classes[int(np.argmax(prior))])),
                prior=[float(p) for p in prior],
                input_dims=0,
            )
        ]
        points = []
        for row in kept:
            node_models, nodes = export_point(
                tmp,
                row["id"],
                by_id[row["id"]],
                data.groups,
                names,
                (X[data.validation], y[data.validation]),
                x_test,
            )
            models += node_models
            points.append(
                CstcPoint(
                    id=row["id"],
                    method=row["method"],
                    lam=row["lam"],
                    mean_cost=row["validation_cost"],
                    accuracy=row["validation_accuracy"],
                    nodes=nodes,
                    feature_rates=row["feature_rates"],
                )
            )
        manifest = Manifest(
            name=config.name,
            version=bundle_version(tmp),
            classes=[data.classes[int(c)] for c in classes],
            cost_unit="ms",
            item=image_item(config),
            extractors=[f.spec(costs[f.name]) for f in features],
            models=models,
            strategies=[
                CstcStrategy(name="cstc", points=points, tolerance=config.tolerance),
            ],
            default_strategy="cstc",
            provenance=provenance(
                data.fingerprint,
                {
                    **(parameters or {}),
                    "extractors": names,
                    "training_costs_ms": {
                        n: float(c * scale) for n, c in zip(names, norm_costs, strict=True)
                    },
                    "methods": list(config.methods),
                    "lambdas": list(config.lambdas),
                    "depth": config.depth,
                    "sharpness": config.sharpness,
                    "rho": config.rho,
                    "seed": config.seed,
                    "sweep": rows,
                },
            ),
        )
        write_manifest(tmp, manifest)
    return CstcImageResult(
        manifest,
        out_dir,
        rows,
        {r["id"]: by_id[r["id"]] for r in kept},
        data,
        costs,
        by_id,
    )
