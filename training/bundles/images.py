"""The Poly-Dom image bundle, whatever the images: lattice, export, strategies, manifest.

Every image builder ends here: :func:`build_image_bundle` takes each item's features
(:class:`FeatureData`: every extractor run once per item, with labels and a train / test
split) and each extractor's cost curve c_f(n), and writes a bundle with Poly-Dom and the
Greedy strategies:

1. :class:`LatticeEvaluator` — the black box a(F): cross-validated accuracy of the learner on
   F's columns of the train rows (every size in the data mixed: Poly-Dom's a(F) does not
   depend on n; the accuracy per size is the report's, on held-out rows).
2. Poly-Dom over the lattice and the greedy variants, under the cost curves.
3. ONNX export of every candidate, every subset of one and every greedy prefix, each checked
   against the fitted model on held-out rows; the manifest (:func:`make_strategies`), written
   into a staging folder that replaces ``models/<name>/`` only when everything succeeded.

Its callers: the digits bundle (:mod:`training.bundles.digits`, scikit-learn's digits
rendered at several sides) and any labelled image folder (:mod:`training.bundles.folder`,
``budgetserve-train images``).

The module stays whole (over 450 lines): it is the one path every image builder ends in, the
lattice evaluation, the export and the strategies running in sequence over one
:class:`FeatureData`; a part alone would have no other caller.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt
from sklearn.base import clone
from sklearn.model_selection import StratifiedKFold, cross_val_score

from service.bundle import (
    AnyStrategy,
    CostPolynomial,
    ExtractorSpec,
    GreedySequenceSpec,
    GreedyStrategy,
    ItemSpec,
    Manifest,
    ModelSpec,
    PolyDomIndex,
    PolyDomStrategy,
    model_id_for,
    write_manifest,
)
from service.extractors.base import Extractor, create_extractor
from training.bundles.writer import bundle_version, provenance, staging
from training.executor import INLINE, Executor
from training.export.sklearn import export_classifier, verify_export
from training.greedy import VARIANTS as GREEDY_VARIANTS
from training.greedy import GreedySequences
from training.learners import default_learner
from training.polydom import PolyDom

FloatMatrix = npt.NDArray[np.float32]
Progress = Callable[[str, int, int], None]

VERIFICATION_FILE = "verification.json"


def _noop(stage: str, done: int, total: int) -> None:
    return None


@dataclass(frozen=True)
class Feature:
    """One feature of a bundle: its name there, the extractor plugin computing it (entry
    point ``plugin``, default the name) with ``params``, and the created extractor."""

    name: str
    extractor: Extractor
    plugin: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def create(
        cls, name: str, plugin: str | None = None, params: Mapping[str, Any] | None = None
    ) -> Feature:
        """The feature ``name`` computed by the installed plugin ``plugin`` (default
        ``name``) with ``params`` (:func:`service.extractors.base.create_extractor`)."""
        params = dict(params or {})
        return cls(name, create_extractor(plugin or name, params=params), plugin, params)

    def spec(self, cost: CostPolynomial) -> ExtractorSpec:
        return ExtractorSpec(
            name=self.name,
            plugin=self.plugin if self.plugin not in (None, self.name) else None,
            version=self.extractor.version,
            dims=self.extractor.dims,
            params=dict(self.params),
            cost=cost,
        )


@dataclass
class FeatureData:
    """Every extractor's output for every row, with labels (indices into ``classes``), each
    row's size n (pixels) and a train / test split."""

    names: list[str]
    blocks: dict[str, FloatMatrix]
    labels: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]
    train: npt.NDArray[np.int64]
    test: npt.NDArray[np.int64]
    fingerprint: str
    classes: list[str]

    def matrix(self, features: Sequence[str], rows: npt.NDArray[np.int64]) -> FloatMatrix:
        if not features:
            return np.zeros((len(rows), 0), dtype=np.float32)
        return np.hstack([self.blocks[f][rows] for f in features]).astype(np.float32)


def profile_costs(
    extractors: Sequence[Extractor] | Mapping[str, Extractor],
    sides: Sequence[int],
    repeats: int,
    quantile: float = 0.95,
    progress: bool | Progress = False,
    image_factory: Callable[[int, np.random.Generator], npt.NDArray[np.float32]] | None = None,
) -> dict[str, CostPolynomial]:
    """Time every extractor at several sizes and fit c_f(n) to the ``quantile`` of the
    times: on square noise images of ``sides`` by default, or on ``image_factory(side,
    rng)`` (e.g. a user's own images, ``side`` then an index)."""
    from training.profiling import fit_profiles, noise_image, profile_extractors

    timings = profile_extractors(
        extractors if isinstance(extractors, Mapping) else list(extractors),
        list(sides),
        repeats,
        progress=progress,
        image_factory=image_factory or noise_image,
    )
    return fit_profiles(timings, quantile=quantile)


@dataclass(frozen=True)
class LatticeJob:
    """What every lattice task reads: the features, the learner and the CV protocol (shared
    with the executor's workers once, see :mod:`training.executor`)."""

    data: FeatureData
    learner: Any
    folds: int
    seed: int


def cv_accuracy(job: LatticeJob, mask: int) -> float:
    """a(F) for F = ``mask``: mean accuracy over ``job.folds`` seeded stratified folds of the
    train rows (the empty set predicts the fold's majority class)."""
    d = job.data
    y = d.labels[d.train]
    feats = mask_features(d.names, mask)
    cv = StratifiedKFold(job.folds, shuffle=True, random_state=job.seed)
    if not feats:
        hits = 0
        for fit_rows, score_rows in cv.split(np.zeros(len(y)), y):
            classes, counts = np.unique(y[fit_rows], return_counts=True)
            hits += int(np.sum(y[score_rows] == classes[np.argmax(counts)]))
        return hits / len(y)
    x = d.matrix(feats, d.train)
    return float(np.mean(cross_val_score(clone(job.learner), x, y, cv=cv)))


def fit_model(job: LatticeJob, mask: int) -> Any:
    """The learner fitted on F's columns of every train row."""
    d = job.data
    return clone(job.learner).fit(
        d.matrix(mask_features(d.names, mask), d.train), d.labels[d.train]
    )


@dataclass
class LatticeEvaluator:
    """a(F): the learner's k-fold cross-validated accuracy on F's columns (train rows).

    Memoised by feature-set mask; ``calls`` counts distinct expansions (Metric 1). The
    model exported for F is fitted on all train rows, lazily (:meth:`fitted_model`), so
    only the sets that end up in the bundle pay for a final fit.

    :meth:`prefetch` and :meth:`prefit` compute a batch of sets on ``executor`` (inline by
    default; joblib or Ray workers, see :mod:`training.executor`): the lattice search hands
    it each batch of independent expansions. Every value is the same whichever executor
    computed it.
    """

    data: FeatureData
    learner: Any = field(default_factory=default_learner)
    folds: int = 5
    seed: int = 0
    progress: Progress = _noop
    accuracy: dict[int, float] = field(default_factory=dict)
    executor: Executor = field(default=INLINE, repr=False)
    _fitted: dict[int, Any] = field(default_factory=dict, repr=False)
    _job: LatticeJob | None = field(default=None, repr=False)

    def features(self, mask: int) -> list[str]:
        return mask_features(self.data.names, mask)

    @property
    def calls(self) -> int:
        return len(self.accuracy)

    @property
    def job(self) -> LatticeJob:
        """One object per evaluator, so an executor ships the data once for all batches."""
        if self._job is None:
            self._job = LatticeJob(self.data, self.learner, self.folds, self.seed)
        return self._job

    def __call__(self, mask: int) -> float:
        if mask not in self.accuracy:
            self._record(mask, cv_accuracy(self.job, mask))
        return self.accuracy[mask]

    def _record(self, mask: int, acc: float) -> None:
        self.accuracy[mask] = acc
        self.progress("expand", len(self.accuracy), 1 << len(self.data.names))

    def prefetch(self, masks: Sequence[int]) -> None:
        """Compute a(F) of every mask not known yet, as one batch on the executor."""
        todo = list(dict.fromkeys(m for m in masks if m not in self.accuracy))
        for mask, acc in zip(
            todo, self.executor.map(cv_accuracy, todo, shared=(self.job,)), strict=True
        ):
            self._record(mask, acc)

    def prefit(self, masks: Sequence[int]) -> None:
        """Fit the exported model of every mask not fitted yet, as one batch."""
        todo = list(dict.fromkeys(m for m in masks if m not in self._fitted))
        self._fitted.update(
            zip(todo, self.executor.map(fit_model, todo, shared=(self.job,)), strict=True)
        )

    def fitted_model(self, mask: int) -> Any:
        """The learner fitted on F's columns of every train row (cached)."""
        if mask not in self._fitted:
            self._fitted[mask] = fit_model(self.job, mask)
        return self._fitted[mask]


def _cost_matrix(costs: dict[str, CostPolynomial], names: Sequence[str]) -> npt.NDArray[np.float64]:
    width = max(len(costs[n].coefficients) for n in names)
    out = np.zeros((len(names), width))
    for i, n in enumerate(names):
        out[i, : len(costs[n].coefficients)] = costs[n].coefficients
    return out


@dataclass
class ImageBundleConfig:
    """What :func:`build_image_bundle` needs besides the data and the cost curves."""

    name: str
    size_domain: tuple[float, float]
    epsilon: float = 0.02
    delta: float = 0.01
    seed: int = 0
    folds: int = 5
    max_pixels: int = 1024 * 1024
    min_side: int = 8
    channels: Literal["gray", "rgb"] = "gray"
    learner: Any = None  # default: training.learners.default_learner()
    parameters: dict[str, Any] = field(default_factory=dict)  # recorded in the provenance


class ImageLimits(Protocol):
    max_pixels: int
    min_side: int
    channels: Literal["gray", "rgb"]


def image_item(limits: ImageLimits) -> ItemSpec:
    """The item spec of an image bundle built with these limits and channels."""
    return ItemSpec(
        kind="image",
        max_pixels=limits.max_pixels,
        min_side=limits.min_side,
        channels=limits.channels,
    )


@dataclass
class BuildResult:
    manifest: Manifest
    path: Path
    evaluator: LatticeEvaluator
    polydom: PolyDom
    data: FeatureData
    export_errors: dict[str, float]


def build_image_bundle(
    out_dir: Path,
    config: ImageBundleConfig,
    features: Sequence[Feature],
    data: FeatureData,
    costs: Mapping[str, CostPolynomial],
    *,
    progress: Progress = _noop,
    executor: Executor = INLINE,
    before_commit: Callable[[Path, Manifest], None] | None = None,
) -> BuildResult:
    """Train and write a Poly-Dom image bundle to ``out_dir`` (replaced atomically).

    The cross-validations and final fits of the lattice run on ``executor`` (in this process
    by default); the bundle is the same whichever executor ran them. ``before_commit`` runs
    on the complete staging folder before it replaces ``out_dir`` (e.g. to load and evaluate
    it); if it raises, nothing is replaced."""
    names = [f.name for f in features]
    if names != data.names:
        raise ValueError(f"the data's features {data.names} are not the bundle's {names}")
    evaluator = LatticeEvaluator(
        data,
        learner=default_learner() if config.learner is None else config.learner,
        folds=config.folds,
        seed=config.seed,
        progress=progress,
        executor=executor,
    )
    cost_matrix = _cost_matrix(dict(costs), names)
    polydom = PolyDom(epsilon=config.epsilon, delta=config.delta)
    polydom.fit(evaluator, cost_matrix, config.size_domain)
    polydom_expanded = dict(polydom.expanded_)
    greedy_fits = {
        variant: factory().fit(evaluator, cost_matrix, config.size_domain)
        for variant, factory in GREEDY_VARIANTS.items()
    }
    # Models for every subset of a candidate (anytime Poly-Dom answers with the best prefix
    # in hand) and every greedy prefix; evaluating the extra subsets is not a Poly-Dom
    # expansion (its statistics above are unaffected).
    export = {0, *polydom.candidates_}
    for candidate in polydom.candidates_:
        export.update(subsets_of(candidate))
    for fit in greedy_fits.values():
        for sequence in fit.sequences_:
            export.update(sequence.prefix_masks)
    export_masks = sorted(export, key=lambda m: (m.bit_count(), m))

    classes = [data.classes[int(c)] for c in np.unique(data.labels)]
    with staging(out_dir) as tmp:
        models, export_errors = _export_models(tmp, evaluator, export_masks, data, classes)
        strategies = make_strategies(names, polydom, greedy_fits)
        skylines = [s.index.skylines for s in strategies if isinstance(s, PolyDomStrategy)]
        manifest = Manifest(
            name=config.name,
            version=bundle_version(tmp, json.dumps(skylines).encode()),
            classes=classes,
            cost_unit="ms",
            item=image_item(config),
            extractors=[f.spec(costs[f.name]) for f in features],
            models=models,
            strategies=strategies,
            default_strategy="polydom-anytime",
            provenance=provenance(
                data.fingerprint,
                {
                    **config.parameters,
                    "epsilon": config.epsilon,
                    "delta": config.delta,
                    "seed": config.seed,
                    "rows": {"train": len(data.train), "test": len(data.test)},
                    "accuracy_estimate": f"{evaluator.folds}-fold cross-validation on train",
                    "learner": repr(evaluator.learner),
                    "expanded_accuracies": {
                        model_id_for(evaluator.features(m)): a
                        for m, a in sorted(polydom_expanded.items())
                    },
                    "greedy": {
                        variant: fit.stats_.as_dict() for variant, fit in greedy_fits.items()
                    },
                },
            ),
        )
        write_manifest(tmp, manifest)
        if before_commit is not None:
            before_commit(tmp, manifest)
    return BuildResult(manifest, out_dir, evaluator, polydom, data, export_errors)


def subsets_of(mask: int) -> list[int]:
    """Every subset of the bitmask ``mask`` (itself and 0 included)."""
    out, sub = [], mask
    while True:
        out.append(sub)
        if sub == 0:
            return out
        sub = (sub - 1) & mask


def mask_features(names: Sequence[str], mask: int) -> list[str]:
    return [n for i, n in enumerate(names) if mask >> i & 1]


def make_strategies(
    names: Sequence[str], polydom: PolyDom, greedy_fits: dict[str, GreedySequences]
) -> list[AnyStrategy]:
    """The manifest entries of fitted strategies (feature bit i = ``names[i]``): anytime and
    static Poly-Dom sharing one index, then one entry per greedy variant."""

    def model_id(mask: int) -> str:
        return model_id_for(mask_features(names, mask))

    candidate_ids = [model_id(m) for m in polydom.candidates_]
    static = PolyDomStrategy(
        name="polydom",
        anytime=False,
        epsilon=polydom.epsilon,
        delta=polydom.delta,
        size_domain=polydom.size_domain_,
        candidates=candidate_ids,
        index=PolyDomIndex(
            breakpoints=[float(b) for b in polydom.index_.breakpoints],
            skylines=[[candidate_ids[p] for p in skyline] for skyline in polydom.index_.skylines],
        ),
        stats={k: float(v) for k, v in polydom.stats_.as_dict().items()},
    )
    strategies: list[AnyStrategy] = [
        static.model_copy(update={"name": "polydom-anytime", "anytime": True}),
        static,
    ]
    for variant, fit in greedy_fits.items():
        strategies.append(
            GreedyStrategy(
                name=variant,
                reference_size=fit.reference_size_,
                sequences=[
                    GreedySequenceSpec(
                        lambdas=[f"{lam:.4g}" for lam in s.lambdas],
                        features=[names[i] for i in s.order],
                        models=[model_id(m) for m in s.prefix_masks],
                    )
                    for s in fit.sequences_
                ],
                skyline=[(int(seq), int(length)) for seq, length in fit.skyline_],
            )
        )
    return strategies


def _export_models(
    folder: Path,
    evaluator: LatticeEvaluator,
    masks: list[int],
    data: FeatureData,
    classes: list[str],
) -> tuple[list[ModelSpec], dict[str, float]]:
    """Export the model of every feature set in ``masks`` (0: the prior) to ONNX, verified
    on held-out rows; also write ``verification.json`` (held-out feature rows + expected
    probabilities)."""
    probe = data.test[:8]
    verification: dict[str, Any] = {
        "rows": {n: data.blocks[n][probe].tolist() for n in data.names},
        "expected": {},
    }
    models: list[ModelSpec] = []
    errors: dict[str, float] = {}
    test_accuracy: dict[str, float] = {}
    y_train = data.labels[data.train]
    evaluator.prefetch(masks)
    evaluator.prefit([m for m in masks if m])
    for mask in masks:
        feats = evaluator.features(mask)
        model_id = model_id_for(feats)
        acc = evaluator(mask)
        if not feats:
            prior = np.bincount(y_train, minlength=len(classes)).astype(np.float64)
            prior /= prior.sum()
            models.append(
                ModelSpec(
                    id=model_id,
                    features=[],
                    accuracy=acc,
                    prior=[float(p) for p in prior],
                    input_dims=0,
                )
            )
            continue
        fitted = evaluator.fitted_model(mask)
        if [data.classes[int(c)] for c in fitted.classes_] != classes:
            raise RuntimeError(f"model {model_id!r} saw classes {fitted.classes_}, need {classes}")
        dims = sum(data.blocks[f].shape[1] for f in feats)
        onnx_bytes = export_classifier(fitted, dims)
        held_out = data.matrix(feats, data.test)
        errors[model_id] = verify_export(onnx_bytes, fitted, held_out, model_id=model_id)
        test_accuracy[model_id] = float(np.mean(fitted.predict(held_out) == data.labels[data.test]))
        file = f"{model_id.replace('+', '__')}.onnx"
        (folder / file).write_bytes(onnx_bytes)
        verification["expected"][model_id] = fitted.predict_proba(
            data.matrix(feats, probe)
        ).tolist()
        models.append(
            ModelSpec(id=model_id, features=feats, accuracy=acc, file=file, input_dims=dims)
        )
    verification["test_accuracy"] = test_accuracy
    (folder / VERIFICATION_FILE).write_text(json.dumps(verification))
    return models, errors
