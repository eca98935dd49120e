"""The best fixed sensor subsets of a tabular bundle (issue 25): what a user would run instead
of an adaptive strategy, found, fitted and exported the same way for every bundle kind (DAG,
gating, CSTC/CSCC), so that every one of them carries, next to its adaptive points, the best
fixed pipeline at each cost level and the service chooses between all of them by validation
accuracy (:class:`service.bundle.FixedPoint`, :mod:`service.strategies.fixed`).

* **Candidates**: every subset of the sensors when there are at most
  ``FixedSearch.max_exhaustive``; otherwise a greedy forward chain (each step adds the sensor
  with the largest validation-accuracy gain per unit of cost, scored by a small proxy model),
  plus any subsets the caller adds (e.g. the DAG's states).
* **Per subset** (:func:`fit_subset`): each learner of ``FixedSearch.learners`` is fitted on
  the training rows and scored on the validation rows; ``lightgbm`` is LightGBM tuned on the
  validation rows (one fit per ``num_leaves`` recording the validation error after every
  tree, stopped ``patience`` trees after its best; the best (leaves, trees) is refit as
  :class:`~training.dag.learners.Float32Lgbm`, so its ONNX export is exact on float32
  inputs), the others are the DAG's learners (``linear``, ``poly2``, ``poly3``, ``gbrt``).
  The most accurate on validation is kept (ties: the earlier learner listed). Models are
  fitted on class indices (``np.unique`` order of y).
* **Kept**: the validation Pareto set (cost up, validation accuracy strictly up), exported to
  ONNX and checked by :func:`training.export.fixed.export_fixed`.

Fits are cached in this process by the digest of their rows, columns and settings, so the
DAG's classifier bank and the fixed points of one build (or the three builders of a benchmark
on the same split) fit each subset once.

The module stays whole (over 450 lines): the search, the per-subset fit and its cache are
the one recipe every tabular builder shares; split, the parts would only call each other.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightgbm as lgb
import numpy as np
import numpy.typing as npt
from sklearn.exceptions import ConvergenceWarning

from service.bundle import model_id_for
from service.types import FloatArray
from training.dag.learners import LEARNERS, Float32Lgbm, make_classifier
from training.executor import INLINE, Executor

IntArray = npt.NDArray[np.int64]

#: The learners a fixed subset may be fitted with: ``lightgbm`` (tuned on validation) and the
#: DAG's learners.
FIXED_LEARNERS = ("lightgbm", *LEARNERS)


@dataclass(frozen=True)
class FixedSearch:
    """How the fixed subsets are searched and fitted (see the module docstring)."""

    learners: tuple[str, ...] = ("lightgbm", "linear")
    num_leaves: tuple[int, ...] = (15, 31)
    learning_rate: float = 0.1
    max_trees: int = 300
    patience: int = 50
    max_exhaustive: int = 6
    proxy_trees: int = 60

    def check(self) -> None:
        if not self.learners or any(v not in FIXED_LEARNERS for v in self.learners):
            raise ValueError(
                f"fixed learners must be a non-empty list of {list(FIXED_LEARNERS)}, got "
                f"{list(self.learners)!r}"
            )
        if not self.num_leaves or any(int(v) < 2 for v in self.num_leaves):
            raise ValueError(f"num_leaves must be integers >= 2, got {self.num_leaves!r}")
        if not 0 < self.learning_rate <= 1:
            raise ValueError(f"learning_rate must be in (0, 1], got {self.learning_rate!r}")
        if int(self.max_trees) < 1 or int(self.proxy_trees) < 1 or int(self.patience) < 1:
            raise ValueError("max_trees, patience and proxy_trees must be >= 1")
        if int(self.max_exhaustive) < 0:
            raise ValueError(f"max_exhaustive must be >= 0, got {self.max_exhaustive!r}")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | None) -> FixedSearch:
        """A search from a spec's ``fixed:`` mapping (unknown keys named); None: defaults."""
        if raw is None:
            return cls()
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"fixed: unknown keys {unknown}; known: {sorted(known)}")
        values = dict(raw)
        for key in ("learners", "num_leaves"):
            if key in values:
                values[key] = tuple(values[key])
        search = cls(**values)
        search.check()
        return search


@dataclass
class SubsetFit:
    """One sensor subset fitted alone: its sensors (declaration order), the columns its model
    reads (their columns in that order), its cost, the fitted model (None: the prior) and
    its validation accuracy."""

    sensors: tuple[str, ...]
    columns: list[int]
    cost: float
    estimator: Any
    learner: str
    val_accuracy: float
    prior: list[float] = field(default_factory=list)

    @property
    def model_id(self) -> str:
        return "fixed:" + model_id_for(self.sensors)

    def predict_proba(self, X: Any) -> FloatArray:
        Xa = np.asarray(X, dtype=np.float64)
        if self.estimator is None:
            return np.tile(np.asarray(self.prior), (Xa.shape[0], 1))
        return np.asarray(self.estimator.predict_proba(Xa[:, self.columns]), dtype=np.float64)


# --------------------------------------------------------------------------------------------
# one subset
# --------------------------------------------------------------------------------------------


def _f32(X: Any) -> FloatArray:
    return np.asarray(np.asarray(X, dtype=np.float32), dtype=np.float64)


def _tuned_lightgbm(
    X: FloatArray, y: IntArray, Xv: FloatArray, yv: IntArray, search: FixedSearch, seed: int
) -> tuple[Float32Lgbm, str]:
    """LightGBM with (num_leaves, trees) chosen on the validation rows: one fit per
    ``num_leaves`` records the validation error after every tree; the best is refit (ties:
    fewer trees, then fewer leaves)."""
    metric = "binary_error" if np.unique(y).size <= 2 else "multi_error"
    known = yv >= 0  # validation rows of a class the training rows lack are never right
    Xv, yv = Xv[known], yv[known]
    best: tuple[float, int, int] | None = None
    n_classes = int(y.max()) + 1
    objective = (
        {"objective": "binary"}
        if metric == "binary_error"
        else {
            "objective": "multiclass",
            "num_class": n_classes,
        }
    )
    train = lgb.Dataset(_f32(X), label=y, free_raw_data=False)
    valid = lgb.Dataset(_f32(Xv), label=yv, reference=train)
    for leaves in sorted({int(v) for v in search.num_leaves}):
        params = {
            **objective,
            "metric": metric,
            "num_leaves": leaves,
            "learning_rate": float(search.learning_rate),
            "seed": seed,
            "num_threads": 1,
            "verbose": -1,
        }
        record: dict[str, dict[str, list[float]]] = {}
        lgb.train(
            params,
            train,
            num_boost_round=int(search.max_trees),
            valid_sets=[valid],
            valid_names=["validation"],
            callbacks=[
                lgb.record_evaluation(record),
                lgb.early_stopping(int(search.patience), verbose=False),
            ],
        )
        errors = np.asarray(record["validation"][metric], dtype=np.float64)
        trees = int(np.argmin(errors)) + 1  # the first minimum: the fewest trees
        key = (float(errors[trees - 1]), trees, leaves)
        if best is None or key < best:
            best = key
    assert best is not None
    _, trees, leaves = best
    est = Float32Lgbm(
        n_estimators=trees,
        learning_rate=float(search.learning_rate),
        num_leaves=leaves,
        random_state=seed,
    ).fit(X, y)
    return est, (
        f"lightgbm: {trees} trees of {leaves} leaves, learning rate {search.learning_rate:g} "
        "(chosen on validation rows)"
    )


def fit_subset(
    X: FloatArray,
    y: IntArray,
    X_val: FloatArray,
    y_val: IntArray,
    columns: Sequence[int],
    search: FixedSearch = FixedSearch(),
    seed: int = 0,
) -> tuple[Any, str, float]:
    """The most accurate model on the validation rows among ``search.learners`` fitted on
    ``columns`` of the training rows (y, y_val: class indices): ``(fitted model, what it
    is, validation accuracy)``; the model is None (the training prior) without columns."""
    cols = list(columns)
    if not cols:
        prior = np.bincount(y, minlength=int(y.max()) + 1)
        return None, "prior", float(np.mean(y_val == int(np.argmax(prior))))
    Xs, Xv = X[:, cols], X_val[:, cols]
    best: tuple[Any, str, float] | None = None
    for learner in search.learners:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            if learner == "lightgbm":
                est, what = _tuned_lightgbm(Xs, y, Xv, y_val, search, seed)
            else:
                est = make_classifier(learner, 1.0, seed).fit(Xs, y)
                what = {"linear": "logistic regression (standardised, C = 1)"}.get(
                    learner, f"{learner} (the DAG learner)"
                )
        pred = np.argmax(np.asarray(est.predict_proba(Xv)), axis=1)
        accuracy = float(np.mean(est.classes_[pred] == y_val))
        if best is None or accuracy > best[2]:
            best = (est, what, accuracy)
    assert best is not None
    return best


# --------------------------------------------------------------------------------------------
# many subsets
# --------------------------------------------------------------------------------------------

_CACHE: dict[str, tuple[Any, str, float]] = {}
_CACHE_MAX = 4096


def _digest(*parts: Any) -> str:
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, np.ndarray):
            h.update(np.ascontiguousarray(part).tobytes())
            h.update(str(part.shape).encode())
        else:
            h.update(repr(part).encode())
    return h.hexdigest()


def _fit_fixed_subset(
    X: FloatArray,
    y: IntArray,
    X_val: FloatArray,
    y_val: IntArray,
    search: FixedSearch,
    seed: int,
    columns: list[int],
) -> tuple[Any, str, float]:
    return fit_subset(X, y, X_val, y_val, columns, search, seed)


@dataclass
class FixedSubsets:
    """Fits subsets of ``sensors`` (name -> columns of X, declaration order) with their
    ``costs`` on the training and validation rows, each once (:func:`fit_subset`, cached)."""

    X: FloatArray
    y: Any
    X_val: FloatArray
    y_val: Any
    sensors: Mapping[str, Sequence[int]]
    costs: Mapping[str, float]
    search: FixedSearch = field(default_factory=FixedSearch)
    seed: int = 0
    executor: Executor = INLINE

    def __post_init__(self) -> None:
        self.search.check()
        self.X = np.asarray(self.X, dtype=np.float64)
        self.X_val = np.asarray(self.X_val, dtype=np.float64)
        self.classes, y_idx = np.unique(np.asarray(self.y), return_inverse=True)
        self.y_idx = y_idx.astype(np.int64)
        index = {c: i for i, c in enumerate(self.classes.tolist())}
        self.y_val_idx = np.asarray(
            [index.get(v, -1) for v in np.asarray(self.y_val).tolist()], dtype=np.int64
        )
        self.names = list(self.sensors)
        self.prior = (
            np.bincount(self.y_idx, minlength=self.classes.size) / self.y_idx.size
        ).tolist()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (shipped to another process with an estimator that holds it as its bank)
        without its executor: the executor's progress hook holds the display's lock, and a
        copy elsewhere fits inline anyway."""
        state = dict(self.__dict__)
        state["executor"] = INLINE
        return state

    def ordered(self, subset: Iterable[str]) -> tuple[str, ...]:
        wanted = set(subset)
        unknown = wanted - set(self.names)
        if unknown:
            raise ValueError(f"subset names unknown sensors {sorted(unknown)}; known: {self.names}")
        return tuple(n for n in self.names if n in wanted)

    def columns(self, subset: Sequence[str]) -> list[int]:
        return [int(c) for s in subset for c in self.sensors[s]]

    def cost(self, subset: Sequence[str]) -> float:
        return float(sum(float(self.costs[s]) for s in subset))

    def _key(self, columns: list[int], search: FixedSearch) -> str:
        return _digest(
            self.X[:, columns],
            self.y_idx,
            self.X_val[:, columns],
            self.y_val_idx,
            search,
            self.seed,
        )

    def _fit_cached(
        self, columns: list[list[int]], search: FixedSearch
    ) -> list[tuple[Any, str, float]]:
        """:func:`fit_subset` of each column list with ``search`` (on the executor; fits of
        the same rows, columns and settings are reused)."""
        keys = [self._key(c, search) for c in columns]
        todo = [i for i, k in enumerate(keys) if k not in _CACHE]
        if todo:
            fitted = self.executor.map(
                _fit_fixed_subset,
                [columns[i] for i in todo],
                shared=(self.X, self.y_idx, self.X_val, self.y_val_idx, search, self.seed),
            )
            for i, result in zip(todo, fitted, strict=True):
                if len(_CACHE) >= _CACHE_MAX:
                    _CACHE.pop(next(iter(_CACHE)))
                _CACHE[keys[i]] = result
        return [_CACHE[k] for k in keys]

    def fit(self, subsets: Iterable[Iterable[str]]) -> dict[tuple[str, ...], SubsetFit]:
        """Each subset fitted alone (on the executor; cached fits are reused)."""
        wanted = list(dict.fromkeys(self.ordered(s) for s in subsets))
        results = self._fit_cached([self.columns(s) for s in wanted], self.search)
        out: dict[tuple[str, ...], SubsetFit] = {}
        for subset, (est, what, accuracy) in zip(wanted, results, strict=True):
            out[subset] = SubsetFit(
                subset, self.columns(subset), self.cost(subset), est, what, accuracy, self.prior
            )
        return out

    def candidates(self) -> list[tuple[str, ...]]:
        """Every subset (at most ``max_exhaustive`` sensors), else the greedy forward chain
        (:meth:`greedy_chain`); the empty subset first."""
        n = len(self.names)
        if n <= self.search.max_exhaustive:
            return [tuple(c) for k in range(n + 1) for c in itertools.combinations(self.names, k)]
        return self.greedy_chain()

    def greedy_chain(self) -> list[tuple[str, ...]]:
        """∅ ⊂ S_1 ⊂ … ⊂ all sensors: each step adds the sensor whose validation-accuracy
        gain per unit of added cost is largest (a free sensor: largest gain first; ties: the
        higher accuracy, then declaration order), scored by a small LightGBM (``proxy_trees``
        trees of 15 leaves, learning rate 0.15) or, without ``lightgbm`` among the learners,
        by the first learner."""
        proxy = FixedSearch(
            learners=("lightgbm",)
            if "lightgbm" in self.search.learners
            else self.search.learners[:1],
            num_leaves=(15,),
            learning_rate=0.15,
            max_trees=self.search.proxy_trees,
        )
        current: tuple[str, ...] = ()
        chain = [current]
        _, _, accuracy = fit_subset(self.X, self.y_idx, self.X_val, self.y_val_idx, [], proxy)
        while len(current) < len(self.names):
            rest = [s for s in self.names if s not in current]
            trials = [self.ordered((*current, s)) for s in rest]
            scores = self._fit_cached([self.columns(t) for t in trials], proxy)
            best: tuple[float, float, int] | None = None
            pick = 0
            for i, (s, (_, _, acc)) in enumerate(zip(rest, scores, strict=True)):
                added = float(self.costs[s])
                gain = acc - accuracy
                rate = gain / added if added > 0 else gain * 1e12
                key = (-rate, -acc, i)
                if best is None or key < best:
                    best, pick = key, i
            current = trials[pick]
            accuracy = scores[pick][2]
            chain.append(current)
        return chain

    def pareto(self, fits: Iterable[SubsetFit]) -> list[SubsetFit]:
        """The fits worth their cost: by cost (then validation accuracy, best first), each
        strictly more accurate on validation than every cheaper one."""
        out: list[SubsetFit] = []
        for fit in sorted(fits, key=lambda f: (f.cost, -f.val_accuracy, len(f.sensors))):
            if not out or fit.val_accuracy > out[-1].val_accuracy:
                out.append(fit)
        return out

    def best(self, extra: Iterable[Iterable[str]] = ()) -> list[SubsetFit]:
        """The validation Pareto set of the candidates (and ``extra`` subsets)."""
        fits = self.fit([*self.candidates(), *extra])
        return self.pareto(fits.values())


def fixed_summary(fits: Sequence[SubsetFit]) -> list[dict[str, Any]]:
    """The fixed points for a bundle's provenance."""
    return [
        {
            "sensors": list(f.sensors),
            "cost": f.cost,
            "validation_accuracy": f.val_accuracy,
            "learner": f.learner,
        }
        for f in fits
    ]


@dataclass
class WithFixedSubsets:
    """What a tabular builder's spec adds for its fixed subsets: ``fixed``, a mapping of
    :class:`FixedSearch`'s fields (absent: the defaults), or ``false`` for none (the bundle
    then has its adaptive points only), and ``fixed_margin`` (how many validation standard
    errors an adaptive point must gain over the best fixed subset to be served instead)."""

    def margin_fields(self, validation_rows: int) -> dict[str, Any]:
        """The strategy's ``margin`` and ``validation_rows``."""
        return {"margin": float(self.fixed_margin), "validation_rows": int(validation_rows)}

    fixed: dict[str, Any] | bool | None = None
    #: Standard errors an adaptive point must gain over the best fixed subset on validation
    #: to be served instead (the strategy's ``margin``; 0: any gain).
    fixed_margin: float = 1.0

    def fixed_search(self) -> FixedSearch | None:
        if (
            isinstance(self.fixed_margin, bool)
            or not isinstance(self.fixed_margin, int | float)
            or not 0 <= self.fixed_margin < math.inf
        ):
            raise ValueError(f"fixed_margin must be a number >= 0, got {self.fixed_margin!r}")
        if self.fixed is False:
            return None
        if self.fixed is None or self.fixed is True:
            return FixedSearch()
        if not isinstance(self.fixed, dict):
            raise ValueError(
                f"fixed must be a mapping of search settings (e.g. {{max_trees: 200}}) or "
                f"false, got {self.fixed!r}"
            )
        return FixedSearch.from_mapping(self.fixed)
