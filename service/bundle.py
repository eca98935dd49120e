"""The bundle format: the one contract between ``training`` and ``service``.

A bundle is a folder ``models/<name>/`` holding ``manifest.json`` (a :class:`Manifest`)
and one ``.onnx`` file per model. ``training`` writes it, ``service`` reads it; neither
side defines the format anywhere else. The JSON Schema published in
``service/schema/manifest.schema.json`` is generated from these classes
(``python -m service.bundle > service/schema/manifest.schema.json``).

The module stays whole (over 400 lines) on purpose: it *is* the format, one pydantic model per
manifest object with the checks that tie them together, and the published schema is generated
from it; spread over several files, the one contract would have no single place to read.
"""

from __future__ import annotations

import itertools
import json
import math
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from service.types import horner

FORMAT_VERSION: Literal[1] = 1
MANIFEST_FILE = "manifest.json"


def bundle_relative(value: str) -> str:
    """A file a manifest names: a relative path with '/' separators that stays inside the
    bundle folder (no absolute path, drive, '..' segment or backslash). Symlinks that
    escape the folder are refused when the bundle loads (``service.inference``)."""
    problem = None
    if not value or "\x00" in value:
        problem = "it is empty or holds a NUL character"
    elif "\\" in value:
        problem = "it holds a backslash; use '/' as the separator"
    elif PurePosixPath(value).is_absolute() or PureWindowsPath(value).drive:
        problem = "it is absolute"
    elif ".." in PurePosixPath(value).parts:
        problem = "it has a '..' segment"
    if problem is not None:
        raise ValueError(
            f"must be a path relative to the bundle folder and inside it; {value!r} is not: "
            f"{problem}"
        )
    return value


#: A file inside the bundle folder (see :func:`bundle_relative`).
BundleFile = Annotated[str, AfterValidator(bundle_relative)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StrategySpec(_Strict):
    """What every strategy spec of a manifest has and answers: its ``kind`` (the
    discriminator, a ``Literal`` in each subclass) and ``name``, and a description of itself
    for the API (:meth:`summary`) and for the manifest's checks (:meth:`referenced_models`,
    :meth:`check_extractors`).

    A new strategy kind subclasses this, joins :data:`Strategy` below, and registers a
    runtime typed by it (``StrategyRuntime[TheSpec]`` in ``service.strategies``); neither the
    HTTP layer nor the manifest's checks name the kinds."""

    kind: str
    name: str

    @abstractmethod
    def summary(self) -> dict[str, Any]:
        """A JSON-ready description for ``GET /models/{name}``: ``name``, ``kind``,
        ``anytime`` and what an operator needs to read the strategy (its operating points,
        sequences, lattice statistics...)."""

    @abstractmethod
    def referenced_models(self) -> set[str]:
        """Ids of the bundle's models this strategy may answer with (all must exist)."""

    def score_models(self) -> set[str]:
        """Ids of the bundle's models whose output is a vector of scores, not class
        probabilities (the loader's warm-up then checks only that it is finite)."""
        return set()

    def check_extractors(
        self, dims: Mapping[str, int], features_of: Mapping[str, set[str]]
    ) -> None:
        """Raise ``ValueError`` when the spec disagrees with the manifest's extractors
        (``dims``: extractor name -> dims) or models (``features_of``: model id -> its
        extractors); nothing to check by default."""

    def size_domain_hint(self) -> tuple[float, float] | None:
        """The item sizes the strategy was built for, when it knows them (else None)."""
        return None


class CostPolynomial(_Strict):
    """c(n) = sum_i coefficients[i] * n**i, in ``unit``, for item size ``n``.

    Coefficients are non-negative, so the curve is non-negative and non-decreasing
    for n >= 0: a superset of features never costs less than its subset.
    """

    coefficients: list[float] = Field(min_length=1, description="power basis, constant first")
    unit: str = "ms"
    quantile: float | None = Field(
        default=None, description="quantile of the measured times the curve was fitted to"
    )
    fit_error: float | None = Field(
        default=None, description="relative RMS error of the fit over the profiled sizes"
    )
    profiled_sizes: list[int] = Field(default_factory=list)

    @field_validator("coefficients")
    @classmethod
    def _non_negative(cls, value: list[float]) -> list[float]:
        if any(not math.isfinite(c) or c < 0 for c in value):
            raise ValueError(f"cost coefficients must be finite and >= 0, got {value}")
        return value

    def __call__(self, n: float) -> float:
        return float(horner(self.coefficients, n))


class ExtractorSpec(_Strict):
    """An extractor the bundle's models need: it must be installed at this version."""

    name: str = Field(description="the feature's name in this bundle")
    plugin: str | None = Field(
        default=None,
        description="entry point that provides it, when several features share one plugin "
        "with different params (e.g. 'sensor'); defaults to ``name``",
    )
    version: str
    dims: int = Field(ge=1)
    params: dict[str, Any] = Field(default_factory=dict)
    cost: CostPolynomial

    @property
    def entry_point(self) -> str:
        return self.plugin or self.name


class ModelSpec(_Strict):
    """One predictor over a feature set (extractor names, in the model's input order)."""

    id: str
    features: list[str]
    accuracy: float = Field(ge=0.0, le=1.0, description="held-out accuracy estimate")
    file: BundleFile | None = Field(
        default=None, description="ONNX file, relative to the bundle folder and inside it"
    )
    prior: list[float] | None = Field(
        default=None, description="class probabilities of the feature-less model (no file)"
    )
    input_dims: int = Field(ge=0)

    @model_validator(mode="after")
    def _file_or_prior(self) -> ModelSpec:
        if (self.file is None) == (self.prior is None):
            raise ValueError(f"model {self.id!r}: give exactly one of 'file' or 'prior'")
        if self.prior is not None and self.features:
            raise ValueError(f"model {self.id!r}: a prior model takes no features")
        return self


class PolyDomIndex(_Strict):
    """Size breakpoints x cost-sorted skylines (paper 002, Section 3.2).

    ``skylines[i]`` holds the skyline for sizes in ``[breakpoints[i], breakpoints[i+1])``
    as model ids sorted by cost at any size in that range (accuracy strictly rising).
    Sizes below ``breakpoints[0]`` use the first range, sizes above the domain the last.
    """

    breakpoints: list[float] = Field(min_length=1)
    skylines: list[list[str]] = Field(min_length=1)

    @model_validator(mode="after")
    def _aligned(self) -> PolyDomIndex:
        if len(self.breakpoints) != len(self.skylines):
            raise ValueError("index: one skyline per breakpoint is required")
        if any(a >= b for a, b in zip(self.breakpoints, self.breakpoints[1:], strict=False)):
            raise ValueError("index: breakpoints must be strictly increasing")
        return self


class PolyDomStrategy(StrategySpec):
    """Poly-Dom (paper 002). ``anytime``: re-plan after every extraction with the measured
    remaining budget (upgrade when time is left, fall back when it is not) instead of
    following the plan made at the start (the paper's static, worst-case provisioning)."""

    kind: Literal["polydom"] = "polydom"
    name: str = "polydom"
    anytime: bool = False
    epsilon: float = Field(ge=0.0)
    delta: float = Field(ge=0.0)
    size_domain: tuple[float, float]
    candidates: list[str] = Field(description="model ids of the candidate feature sets")
    index: PolyDomIndex
    stats: dict[str, float] = Field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "anytime": self.anytime,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "size_domain": self.size_domain,
            "candidates": self.candidates,
            "index_ranges": len(self.index.breakpoints),
            "stats": self.stats,
        }

    def referenced_models(self) -> set[str]:
        out = set(self.candidates)
        for skyline in self.index.skylines:
            out.update(skyline)
        return out

    def size_domain_hint(self) -> tuple[float, float]:
        return self.size_domain


class GreedySequenceSpec(_Strict):
    """One greedy order: ``features`` in the order added; ``models[k]`` answers with the
    first k features (``models[0]`` is the feature-less model)."""

    lambdas: list[str] = Field(
        min_length=1, description="trade-offs λ that produced it ('inf': cheapest first)"
    )
    features: list[str]
    models: list[str]

    @model_validator(mode="after")
    def _prefixes(self) -> GreedySequenceSpec:
        if len(self.models) != len(self.features) + 1:
            raise ValueError("a greedy sequence needs one model per prefix, the empty one too")
        return self


class GreedyStrategy(StrategySpec):
    """Greedy, Greedy-Acc, Greedy-Cost (paper 002, Alg. 4): pick a sequence by budget on the
    skyline at ``reference_size``, then add its features while this item's budget lasts."""

    kind: Literal["greedy"] = "greedy"
    name: str = "greedy"
    selection: Literal["item", "reference"] = Field(
        default="item",
        description="item: the sequence whose affordable prefix at the item's size is the "
        "most accurate; reference: the paper's choice on the skyline at reference_size",
    )
    reference_size: float = Field(gt=0)
    sequences: list[GreedySequenceSpec] = Field(min_length=1)
    skyline: list[tuple[int, int]] = Field(
        min_length=1, description="(sequence, prefix length), cost-sorted at reference_size"
    )

    @model_validator(mode="after")
    def _skyline_in_range(self) -> GreedyStrategy:
        for sequence in self.sequences:
            if len(set(sequence.features)) != len(sequence.features):
                raise ValueError(f"greedy sequence {sequence.features} repeats a feature")
        for seq, length in self.skyline:
            if not (0 <= seq < len(self.sequences)) or not (
                0 <= length <= len(self.sequences[seq].features)
            ):
                raise ValueError(f"skyline entry ({seq}, {length}) is out of range")
        return self

    def model_ids(self) -> set[str]:
        return {m for s in self.sequences for m in s.models}

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "anytime": True,
            "reference_size": self.reference_size,
            "sequences": [{"lambdas": q.lambdas, "features": q.features} for q in self.sequences],
        }

    def referenced_models(self) -> set[str]:
        return self.model_ids()

    def check_extractors(
        self, dims: Mapping[str, int], features_of: Mapping[str, set[str]]
    ) -> None:
        for sequence in self.sequences:
            if not set(sequence.features) <= set(dims):
                raise ValueError(
                    f"strategy {self.name!r}: sequence {sequence.features} names "
                    "undeclared extractors"
                )
            for k, model_id in enumerate(sequence.models):
                if model_id in features_of and features_of[model_id] != set(sequence.features[:k]):
                    raise ValueError(
                        f"strategy {self.name!r}: model {model_id!r} does not use "
                        f"exactly the first {k} features of its sequence"
                    )


class FixedPoint(_Strict):
    """The best fixed sensor subset at one cost level (issue 25): a plain pipeline that
    acquires every feature of ``model`` (cached and given ones free) and answers with it.
    Tabular strategies carry these next to their adaptive points and choose between all of
    them by validation accuracy, so a budget never buys less than the best fixed subset the
    builder found for it."""

    model: str = Field(description="id of a bundle model; its features are the subset")
    accuracy: float = Field(
        ge=0,
        le=1,
        description="accuracy on the validation rows (the rows every choice is made on; "
        "the service chooses between points by it)",
    )
    learner: str = Field(default="", description="what the model is, for reading")


class CappedNumbers(_Strict):
    """A point's validation numbers when every walk is stopped at ``cap`` (the budget is a
    per-item hard cap: a walk that would pay more answers where it is). A point lists them
    at every cap where they change, the last at its longest walk's cost (its own numbers)."""

    cap: float = Field(ge=0)
    accuracy: float = Field(ge=0, le=1)
    mean_cost: float = Field(ge=0)


def check_caps(caps: Sequence[CappedNumbers], what: str) -> None:
    if any(a.cap >= b.cap for a, b in itertools.pairwise(caps)):
        raise ValueError(f"{what}: the caps of `capped` must be strictly increasing")


class AdaptiveWithFixed(StrategySpec):
    """What the tabular adaptive strategies (DAG, gating, CSTC/CSCC) share: the best fixed
    sensor subsets (``fixed``) and the ``tolerance`` of the budget → point choice. Per request
    the runtime lists every point (adaptive or fixed) whose cost fits the budget with the
    validation accuracy it can deliver under it, and serves the most accurate, or, among
    those within ``tolerance`` of it, the cheapest. A request may send its own tolerance."""

    fixed: list[FixedPoint] = Field(
        default_factory=list,
        description="the best fixed sensor subset per cost level (validation Pareto set), "
        "chosen between with the adaptive points by validation accuracy",
    )
    tolerance: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="points whose deliverable validation accuracy is within this much of the "
        "best one the budget affords count as equal, and the cheapest is taken (0: the most "
        "accurate; a request's 'tolerance' overrides it)",
    )
    margin: float = Field(
        default=0.0,
        ge=0,
        description="an adaptive point is ranked against the fixed subsets with this many "
        "standard errors of the best affordable fixed subset's validation accuracy "
        "(sqrt(p(1 - p) / validation_rows)) taken off its own: of many adaptive points the "
        "best on validation is optimistic, so it replaces the fixed pipeline only when it "
        "beats it by more than the noise (0: by any amount)",
    )
    validation_rows: int = Field(
        default=0, ge=0, description="how many validation rows the accuracies were measured on"
    )

    @model_validator(mode="after")
    def _unique_fixed(self) -> AdaptiveWithFixed:
        models = [p.model for p in self.fixed]
        if len(set(models)) != len(models):
            raise ValueError(f"strategy {self.name!r}: a fixed point is listed twice in {models}")
        return self

    def fixed_models(self) -> set[str]:
        return {p.model for p in self.fixed}

    def fixed_summary(self) -> dict[str, Any]:
        return {
            "tolerance": self.tolerance,
            "margin": self.margin,
            "validation_rows": self.validation_rows,
            "fixed": [p.model_dump() for p in self.fixed],
        }


class DagNode(_Strict):
    """An internal node of a state's filter tree. A child ``>= 0`` is another node's index,
    ``< 0`` the leaf action ``-child - 1`` (0: stop and classify, g + 1: acquire group g).
    The node goes right when ``logits[logit] > 0``, or always right / left when ``logit`` is
    None and ``constant`` is True / False."""

    left: int
    right: int
    logit: int | None = None
    constant: bool | None = None

    @model_validator(mode="after")
    def _decision(self) -> DagNode:
        if (self.logit is None) == (self.constant is None):
            raise ValueError("a DAG node needs exactly one of 'logit' or 'constant'")
        return self


class DagState(_Strict):
    groups: int = Field(ge=0, description="bitmask of the groups acquired in this state")
    model: str = Field(description="the classifier that answers in this state")
    transitions: list[int] = Field(
        default_factory=list,
        description="next state (groups bitmask) of each acquisition action, in action order "
        "(action a >= 1 leads to transitions[a - 1])",
    )
    tree: list[DagNode] = Field(
        default_factory=list, description="filter tree over the actions; empty: always stop"
    )


class DagPolicy(_Strict):
    """One operating point of the trade-off sweep (sensor cost multiplier)."""

    cost_scale: float = Field(ge=0)
    mean_cost: float = Field(ge=0, description="average acquired cost on the validation rows")
    error: float = Field(ge=0, le=1, description="error rate on the validation rows")
    file: BundleFile = Field(
        description="ONNX model (relative to the bundle folder, inside it): input 'features' "
        "(1 x sum of the inputs' dims: the acquired "
        "extractors' values in `inputs` order, zeros elsewhere; with confidence_inputs, two "
        "more columns) -> output 'logits' (1 x nodes)"
    )
    confidence_inputs: bool = Field(
        default=False,
        description="the input ends with the current state's classifier's top class "
        "probability and its margin over the second (the runtime computes them with the "
        "state's model from the features in hand); only that state's nodes are read",
    )
    states: list[DagState] = Field(min_length=1)
    capped: list[CappedNumbers] = Field(
        default_factory=list,
        description="validation numbers with every walk stopped at each cap (empty: the "
        "point is an option only where its mean_cost fits, at 1 - error)",
    )

    @model_validator(mode="after")
    def _caps(self) -> DagPolicy:
        check_caps(self.capped, f"DAG policy {self.file!r}")
        return self


class DagStrategy(AdaptiveWithFixed):
    """Adaptive sensor acquisition on a DAG of states (paper 000): per item, each state's
    policy decides from the values acquired so far to stop or to acquire a group next."""

    kind: Literal["dag"] = "dag"
    name: str = "dag"
    groups: list[list[str]] = Field(min_length=1, description="extractor names per group")
    inputs: list[str] = Field(min_length=1, description="extractor order of the policy input")
    policies: list[DagPolicy] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> DagStrategy:
        known = set(self.inputs)
        for group in self.groups:
            if not group or not set(group) <= known:
                raise ValueError(f"DAG group {group} must be non-empty and among the inputs")
        full = (1 << len(self.groups)) - 1
        for policy in self.policies:
            states = {s.groups for s in policy.states}
            if 0 not in states:
                raise ValueError("a DAG policy needs the root state (no groups)")
            for state in policy.states:
                if state.groups & ~full:
                    raise ValueError(f"DAG state {state.groups} names unknown groups")
                for target in state.transitions:
                    if (
                        target not in states
                        or target == state.groups
                        or target & state.groups != state.groups
                    ):
                        raise ValueError(
                            f"DAG state {state.groups}: transition to {target} is not a "
                            "strictly larger state of the policy"
                        )
                for index, node in enumerate(state.tree):
                    for child in (node.left, node.right):
                        # Pre-order: a child comes after its parent, so walks always end.
                        if (
                            child >= len(state.tree)
                            or 0 <= child <= index
                            or (child < 0 and (-child - 1) > len(state.transitions))
                        ):
                            raise ValueError(f"DAG node child {child} is out of range")
            if len(states) != len(policy.states):
                raise ValueError("a DAG policy lists a state twice")
        if len(set(self.inputs)) != len(self.inputs):
            raise ValueError(f"DAG inputs repeat an extractor: {self.inputs}")
        return self

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "anytime": True,
            "groups": self.groups,
            "policies": [
                {
                    "cost_scale": p.cost_scale,
                    "mean_cost": p.mean_cost,
                    "error": p.error,
                    "states": len(p.states),
                }
                for p in self.policies
            ],
            **self.fixed_summary(),
        }

    def referenced_models(self) -> set[str]:
        return {s.model for p in self.policies for s in p.states} | self.fixed_models()

    def check_extractors(
        self, dims: Mapping[str, int], features_of: Mapping[str, set[str]]
    ) -> None:
        if not set(self.inputs) <= set(dims):
            raise ValueError(f"strategy {self.name!r} reads undeclared extractors")


class GatePoint(_Strict):
    """One operating point of a gating sweep (paper 001): a gate g, a low-cost model f1 and
    the high-cost model f0. g reads ``gate_features``; f1 (``low_model``) reads its own
    features; g's and f1's features are computed first, then g decides whether f1 answers or
    the item goes on to f0 (``high_model``), whose missing features are computed only then."""

    id: str = Field(description="unique within the strategy, e.g. 'adapt-gbrt-p0.3-l0.01'")
    method: str = Field(
        description="how it was trained: adapt-gbrt, adapt-lin, l1, greedymiser, confidence "
        "(the gate is f1's top probability: below the point's level the item goes on)"
    )
    p_full: float = Field(ge=0, le=1, description="the training bound on the fraction sent to f0")
    regularisation: float = Field(ge=0, description="the cost weight (gamma or lambda)")
    gate_file: BundleFile | None = Field(
        default=None,
        description="ONNX gate (relative to the bundle folder, inside it): one input "
        "(1 x sum of gate_features' dims, their values "
        "concatenated in order) -> one output of shape (1, 1), the gate score; a score above "
        "``threshold`` sends the item to f0. None: the gate never does (f1 answers everything)",
    )
    gate_features: list[str] = Field(default_factory=list)
    gate_input_dims: int = Field(default=0, ge=0)
    threshold: float = Field(default=0.0, allow_inf_nan=False)
    low_model: str = Field(description="id of f1 among the bundle's models")
    high_model: str = Field(
        description="id of the high-cost model among the bundle's models (f0, or a fixed "
        "subset's model): it differs from f1 when there is a gate (checked when the service "
        "loads the bundle); the features it reads that g and f1 do not are computed only for "
        "the items the gate sends on"
    )
    mean_cost: float = Field(ge=0, description="average feature cost per validation row")
    fraction_full: float = Field(
        ge=0,
        le=1,
        description="fraction of validation rows sent to the high-cost model; the service's "
        "expected cost of the point at an item's size is c(g's and f1's features) + "
        "fraction_full x c(the high-cost model's others)",
    )
    accuracy: float = Field(
        ge=0, le=1, description="validation accuracy of the gated system (chosen by)"
    )

    @model_validator(mode="after")
    def _gate(self) -> GatePoint:
        if self.gate_file is None and (self.gate_features or self.gate_input_dims):
            raise ValueError(f"gate point {self.id!r}: gate features without a gate file")
        if len(set(self.gate_features)) != len(self.gate_features):
            raise ValueError(f"gate point {self.id!r}: gate_features repeat an extractor")
        return self


class GatingStrategy(AdaptiveWithFixed):
    """Adaptive gating between a low-cost and a high-cost model (paper 001: ADAPT-LIN,
    ADAPT-GBRT, the L1 baseline, GreedyMiser). ``points`` is the Pareto set of a (P_full,
    gamma/lambda) sweep; per request the runtime serves the point that delivers the most
    accuracy under the budget (within ``tolerance``, the cheapest on average)."""

    kind: Literal["gating"] = "gating"
    name: str = "gating"
    points: list[GatePoint] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> GatingStrategy:
        ids = [p.id for p in self.points]
        if len(set(ids)) != len(ids):
            raise ValueError(f"gating strategy {self.name!r}: duplicate point ids in {ids}")
        return self

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "anytime": True,
            "points": [
                {
                    "id": p.id,
                    "method": p.method,
                    "p_full": p.p_full,
                    "regularisation": p.regularisation,
                    "gated": p.gate_file is not None,
                    "gate_features": p.gate_features,
                    "low_model": p.low_model,
                    "high_model": p.high_model,
                    "mean_cost": p.mean_cost,
                    "fraction_full": p.fraction_full,
                    "accuracy": p.accuracy,
                }
                for p in self.points
            ],
            **self.fixed_summary(),
        }

    def referenced_models(self) -> set[str]:
        points = {m for p in self.points for m in (p.low_model, p.high_model)}
        return points | self.fixed_models()

    def check_extractors(
        self, dims: Mapping[str, int], features_of: Mapping[str, set[str]]
    ) -> None:
        for point in self.points:
            unknown = [f for f in point.gate_features if f not in dims]
            if unknown:
                raise ValueError(
                    f"strategy {self.name!r}: gate of {point.id!r} reads undeclared "
                    f"extractors {unknown}"
                )
            if point.gate_input_dims != sum(dims[f] for f in point.gate_features):
                raise ValueError(
                    f"strategy {self.name!r}: gate of {point.id!r}: "
                    "gate_input_dims disagrees with its extractors"
                )


class CstcNode(_Strict):
    """A node of a cost-sensitive tree or cascade (paper 003). It reads ``features`` (the
    cost groups its weights use), answers with ``model`` (a bundle model over features in hand
    when the walk is at the node: its own and its ancestors'; the node's classifier, e.g. the
    trained linear node over its own features, or boosted trees refit on every feature the
    path bought) and, when it has a child, routes:
    score = Σ route_weights · (its features' values concatenated in ``features`` order) +
    route_bias, to ``upper`` when score > 0 and to ``lower`` otherwise. A child of None is a
    terminal element: the node's own model answers."""

    model: str
    features: list[str] = Field(default_factory=list)
    route_weights: list[float] = Field(default_factory=list)
    route_bias: float = Field(default=0.0, allow_inf_nan=False)
    upper: int | None = None
    lower: int | None = None
    exit_confidence: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="a confidence exit: the node answers when its model's top class "
        "probability is at least this, else the walk goes on: to its one child (a cascade's "
        "stage; its routing weights are then not used) or, with two children (a tree's "
        "routing node), by its routing score",
    )

    @property
    def scores_routes(self) -> bool:
        """Whether the walk leaves this node by its routing score (a node with children,
        unless a confidence exit sends it on to its one child)."""
        if self.upper is None and self.lower is None:
            return False
        return self.exit_confidence is None or (self.upper is not None and self.lower is not None)


class CstcPoint(_Strict):
    """One operating point (a trade-off λ): a tree (CSTC) or cascade (CSCC, Cronus) whose
    node 0 is the root; children come after their parent."""

    id: str
    method: str = Field(description="cstc | cscc | cronus | root-only | cscc-exit | cstc-exit")
    lam: float = Field(ge=0)
    mean_cost: float = Field(ge=0, description="average cost per validation row")
    accuracy: float = Field(ge=0, le=1, description="validation accuracy of the hard walk")
    nodes: list[CstcNode] = Field(min_length=1)
    feature_rates: dict[str, float] | None = Field(
        default=None,
        description="fraction of held-out items whose walk acquires each feature; when "
        "given (bundles whose costs depend on the item's size, e.g. images), the point's "
        "average cost at size n is Σ rate_f · c_f(n) instead of ``mean_cost``",
    )
    capped: list[CappedNumbers] = Field(
        default_factory=list,
        description="validation numbers with every walk stopped at each cap (declared "
        "costs; empty: the point is an option only where its mean_cost and root fit)",
    )

    @model_validator(mode="after")
    def _tree(self) -> CstcPoint:
        check_caps(self.capped, f"cstc point {self.id!r}")
        for index, node in enumerate(self.nodes):
            for child in (node.upper, node.lower):
                if child is not None and not index < child < len(self.nodes):
                    raise ValueError(
                        f"cstc point {self.id!r}: node {index} has child {child}; a child "
                        f"must come after its parent and be one of the {len(self.nodes)} nodes"
                    )
            routes = node.upper is not None or node.lower is not None
            if node.exit_confidence is not None and not routes:
                raise ValueError(
                    f"cstc point {self.id!r}: node {index} has a confidence exit but no child "
                    "(where the walk goes on when the model is not confident); a leaf answers "
                    "without one: drop its exit_confidence"
                )
            if node.scores_routes and node.features and not node.route_weights:
                raise ValueError(f"cstc point {self.id!r}: node {index} routes without weights")
        if self.feature_rates is not None:
            read = {f for node in self.nodes for f in node.features}
            bad = {f: r for f, r in self.feature_rates.items() if f not in read or not 0 <= r <= 1}
            if bad:
                raise ValueError(
                    f"cstc point {self.id!r}: feature_rates {bad} name features no node reads "
                    f"or rates outside [0, 1]; give a rate in [0, 1] for features of {sorted(read)}"
                )
        return self

    def ancestors_features(self) -> list[set[str]]:
        """Per node, the features its ancestors read (in hand when the walk reaches it)."""
        held: list[set[str]] = [set() for _ in self.nodes]
        for index, node in enumerate(self.nodes):
            for child in (node.upper, node.lower):
                if child is not None:
                    held[child] = held[index] | set(node.features)
        return held


class CstcStrategy(AdaptiveWithFixed):
    """Cost-sensitive trees and cascades of classifiers (paper 003). Per request the budget
    picks the most accurate point whose average cost fits (within ``tolerance``, the
    cheapest); the item walks its nodes, each acquiring only its missing features, with the
    budget as a hard cap (a node that cannot be paid for ends the walk at its parent)."""

    kind: Literal["cstc"] = "cstc"
    name: str = "cstc"
    points: list[CstcPoint] = Field(min_length=1)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "anytime": True,
            "points": [
                {
                    "id": p.id,
                    "method": p.method,
                    "lam": p.lam,
                    "mean_cost": p.mean_cost,
                    "accuracy": p.accuracy,
                    "nodes": len(p.nodes),
                }
                for p in self.points
            ],
            **self.fixed_summary(),
        }

    def referenced_models(self) -> set[str]:
        return {n.model for p in self.points for n in p.nodes} | self.fixed_models()

    def check_extractors(
        self, dims: Mapping[str, int], features_of: Mapping[str, set[str]]
    ) -> None:
        for point in self.points:
            held = point.ancestors_features()
            for index, node in enumerate(point.nodes):
                where = f"strategy {self.name!r}, point {point.id!r}, node {index}"
                unknown = [f for f in node.features if f not in dims]
                if unknown:
                    raise ValueError(f"{where} reads undeclared extractors {unknown}")
                in_hand = set(node.features) | held[index]
                if node.model in features_of and not features_of[node.model] <= in_hand:
                    raise ValueError(
                        f"{where}: model {node.model!r} reads "
                        f"{sorted(features_of[node.model] - in_hand)}, which the walk has not "
                        f"bought when it is at the node (it holds {sorted(in_hand)})"
                    )
                width = sum(dims[f] for f in node.features)
                if node.scores_routes and len(node.route_weights) != width:
                    raise ValueError(
                        f"{where}: {len(node.route_weights)} route weights for {width} inputs"
                    )


class StructuredTemplate(_Strict):
    """A feature template of a structured strategy (paper 004): extractor ``{name}@{p}``
    computes it for part p; ``model`` scores it (ONNX: (n, dims) -> (n, labels), what the
    template adds to each label's emission score)."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    base: bool = Field(description="computed for every part before the policy runs (S0)")
    cost: float = Field(ge=0, description="measured cost of one part's template, in ms")
    model: str = Field(description="id of the emission scorer among the bundle's models")


class _StructuredStrategy(StrategySpec):
    """What both structured strategies share: the templates, the linear chain (emission
    ``base`` + Σ template scores, ``transition[a][b]``, ``start``, ``end``; labels are the
    manifest's classes), the policy scorer and the decoding cost."""

    templates: list[StructuredTemplate] = Field(min_length=1)
    base: list[float]
    transition: list[list[float]]
    start: list[float]
    end: list[float]
    answer_model: str = Field(description="model id reported as answering (the chain)")
    policy_file: BundleFile = Field(
        description="ONNX policy scorer: input 'features' (n parts x policy_input_dims, "
        "recipe `policy_inputs`) -> output 'scores' (n x columns)"
    )
    policy_inputs: Literal["letters-v1"] = "letters-v1"
    policy_input_dims: int = Field(ge=1)
    decode_cost: float = Field(
        ge=0,
        description="measured time per part of decoding and of the request loop, in ms "
        "(bundles without policy_cost: of the policy too): reserved for the answer",
    )
    policy_cost: float = Field(
        0.0,
        ge=0,
        description="measured time per part of the policy (its inputs and scorer), in ms: "
        "reserved until the policy has run",
    )
    max_parts: int = Field(ge=1)

    @model_validator(mode="after")
    def _shapes(self) -> _StructuredStrategy:
        y = len(self.base)
        if len(self.transition) != y or any(len(r) != y for r in self.transition):
            raise ValueError(f"strategy {self.name!r}: transition must be {y} x {y}")
        if len(self.start) != y or len(self.end) != y:
            raise ValueError(f"strategy {self.name!r}: start and end need {y} scores")
        if not any(t.base for t in self.templates):
            raise ValueError(f"strategy {self.name!r}: at least one template must be base")
        return self

    def extractor_names(self) -> list[str]:
        return [f"{t.name}@{p}" for p in range(self.max_parts) for t in self.templates]

    def referenced_models(self) -> set[str]:
        return {t.model for t in self.templates} | {self.answer_model}

    def score_models(self) -> set[str]:
        return {t.model for t in self.templates}  # emission scores

    def check_extractors(
        self, dims: Mapping[str, int], features_of: Mapping[str, set[str]]
    ) -> None:
        missing = [n for n in self.extractor_names() if n not in dims]
        if missing:
            raise ValueError(
                f"strategy {self.name!r} needs extractors {missing[:4]} (one per template and "
                "part), which the manifest does not declare"
            )

    def _summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "anytime": True,
            "templates": [t.model_dump() for t in self.templates],
            "max_parts": self.max_parts,
            "decode_cost": self.decode_cost,
            "policy_cost": self.policy_cost,
        }


class StructuredOperatingPoint(_Strict):
    """One one-shot policy (a λ and class weight of Thm 2.2's weighted classifier)."""

    lam: float = Field(ge=0)
    positive_weight: float = Field(gt=0)
    column: int = Field(ge=0, description="first column of its scores in the policy output")
    mean_cost: float = Field(ge=0, description="mean template cost per part, in ms")
    train_accuracy: float = Field(
        ge=0,
        le=1,
        description="letter accuracy on the policy's own (cross-fitted) training "
        "words; held-out numbers are the benchmark's",
    )


class StructuredOneShotStrategy(_StructuredStrategy):
    """Paper 004's one-shot policy: after the base templates, one weighted classifier per
    part picks its templates (edgeless policy graph); the operating point is the most
    expensive one whose expected cost for the item fits the budget."""

    kind: Literal["structured-oneshot"] = "structured-oneshot"
    name: str = "structured-oneshot"
    subsets: list[list[str]] = Field(
        min_length=2, description="labels of the per-part classifier: optional template sets"
    )
    points: list[StructuredOperatingPoint] = Field(min_length=1)

    def summary(self) -> dict[str, Any]:
        out = self._summary()
        out["points"] = [p.model_dump() for p in self.points]
        return out


class StopPoint(_Strict):
    """One row of an anytime strategy's stop table: the threshold training chose for a
    tolerance (the accuracy with every budget it may cost on the policy examples)."""

    tolerance: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)
    stop_below: float | None = Field(
        default=None, allow_inf_nan=False, description="null: no threshold kept that accuracy"
    )


class StructuredAnytimeStrategy(_StructuredStrategy):
    """Paper 004's anytime policy (Alg. 1/2): π_t adds the (part, template) pair of highest
    score in column ``t * len(optional) + j``; steps past ``steps`` use the last policy."""

    kind: Literal["structured-anytime"] = "structured-anytime"
    name: str = "structured-anytime"
    optional: list[str] = Field(min_length=1, description="templates the policy adds")
    steps: int = Field(ge=1)
    stop_below: float | None = Field(
        default=None,
        allow_inf_nan=False,
        description="Alg. 2 stops at the first step whose best pair scores below this, "
        "before the budget is spent (an item the policies see as done); null: never",
    )
    stops: list[StopPoint] = Field(
        default_factory=list,
        description="the threshold for each tolerance a request may send (by tolerance, "
        "ascending; a request's threshold is that of the largest tolerance at most its own, "
        "none: no stop); empty: requests cannot set a tolerance",
    )

    @model_validator(mode="after")
    def _stops_ascending(self) -> StructuredAnytimeStrategy:
        tolerances = [p.tolerance for p in self.stops]
        if tolerances != sorted(set(tolerances)):
            raise ValueError(
                f"strategy {self.name!r}: stops must have distinct tolerances in ascending "
                f"order, got {tolerances}"
            )
        return self

    def summary(self) -> dict[str, Any]:
        out = self._summary()
        out["optional"] = self.optional
        out["steps"] = self.steps
        out["stop_below"] = self.stop_below
        out["stops"] = [p.model_dump() for p in self.stops]
        return out


ParserPolicy = Literal["oneshot", "anytime", "myopic", "uniform-word", "uniform-sentence"]


class ParserPoint(_Strict):
    """One operating point of a parser strategy: how its policy gives words ψ^Full, and what
    it delivered on held-out sentences (``uas``, ``full_fraction``: the share of words that
    got ψ^Full)."""

    id: str
    policy_file: BundleFile | None = Field(
        default=None,
        description="oneshot / anytime: float64 .npy of the linear word policy, intercept "
        "last; oneshot: shape (policy_features + 1,), a word scoring > 0 gets ψ^Full; "
        "anytime: shape (policy_features + 1, T), column t the step policy π_t of Alg. 1 "
        "(step t upgrades π_t's best word not yet upgraded, π_T every later step; a 1-D "
        "array is one policy for every step) while the budget lasts",
    )
    threshold: float = Field(
        default=0.0,
        allow_inf_nan=False,
        description="myopic: ψ^Full for every word when the all-ψ^POS parse's mean margin "
        "is below this; uniform-word / uniform-sentence: the probability of ψ^Full per word "
        "/ per sentence",
    )
    full_fraction: float = Field(ge=0, le=1)
    uas: float = Field(ge=0, le=1, description="held-out unlabelled attachment score")


class ParserStrategy(StrategySpec):
    """Dependency parsing under a time budget (paper 004): an arc-factored parser whose
    words each get ψ^POS or ψ^Full (extractors ``pos@i`` / ``lex@i``, ψ^Full = both), chosen
    by ``policy``; decoded by Chu–Liu–Edmonds. Per request the runtime serves the most
    accurate point whose expected cost at the sentence's length fits the budget."""

    kind: Literal["parser"] = "parser"
    name: str = "parser"
    policy: ParserPolicy
    weights: BundleFile = Field(description="float32 .npy of the hashed edge weights")
    buckets: int = Field(ge=2, description="length of the weight array (a power of two)")
    max_tokens: int = Field(ge=1)
    policy_features: int = Field(ge=1, description="dims per word of the 'words' extractor")
    decode_cost: CostPolynomial = Field(description="scoring + decoding time at n tokens")
    points: list[ParserPoint] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_points(self) -> ParserStrategy:
        ids = [p.id for p in self.points]
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise ValueError(f"strategy {self.name!r}: duplicate point ids {repeated}")
        return self

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "anytime": self.policy == "anytime",
            "policy": self.policy,
            "max_tokens": self.max_tokens,
            "points": [p.model_dump(exclude={"policy_file"}) for p in self.points],
        }

    def referenced_models(self) -> set[str]:
        return set()

    def check_extractors(
        self, dims: Mapping[str, int], features_of: Mapping[str, set[str]]
    ) -> None:
        needed = {"words": self.max_tokens * self.policy_features}
        for i in range(self.max_tokens + 1):
            needed[f"pos@{i}"] = -1
            if i:
                needed[f"lex@{i}"] = -1
        missing = sorted(set(needed) - set(dims))
        if missing:
            raise ValueError(
                f"strategy {self.name!r} needs extractors {missing[:5]}"
                f"{' …' if len(missing) > 5 else ''} (one pos@i and lex@i per word position)"
            )
        if dims["words"] != needed["words"]:
            raise ValueError(
                f"strategy {self.name!r}: extractor 'words' has {dims['words']} dims, "
                f"expected max_tokens x policy_features = {needed['words']}"
            )


# New strategy kinds join this union; the discriminator is ``kind``.
Strategy = Annotated[
    PolyDomStrategy
    | GreedyStrategy
    | DagStrategy
    | GatingStrategy
    | CstcStrategy
    | StructuredOneShotStrategy
    | StructuredAnytimeStrategy
    | ParserStrategy,
    Field(discriminator="kind"),
]
AnyStrategy = (
    PolyDomStrategy
    | GreedyStrategy
    | DagStrategy
    | GatingStrategy
    | CstcStrategy
    | StructuredOneShotStrategy
    | StructuredAnytimeStrategy
    | ParserStrategy
)


class TaggerSpec(_Strict):
    """A tokens bundle's part-of-speech tagger (``service.extractors.tagging``): tokens sent
    without ``upos`` are tagged by it while the item is decoded."""

    file: BundleFile = Field(
        description="float32 .npy of the tagger's hashed weights, (buckets, 17): one column "
        "per universal POS tag, buckets a power of two"
    )
    accuracy: float | None = Field(
        default=None, ge=0, le=1, description="its tag accuracy on held-out sentences"
    )


class ItemSpec(_Strict):
    """What ``POST /predict`` accepts as ``item`` for this bundle.

    ``image``: ``{"id"?, "image_base64" (or "png_base64")}``, a PNG, JPEG or WebP,
    decoded to a luma plane or, with ``channels: rgb``, to three channels; size = pixel
    count (width x height). ``tabular``:
    ``{"id"?, "values"?: {column: number}}`` with any subset of ``columns`` (the values the
    client has; the other sensors are acquired by ``id`` or named as missing), size = 1.
    ``letters``: ``{"id"?, "letters": [16 x 8 0/1 rows, or a base64 PNG, per letter]}``,
    size = the number of letters (at most ``max_letters``).
    ``tokens``: ``{"id"?, "tokens": [{"form": str, "upos"?: str}, ...]}``, a sentence for a
    parser, size = number of tokens (at most ``max_tokens``); a token without ``upos`` is
    tagged by the bundle's ``tagger`` (without one: every token needs its tag).
    """

    kind: Literal["image", "tabular", "letters", "tokens"] = "image"
    max_pixels: int = Field(default=1 << 22, ge=1)
    min_side: int = Field(default=8, ge=1, description="smallest width or height accepted")
    columns: list[str] = Field(default_factory=list, description="tabular: the value names")
    size_unit: str = "pixels"
    channels: Literal["gray", "rgb"] = Field(
        default="gray",
        description="image: what extractors get, one luma plane (H, W) or three colour "
        "channels (H, W, 3), for extractors that read colour",
    )
    max_letters: int = Field(
        default=14, ge=1, description="letters: the most letters a word may have"
    )
    max_tokens: int = Field(
        default=120, ge=1, description="tokens: the longest sentence accepted (413 beyond)"
    )
    tagger: TaggerSpec | None = Field(
        default=None, description="tokens: tags the tokens sent without `upos` (None: all need it)"
    )

    #: The fields that apply to each kind (``kind`` and ``size_unit`` to all).
    KIND_FIELDS: ClassVar[dict[str, tuple[str, ...]]] = {
        "image": ("max_pixels", "min_side", "channels"),
        "tabular": ("columns",),
        "letters": ("max_letters",),
        "tokens": ("max_tokens", "tagger"),
    }

    def described(self) -> dict[str, Any]:
        """The fields that apply to this kind of item (what ``GET /models/{name}`` shows: a
        tabular bundle has no ``max_pixels``)."""
        keep = ("kind", "size_unit", *self.KIND_FIELDS[self.kind])
        return self.model_dump(include=set(keep))

    @model_validator(mode="after")
    def _columns(self) -> ItemSpec:
        if self.kind == "tabular" and not self.columns:
            raise ValueError("a tabular item spec needs its columns")
        if self.tagger is not None and self.kind != "tokens":
            raise ValueError(f"only a tokens item spec can have a tagger, not {self.kind!r}")
        return self


class Provenance(_Strict):
    created_at: str
    data_fingerprint: str
    parameters: dict[str, Any] = Field(default_factory=dict)
    libraries: dict[str, str] = Field(default_factory=dict)
    host: dict[str, str] = Field(default_factory=dict)


class Manifest(_Strict):
    format_version: Literal[1] = FORMAT_VERSION
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$")
    version: str
    task: Literal["classification", "parsing"] = Field(
        default="classification",
        description="parsing: the answer is a dependency tree (heads per token), not a class; "
        "such bundles have no classes and no models",
    )
    classes: list[str] = Field(default_factory=list)
    cost_unit: str = "ms"
    cost_basis: Literal["measured", "declared"] = Field(
        default="measured",
        description="measured: a request spends the wall time of its work (budgets in ms); "
        "declared: it spends the declared cost of each feature it acquires (any unit)",
    )
    item: ItemSpec
    extractors: list[ExtractorSpec]
    models: list[ModelSpec] = Field(default_factory=list)
    strategies: list[Strategy] = Field(min_length=1)
    default_strategy: str = Field(description="name of the strategy used when a request names none")
    provenance: Provenance

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.task == "classification" and (len(self.classes) < 2 or not self.models):
            raise ValueError("a classification bundle needs at least 2 classes and 1 model")
        names = [e.name for e in self.extractors]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate extractor names in {names}")
        dims = {e.name: e.dims for e in self.extractors}
        ids = [m.id for m in self.models]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate model ids")
        for model in self.models:
            unknown = [f for f in model.features if f not in dims]
            if unknown:
                raise ValueError(f"model {model.id!r} uses undeclared extractors {unknown}")
            if model.file is not None and model.input_dims != sum(dims[f] for f in model.features):
                raise ValueError(f"model {model.id!r}: input_dims disagrees with its extractors")
            if model.prior is not None and len(model.prior) != len(self.classes):
                raise ValueError(f"model {model.id!r}: prior has the wrong number of classes")
        known = set(ids)
        names = [s.name for s in self.strategies]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate strategy names in {names}")
        if self.default_strategy not in names:
            raise ValueError(f"default_strategy {self.default_strategy!r} is not one of {names}")
        features_of = {m.id: set(m.features) for m in self.models}
        for strategy in self.strategies:
            strategy.check_extractors(dims, features_of)
            self._check_item_limit(strategy)
            missing = sorted(strategy.referenced_models() - known)
            if missing:
                raise ValueError(f"strategy {strategy.name!r} references unknown models {missing}")
        return self

    def _check_item_limit(self, strategy: StrategySpec) -> None:
        """An item the decoder accepts must be one the strategy can serve: a longer word or
        sentence would otherwise fail in the middle of a request."""
        if isinstance(strategy, _StructuredStrategy) and self.item.kind == "letters":
            accepted, served, unit = self.item.max_letters, strategy.max_parts, "letters"
            fields = "item.max_letters", "max_parts"
        elif isinstance(strategy, ParserStrategy) and self.item.kind == "tokens":
            accepted, served, unit = self.item.max_tokens, strategy.max_tokens, "tokens"
            fields = "item.max_tokens", "max_tokens"
        else:
            return
        if accepted > served:
            raise ValueError(
                f"{fields[0]} = {accepted} accepts longer items than strategy "
                f"{strategy.name!r} serves ({fields[1]} = {served} {unit}): lower "
                f"{fields[0]} to {served} or rebuild the strategy for {accepted}"
            )

    def polydom(self) -> PolyDomStrategy:
        """The first Poly-Dom strategy (its lattice statistics and index); KeyError if none."""
        for s in self.strategies:
            if isinstance(s, PolyDomStrategy):
                return s
        raise KeyError("polydom")

    def strategy(self, name: str | None = None) -> AnyStrategy:
        """The strategy called ``name`` (the default one when None); KeyError if absent."""
        wanted = self.default_strategy if name is None else name
        for s in self.strategies:
            if s.name == wanted:
                return s
        raise KeyError(wanted)

    def model(self, model_id: str) -> ModelSpec:
        for m in self.models:
            if m.id == model_id:
                return m
        raise KeyError(model_id)

    def extractor(self, name: str) -> ExtractorSpec:
        for e in self.extractors:
            if e.name == name:
                return e
        raise KeyError(name)


def model_id_for(features: Sequence[str]) -> str:
    """Canonical model id of a feature set: sorted names joined by '+', or 'prior'."""
    return "+".join(sorted(features)) if features else "prior"


def read_manifest(bundle_dir: Path) -> Manifest:
    """Parse ``bundle_dir/manifest.json``; raises ``ValueError`` (pydantic) or ``OSError``."""
    return Manifest.model_validate_json((bundle_dir / MANIFEST_FILE).read_bytes())


def write_manifest(bundle_dir: Path, manifest: Manifest) -> Path:
    path = bundle_dir / MANIFEST_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(manifest.model_dump_json(indent=2) + "\n")
    tmp.replace(path)
    return path


def json_schema() -> dict[str, Any]:
    return Manifest.model_json_schema()


if __name__ == "__main__":  # pragma: no cover - regenerates the published schema
    print(json.dumps(json_schema(), indent=2))
