"""Adaptive sensor acquisition by a directed acyclic graph (Wang, Trapeznikov & Saligrama,
NIPS 2015): the training side.

Model
-----
* **Sensors** are named groups of columns of ``X`` with an acquisition cost each. **Groups** are
  what one DAG action acquires: with ``n_subsets=None`` every sensor is a group (at most 8
  sensors: 256 states); with ``n_subsets=t`` the groups are the non-empty subsets σ_1..σ_t chosen
  by Alg. 2 (:func:`select_subsets`) plus the full set of sensors, each treated as one
  super-sensor whose cost given a state is the sum of the costs of its sensors not yet acquired.
* **States** are bitmasks over groups (bit g = group g acquired); the empty state 0 is the root.
  A state is *closed*: it also holds every group whose sensors it already has all of (so e.g.
  any state holding the full-set group is the full state), hence every action adds at least one
  new sensor, distinct states have distinct sensor sets, and a path never buys a sensor twice.
  The state's columns (:meth:`DagClassifier.state_columns`) are its sensors' columns, sensors in
  declaration order (the order of ``sensors``), each sensor's columns in the given order.
* **Classifier bank**: one classifier of ``learner`` (:mod:`training.dag.learners`: ``linear``
  = ``StandardScaler + LogisticRegression(C)``, ``poly2``/``poly3`` = the paper's polynomial
  expansion before it, ``gbrt`` = LightGBM) per non-empty state on that state's columns, refit
  on all training rows; the empty state predicts the training prior.
  The stop cost used to train the policies is the 0/1 loss of *out-of-fold* predictions
  (``cross_val_predict`` with ``folds`` stratified folds), so that policies do not learn from
  overfit training errors.
* **Graph-Reduce** (Alg. 1): states are processed leaf-to-root (decreasing number of groups). At
  state s the actions are, in this fixed order: action 0 = stop and classify (cost: the OOF loss
  of f_s on the row), then one action per group g ∉ s in increasing group index (cost:
  ``cost_scale · cost(g | s) + cost_to_go(s ∪ g, row)``). The full state can only stop. The
  k-action cost-sensitive problem is solved by a **filter tree** (Beygelzimer, Langford &
  Ravikumar 2007) of importance-weighted binary classifiers of ``policy_learner`` (default:
  ``learner``; the logistic regressions use ``policy_C``) on the state's columns only (for the
  polynomial learners standardised by the training mean and scale); the root sees
  no columns and takes the constant action of minimum mean cost. After π_s is trained,
  ``cost_to_go(s, row)`` is the cost of the action π_s chooses for the row.
* **Prediction** walks from the root applying the policies. With ``budget`` the acquisition cost
  (real, unscaled) is a hard cap: when the chosen acquisition does not fit in what is left, the
  walk stops and classifies at the current state.

The estimator is one class of about 450 lines (fit, Graph-Reduce, the budgeted walk, export
of its policies); it stays whole because its methods share the fitted state; Alg. 2
(:mod:`training.dag.subsets`), the filter trees (:mod:`training.dag.policies`) and the sweep
(:mod:`training.dag.sweep`) live beside it.
"""

from __future__ import annotations

import copy
import math
import numbers
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.base import BaseEstimator, ClassifierMixin

from service.types import FloatArray
from training._validation import check_fitted, check_number, check_positive
from training.dag.learners import poly_degree
from training.dag.policies import (
    CONFIDENCE_COLUMNS,
    _BankJob,
    _constant_path,
    _export_node,
    _fit_bank_member,
    _Policy,
    _train_filter_tree,
    _tree_layout,
    check_policy_options,
    confidence,
    decide_nodes,
)
from training.dag.sensors import (
    _BUDGET_SLACK,
    MAX_EXHAUSTIVE_SENSORS,
    MAX_SUBSETS,
    STOP,
    IntArray,
    _popcount,
    _validate_sensors,
    _validate_xy,
)
from training.dag.subsets import SubsetSelection, select_subsets
from training.executor import INLINE, Executor


def _check_groups(groups: Any, names: Sequence[str], n_subsets: Any) -> None:
    """``groups``: at most 8 non-empty lists of known sensors that together hold every sensor
    (``ValueError`` naming what is wrong)."""
    if n_subsets is not None:
        raise ValueError(
            f"pass groups or n_subsets, not both (got {len(groups)} groups and "
            f"n_subsets={n_subsets!r})"
        )
    if not 1 <= len(groups) <= MAX_EXHAUSTIVE_SENSORS:
        raise ValueError(
            f"groups must be 1 to {MAX_EXHAUSTIVE_SENSORS} lists of sensors (the states are "
            f"all their unions), got {len(groups)}"
        )
    known = set(names)
    for g in groups:
        unknown = sorted(set(g) - known)
        if not g or unknown:
            raise ValueError(
                f"each group must be a non-empty list of sensors among {list(names)}; got "
                f"{list(g)}" + (f" (unknown: {unknown})" if unknown else "")
            )
    missing = sorted(known - {n for g in groups for n in g})
    if missing:
        raise ValueError(f"every sensor must be in a group; not in any: {missing}")


class DagClassifier(ClassifierMixin, BaseEstimator):  # type: ignore[misc]
    """Adaptive sensor-acquisition DAG trained by Graph-Reduce (see the module docstring).

    Parameters
    ----------
    sensors: sensor name -> column indices of X (sensors must not share columns).
    costs: per-sensor acquisition cost (default 1.0 each), finite and >= 0.
    cost_scale: λ >= 0, multiplies the sensor costs in the training loss (error + λ·cost).
    n_subsets: None for the exhaustive DAG over all subsets of sensors (at most 8 sensors), or
        t in [1, 12]: Alg. 2 chooses t subsets, the full set is added as one more group, and the
        states are all unions of these groups.
    subset_budget: Alg. 2's constraint on the total cost of the t subsets (only with
        ``n_subsets``; default: twice the total cost of all sensors).
    groups: the groups themselves (lists of sensor names, at most 8, together every sensor;
        instead of ``n_subsets``), e.g. the increments of a greedy forward chain of fixed
        subsets (``training.bundles.dag``, ``groups: chain``); the states are all unions.
    C: inverse regularisation of the classifier bank's logistic regressions.
    policy_C: inverse regularisation of the filter trees' logistic regressions (their sample
        weights are cost differences, in units of one misclassification).
    folds: stratified folds of the out-of-fold losses (and of Alg. 2's evaluations).
    random_state: seeds the folds and the solvers.
    learner: the classifier bank's learner: ``linear``, ``poly2``, ``poly3`` or ``gbrt``.
    policy_learner: the filter-tree nodes' learner (same choices); None: ``learner``.
    policy_inputs: what a state's policy sees: ``features`` (the state's columns) or
        ``features+confidence`` (also the state's bank classifier's top probability and its
        margin over the second, :func:`~training.dag.policies.confidence`: out-of-fold
        probabilities in training, the refit classifier's at prediction).
    bank: None (every state's classifier is one of ``learner``), or a
        :class:`training.fixed_subsets.FixedSubsets` on the same training rows: each state's
        classifier is then that subset's model tuned on the validation rows (LightGBM's
        leaves and trees, or another learner, whichever is most accurate on validation), so
        no state's classifier is weaker on validation than its subset fitted alone; its
        out-of-fold losses come from clones of it.

    Fitted attributes
    -----------------
    ``classes_``, ``prior_`` (class frequencies), ``n_features_in_``, ``sensor_names_``,
    ``sensor_costs_`` (dict), ``groups_`` (sensor names per group), ``states_`` (closed group
    bitmasks, by increasing number of groups), ``classifiers_`` (state -> fitted pipeline, None
    for the empty state), ``policies_`` (state -> trained policy), ``oof_error_`` (state ->
    out-of-fold error rate of its classifier), ``train_objective_`` (mean over training rows of
    error + λ·cost under the learned policies, with OOF losses), ``subset_selection_`` (the
    :class:`SubsetSelection` with ``n_subsets``, else None), ``fit_seconds_``.
    """

    def __init__(
        self,
        *,
        sensors: Mapping[str, Sequence[int]],
        costs: Mapping[str, float] | None = None,
        cost_scale: float = 1.0,
        n_subsets: int | None = None,
        subset_budget: float | None = None,
        groups: Sequence[Sequence[str]] | None = None,
        C: float = 1.0,
        policy_C: float = 1.0,
        folds: int = 5,
        random_state: int = 0,
        learner: str = "linear",
        policy_learner: str | None = None,
        policy_inputs: str = "features",
        bank: Any = None,
    ) -> None:
        self.sensors = sensors
        self.costs = costs
        self.cost_scale = cost_scale
        self.n_subsets = n_subsets
        self.subset_budget = subset_budget
        self.groups = groups
        self.C = C
        self.policy_C = policy_C
        self.folds = folds
        self.random_state = random_state
        self.learner = learner
        self.policy_learner = policy_learner
        self.policy_inputs = policy_inputs
        self.bank = bank

    # ---------------------------------------------------------------- validation

    def _check_params(self) -> tuple[list[str], list[list[int]], FloatArray]:
        names, columns, cost_arr = _validate_sensors(self.sensors, self.costs)

        check_number(self.cost_scale, "cost_scale")
        check_positive(self.C, "C")
        check_positive(self.policy_C, "policy_C")
        check_policy_options(self.learner, self.policy_learner, self.policy_inputs)
        if isinstance(self.folds, bool) or not isinstance(self.folds, int) or self.folds < 2:
            raise ValueError(f"folds must be an int >= 2, got {self.folds!r}")
        if self.groups is not None:
            _check_groups(self.groups, names, self.n_subsets)
        elif self.n_subsets is None:
            if len(names) > MAX_EXHAUSTIVE_SENSORS:
                raise ValueError(
                    f"the exhaustive DAG (n_subsets=None) supports at most "
                    f"{MAX_EXHAUSTIVE_SENSORS} sensors, got {len(names)}; pass n_subsets "
                    "to select sensor subsets with Alg. 2"
                )
            if self.subset_budget is not None:
                raise ValueError(
                    f"subset_budget={self.subset_budget!r} requires n_subsets (Alg. 2); "
                    "got n_subsets=None"
                )
        else:
            t = self.n_subsets
            if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= MAX_SUBSETS:
                raise ValueError(
                    f"n_subsets must be None or an int in [1, {MAX_SUBSETS}], got {t!r}"
                )
            if self.subset_budget is not None:
                check_positive(self.subset_budget, "subset_budget")
        return names, columns, cost_arr

    # ---------------------------------------------------------------- fit

    def fit(self, X: Any, y: Any, *, executor: Executor = INLINE) -> DagClassifier:
        """Alg. 2 (with ``n_subsets``), the classifier bank (its cross-validations and fits
        run on ``executor``, in this process by default) and Graph-Reduce."""
        t0 = time.perf_counter()
        names, columns, cost_arr = self._check_params()
        Xa, y_enc, classes = _validate_xy(X, y, columns, self.folds)
        self.classes_ = classes
        self.prior_ = np.bincount(y_enc, minlength=classes.size) / y_enc.size
        self.n_features_in_ = Xa.shape[1]
        self.sensor_names_ = names
        self.sensor_costs_ = {n: float(c) for n, c in zip(names, cost_arr, strict=True)}
        self._sensor_columns = columns
        self._sensor_costs = cost_arr

        # Groups.
        self.subset_selection_: SubsetSelection | None = None
        if self.groups is not None:
            groups = [list(g) for g in self.groups]
        elif self.n_subsets is None:
            groups = [[n] for n in names]
        else:
            sel = select_subsets(
                Xa,
                y_enc,
                sensors=self.sensors,
                costs=self.costs,
                n_subsets=self.n_subsets,
                budget=self.subset_budget,
                folds=self.folds,
                random_state=self.random_state,
            )
            self.subset_selection_ = sel
            groups = []
            for subset in sel.subsets:
                if subset and subset not in groups:
                    groups.append(subset)
            if names not in groups:
                groups.append(list(names))
        self.groups_: list[list[str]] = groups
        index = {n: i for i, n in enumerate(names)}
        self._group_sensor_mask = [sum(1 << index[n] for n in g) for g in groups]

        # States: closed unions of groups, reachable from the root.
        states = {0}
        frontier = [0]
        self._transitions: dict[int, list[tuple[int, int, float]]] = {}
        while frontier:
            s = frontier.pop()
            have = self._sensor_mask(s)
            moves = []
            for g in range(len(groups)):
                if s >> g & 1:
                    continue
                nxt = self._closure(s | (1 << g))
                new = self._group_sensor_mask[g] & ~have
                step = float(sum(cost_arr[i] for i in range(len(names)) if new >> i & 1))
                moves.append((g, nxt, step))
                if nxt not in states:
                    states.add(nxt)
                    frontier.append(nxt)
            self._transitions[s] = moves
        self.states_: list[int] = sorted(states, key=lambda s: (_popcount(s), s))

        # Classifier bank with out-of-fold losses: one independent task per non-empty state.
        majority = int(np.argmax(self.prior_))
        self.classifiers_: dict[int, Any] = {0: None}
        self._losses: dict[int, FloatArray] = {0: (y_enc != majority).astype(np.float64)}
        job = _BankJob(Xa, y_enc, self.C, self.folds, self.random_state, str(self.learner))
        members = [s for s in self.states_ if s != 0]
        given = self._given_bank(Xa, members)
        fitted = executor.map(
            _fit_bank_member,
            [(self._cols(s), g) for s, g in zip(members, given, strict=True)],
            shared=(job,),
        )
        self._oof_conf: dict[int, FloatArray] = {
            0: confidence(np.tile(self.prior_, (Xa.shape[0], 1)))
        }
        for s, (loss, conf, clf) in zip(members, fitted, strict=True):
            self._losses[s] = loss
            self._oof_conf[s] = conf
            self.classifiers_[s] = clf
        self.oof_error_: dict[int, float] = {s: float(self._losses[s].mean()) for s in self.states_}
        std = Xa.std(axis=0)
        self.input_mean_ = Xa.mean(axis=0)
        self.input_scale_ = np.where(std > 0, std, 1.0)

        self._fit_policies(Xa)
        self.fit_seconds_ = time.perf_counter() - t0
        return self

    def _given_bank(self, Xa: FloatArray, members: list[int]) -> list[Any]:
        """The classifiers ``bank`` fitted for the states' sensor sets (None per state
        without ``bank``)."""
        if self.bank is None:
            return [None] * len(members)
        bank_X = np.asarray(self.bank.X)
        if bank_X.shape != Xa.shape or not np.array_equal(bank_X, Xa):
            raise ValueError(
                "bank was fitted on other rows than the X given to fit; build it on the "
                "same training rows (FixedSubsets(X, y, ...)) or pass bank=None"
            )
        subsets = [tuple(self._mask_sensors(s)) for s in members]
        fits = self.bank.fit(subsets)
        out = []
        for s, subset in zip(members, subsets, strict=True):
            fit = fits[subset]
            if list(fit.columns) != self.state_columns(s):
                raise ValueError(
                    f"bank fitted sensors {list(subset)} on columns {list(fit.columns)}; the "
                    f"DAG's state reads {self.state_columns(s)}: give the bank the same sensors"
                )
            out.append(fit.estimator)
        return out

    def _mask_sensors(self, state: int) -> list[str]:
        """The sensors of a state (declaration order), before the policies are trained."""
        mask = self._sensor_mask(state)
        return [n for i, n in enumerate(self.sensor_names_) if mask >> i & 1]

    def _fit_policies(self, Xa: FloatArray) -> None:
        """Graph-Reduce (Alg. 1) with the current ``cost_scale`` over the fitted bank."""
        lam = float(self.cost_scale)
        n = Xa.shape[0]
        learner = self.policy_learner_
        standardise = poly_degree(learner) > 0
        Za = (Xa - self.input_mean_) / self.input_scale_ if standardise else Xa
        extra = self._n_confidence
        ctg: dict[int, FloatArray] = {}
        self.policies_: dict[int, _Policy] = {}
        for s in sorted(self.states_, key=lambda s: (-_popcount(s), s)):
            moves = self._transitions[s]
            actions: list[int | None] = [None, *(g for g, _, _ in moves)]
            cost_cols = [self._losses[s]]
            cost_cols += [lam * step + ctg[nxt] for _, nxt, step in moves]
            costs = np.column_stack(cost_cols)
            if len(actions) == 1:
                nodes = _tree_layout(1)
            elif s == 0:
                nodes = _tree_layout(len(actions))
                _constant_path(nodes, int(np.argmin(costs.mean(axis=0))))
            else:
                Zs = self._with_conf(Za[:, self._cols(s)], self._oof_conf[s])
                nodes = _train_filter_tree(
                    Zs, costs, float(self.policy_C), self.random_state, learner
                )
            policy = _Policy(actions=actions, nodes=nodes)
            if standardise:
                policy.mean = np.concatenate([self.input_mean_[self._cols(s)], np.zeros(extra)])
                policy.scale = np.concatenate([self.input_scale_[self._cols(s)], np.ones(extra)])
            self.policies_[s] = policy
            chosen = policy.predict(self._with_conf(Xa[:, self._cols(s)], self._oof_conf[s]))
            ctg[s] = costs[np.arange(n), chosen]
        self.train_objective_ = float(ctg[0].mean())
        d = {s: len(self.state_columns(s)) + extra for s in self.states_}
        self._exported = {
            s: [_export_node(node, d[s], p.mean, p.scale) for node in p.nodes]
            for s, p in self.policies_.items()
        }

    @property
    def _n_confidence(self) -> int:
        return len(CONFIDENCE_COLUMNS) if self.policy_inputs == "features+confidence" else 0

    def _with_conf(self, Xs: FloatArray, conf: FloatArray) -> FloatArray:
        """The policy input: the state's columns, then (``features+confidence``) ``conf``."""
        if not self._n_confidence:
            return Xs
        return np.hstack([Xs, conf])

    def policy_input(self, state: int, X_state_columns: Any) -> FloatArray:
        """What ``state``'s policy sees for rows of the state's columns: the columns, then
        with ``policy_inputs='features+confidence'`` the state's classifier's
        :func:`~training.dag.policies.confidence` (the refit classifier's probabilities)."""
        self._check_state(state)
        Xs = np.asarray(X_state_columns, dtype=np.float64)
        if Xs.ndim == 1:
            Xs = Xs[None, :]
        if not self._n_confidence:
            return Xs
        clf = self.classifiers_[state]
        proba = np.tile(self.prior_, (Xs.shape[0], 1)) if clf is None else clf.predict_proba(Xs)
        return self._with_conf(Xs, confidence(proba))

    @property
    def policy_learner_(self) -> str:
        """The learner of the filter-tree nodes (``policy_learner``, else ``learner``)."""
        return str(self.learner if self.policy_learner is None else self.policy_learner)

    def _with_cost_scale(self, cost_scale: float, X: Any) -> DagClassifier:
        """A copy sharing this model's groups and classifier bank, with policies retrained for
        ``cost_scale``. ``X`` must be the training X this model was fitted on."""
        self._check_fitted()
        other = copy.copy(self)
        other.cost_scale = cost_scale
        other._check_params()
        t0 = time.perf_counter()
        other._fit_policies(np.asarray(X, dtype=np.float64))
        other.fit_seconds_ = time.perf_counter() - t0
        return other

    _POLICY_STATE = ("cost_scale", "policies_", "train_objective_", "_exported", "fit_seconds_")

    def _policy_state(self) -> dict[str, Any]:
        """What :meth:`_with_cost_scale` changes: the cost scale and the trained policies."""
        return {name: getattr(self, name) for name in self._POLICY_STATE}

    def _with_policies(self, state: Mapping[str, Any]) -> DagClassifier:
        """A copy sharing this model's groups and bank with the policies of ``state`` (from
        :meth:`_policy_state`, e.g. trained by an executor's worker)."""
        other = copy.copy(self)
        for name in self._POLICY_STATE:
            setattr(other, name, state[name])
        return other

    # ---------------------------------------------------------------- states

    def _check_fitted(self) -> None:
        check_fitted(self, "policies_")

    def _sensor_mask(self, state: int) -> int:
        mask = 0
        for g, gm in enumerate(self._group_sensor_mask):
            if state >> g & 1:
                mask |= gm
        return mask

    def _closure(self, state: int) -> int:
        have = self._sensor_mask(state)
        for g, gm in enumerate(self._group_sensor_mask):
            if gm & ~have == 0:
                state |= 1 << g
        return state

    def _check_state(self, state: int) -> None:
        self._check_fitted()
        if state not in self.policies_:
            raise ValueError(f"state {state!r} is not a state of this DAG; states: {self.states_}")

    def state_sensors(self, state: int) -> list[str]:
        """Names of the sensors acquired in ``state`` (declaration order)."""
        self._check_state(state)
        return self._mask_sensors(state)

    def state_columns(self, state: int) -> list[int]:
        """Columns of X seen in ``state``: its sensors' columns (sensors in declaration order)."""
        check_fitted(self, "_group_sensor_mask")
        mask = self._sensor_mask(state)
        return [c for i, cols in enumerate(self._sensor_columns) if mask >> i & 1 for c in cols]

    def _cols(self, state: int) -> IntArray:
        return np.asarray(self.state_columns(state), dtype=np.int64)

    def state_cost(self, state: int) -> float:
        """Total (unscaled) cost of the sensors acquired in ``state``."""
        self._check_state(state)
        mask = self._sensor_mask(state)
        return float(sum(c for i, c in enumerate(self._sensor_costs) if mask >> i & 1))

    def state_actions(self, state: int) -> list[int | None]:
        """Actions of ``state`` in filter-tree order: None = stop (action 0), then group
        indices (increasing)."""
        self._check_state(state)
        return list(self.policies_[state].actions)

    def transitions(self, state: int) -> list[tuple[int, int, float]]:
        """``(group, next state, unscaled cost of the group given state)`` per acquisition."""
        self._check_state(state)
        return list(self._transitions[state])

    # ---------------------------------------------------------------- policies

    def policy_nodes(self, state: int) -> list[dict[str, Any]]:
        """The filter tree of ``state`` in export form (see the module docstring)."""
        self._check_state(state)
        return [dict(node) for node in self._exported[state]]

    def decide(self, state: int, x_state_columns: Any) -> Any:
        """Action(s) of ``state``'s policy from the exported arrays (pure numpy; with
        confidence inputs, the state's classifier gives them): an int for a 1-D row of the
        state's columns, an array for a 2-D block."""
        nodes = self.policy_nodes(state)
        single = np.asarray(x_state_columns).ndim == 1
        out = decide_nodes(nodes, self.policy_input(state, x_state_columns))
        return int(out[0]) if single else out

    def policy_action(self, state: int, X_state_columns: Any) -> IntArray:
        """Action per row of ``state``'s policy using the fitted sklearn pipelines."""
        return self.policies_[state].predict(self.policy_input(state, X_state_columns))

    def export_policies(self) -> dict[str, Any]:
        """JSON-ready description of the DAG: sensors, groups, and per state its sensors,
        columns, actions and filter-tree nodes (arrays as lists)."""
        self._check_fitted()
        states = []
        for s in self.states_:
            nodes = [
                {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in node.items()}
                for node in self._exported[s]
            ]
            states.append(
                {
                    "state": s,
                    "sensors": self.state_sensors(s),
                    "columns": self.state_columns(s),
                    "inputs": self.state_columns(s)
                    + list(CONFIDENCE_COLUMNS[: self._n_confidence]),
                    "actions": self.state_actions(s),
                    "transitions": [list(t) for t in self._transitions[s]],
                    "nodes": nodes,
                }
            )
        return {
            "sensors": {
                n: list(c) for n, c in zip(self.sensor_names_, self._sensor_columns, strict=True)
            },
            "costs": dict(self.sensor_costs_),
            "groups": [list(g) for g in self.groups_],
            "classes": self.classes_.tolist(),
            "states": states,
        }

    # ---------------------------------------------------------------- prediction

    def _walk(self, X: Any, budget: float | None) -> tuple[IntArray, FloatArray, list[list[int]]]:
        self._check_fitted()
        Xa = np.asarray(X, dtype=np.float64)
        if Xa.ndim != 2 or Xa.shape[1] != self.n_features_in_:
            raise ValueError(
                f"X must be 2-D with {self.n_features_in_} columns, got shape {Xa.shape}"
            )
        if budget is not None and (
            isinstance(budget, bool)
            or not isinstance(budget, numbers.Real)
            or math.isnan(budget)
            or budget < 0
        ):
            raise ValueError(f"budget must be None or a number >= 0, got {budget!r}")
        n = Xa.shape[0]
        final = np.zeros(n, dtype=np.int64)
        spent = np.zeros(n)
        paths: list[list[int]] = [[0] for _ in range(n)]
        members: dict[int, list[IntArray]] = {0: [np.arange(n)]}
        for s in self.states_:  # increasing number of groups: successors come later
            parts = members.pop(s, None)
            if not parts:
                continue
            idx = np.concatenate(parts)
            if idx.size == 0:
                continue
            policy = self.policies_[s]
            if len(policy.actions) == 1:
                final[idx] = s
                continue
            acts = policy.predict(self.policy_input(s, Xa[np.ix_(idx, self._cols(s))]))
            final[idx[acts == STOP]] = s
            for a in np.unique(acts[acts != STOP]):
                rows = idx[acts == a]
                _g, nxt, step = self._transitions[s][int(a) - 1]
                if budget is not None:
                    fits = spent[rows] + step <= budget + _BUDGET_SLACK
                    final[rows[~fits]] = s
                    rows = rows[fits]
                spent[rows] += step
                for r in rows.tolist():
                    paths[r].append(nxt)
                members.setdefault(nxt, []).append(rows)
        return final, spent, paths

    def _proba_at(self, Xa: FloatArray, final: IntArray) -> FloatArray:
        proba = np.zeros((Xa.shape[0], self.classes_.size))
        for s in np.unique(final):
            rows = np.flatnonzero(final == s)
            clf = self.classifiers_[int(s)]
            if clf is None:
                proba[rows] = self.prior_
            else:
                proba[rows] = clf.predict_proba(Xa[np.ix_(rows, self._cols(int(s)))])
        return proba

    def predict_proba(self, X: Any, budget: float | None = None) -> FloatArray:
        """Class probabilities (columns: ``classes_``) from the classifier of the state where
        each row's walk stops."""
        final, _, _ = self._walk(X, budget)
        return self._proba_at(np.asarray(X, dtype=np.float64), final)

    def predict(self, X: Any, budget: float | None = None) -> npt.NDArray[Any]:
        proba = self.predict_proba(X, budget)
        return np.asarray(self.classes_[np.argmax(proba, axis=1)])

    def acquisition(
        self, X: Any, budget: float | None = None
    ) -> tuple[FloatArray, list[list[int]]]:
        """Per row: the acquired (unscaled) cost and the path of states visited (root first)."""
        _, spent, paths = self._walk(X, budget)
        return spent, paths

    def predict_with_cost(
        self, X: Any, budget: float | None = None
    ) -> tuple[npt.NDArray[Any], FloatArray, IntArray]:
        """Predictions, acquired costs and final states in one walk."""
        final, spent, _ = self._walk(X, budget)
        proba = self._proba_at(np.asarray(X, dtype=np.float64), final)
        return np.asarray(self.classes_[np.argmax(proba, axis=1)]), spent, final
