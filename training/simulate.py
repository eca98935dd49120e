"""Simulate the service's budget strategies on the synthetic Poly-Dom workload (Metric 4).

Paper 002 provisions its static Poly-Dom for worst-case (p95) extraction costs; on real data,
where costs vary around their median, the anytime Greedy variants beat it. This module
reproduces that setting without images or models:

* :func:`synthetic_bundle` takes a synthetic workload (``training.polydom.synthetic``),
  treats its cost curves as the *median* costs, ships p95 curves (median × exp(1.645 σ), the
  95th percentile of a log-normal spread σ) as every strategy's cost model, fits Poly-Dom and
  the three Greedy variants on them and builds a real :class:`~service.bundle.Manifest` and
  the real strategy runtimes of ``service.strategies``.
* :func:`simulate` drives one request through a runtime with the service's own loop
  (``service.execution.run_session``, which ``execute`` uses too), except that each
  extraction "takes" median(n) × LogNormal(0, σ) (:class:`SimulatedCost`) instead of
  running an extractor (:class:`SimulatedSource`).
* :func:`sweep` runs N requests per (strategy, size, budget) cell and reports the mean
  estimated accuracy of the answers (the paper's Metric 4: the accuracy estimate of the model
  chosen, no inference) and the overrun rate (fraction of requests with spent > budget).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from service.bundle import (
    CostPolynomial,
    ExtractorSpec,
    ItemSpec,
    Manifest,
    ModelSpec,
    Provenance,
    model_id_for,
)
from service.execution import run_session
from service.strategies.base import CostModel, StrategyRuntime, strategy_for
from service.types import FloatArray, FloatVector, horner
from training.bundles.digits import make_strategies, mask_features, subsets_of
from training.greedy import VARIANTS as GREEDY_VARIANTS
from training.polydom import PolyDom
from training.polydom.synthetic import SIZE_DOMAIN, SyntheticWorkload, make_workload

#: z of the 95th percentile of the standard normal: p95 of LogNormal(0, σ) is exp(Z95 σ).
Z95 = 1.645
#: Strategy names in the order ``training.bundles.digits.make_strategies`` emits them.
STRATEGIES = ("polydom-anytime", "polydom", "greedy", "greedy-acc", "greedy-cost")
#: Strategies that re-plan with the measured remaining budget (all but static Poly-Dom).
ANYTIME = ("polydom-anytime", "greedy", "greedy-acc", "greedy-cost")

_VECTOR: FloatVector = np.zeros(1, dtype=np.float32)


def feature_names(m: int) -> list[str]:
    """Extractor names of an m-feature workload: f00, f01, ... (bit i = names[i])."""
    return [f"f{i:02d}" for i in range(m)]


@dataclass
class SimBundle:
    """A synthetic bundle: manifest, runtimes by strategy name and the true cost curves.

    ``median_costs`` (m x 3 coefficients) are what extractions take on average (times the
    log-normal noise); ``p95_costs`` are what the manifest ships and every strategy plans
    with. ``table`` is the accuracy of every feature set by bitmask (the oracle).
    """

    manifest: Manifest
    runtimes: dict[str, StrategyRuntime]
    median_costs: FloatArray
    p95_costs: FloatArray
    names: list[str]
    table: FloatArray
    polydom: PolyDom
    workload: SyntheticWorkload
    sigma: float
    epsilon: float

    def median_at(self, n: float) -> dict[str, float]:
        """Median extraction cost of every feature at size ``n``."""
        return median_at(self.median_costs, self.names, n)

    def p95_at(self, n: float) -> dict[str, float]:
        """Shipped (p95) cost of every feature at size ``n``: what the strategies plan with."""
        return self.runtimes[STRATEGIES[0]].costs.at(n)

    def optimum(self, n: float, budget: float) -> float:
        """Brute force over all 2^m sets: the best accuracy whose p95 cost at ``n`` fits."""
        per = np.asarray(horner(self.p95_costs, n), dtype=np.float64)
        m = len(self.names)
        totals = np.zeros(1 << m)
        for j in range(m):
            view = totals.reshape(-1, 2, 1 << j)
            view[:, 1, :] = view[:, 0, :] + per[j]
        return float(np.max(self.table[totals <= budget]))


def median_at(median_costs: FloatArray, names: Sequence[str], n: float) -> dict[str, float]:
    values = np.asarray(horner(median_costs, n), dtype=np.float64)
    return dict(zip(names, values.tolist(), strict=True))


def synthetic_bundle(
    m: int, gamma: float, seed: int, sigma: float, epsilon: float = 0.01
) -> SimBundle:
    """Fit every strategy on the p95 curves of ``make_workload(m, gamma, seed)``.

    The workload's costs are taken as median costs; the shipped curves are
    median × exp(1.645 σ). The manifest holds a model for every set any strategy can answer
    with: the Poly-Dom candidates and all their subsets (anytime Poly-Dom and the fallback
    answer with the best set in hand) and every greedy prefix, with the oracle's accuracy.
    """
    if sigma < 0 or not math.isfinite(sigma):
        raise ValueError(f"sigma={sigma!r}; a finite value >= 0 is required")
    work = make_workload(m, gamma, seed)
    names = feature_names(m)
    median = np.asarray(work.costs, dtype=np.float64)
    p95 = median * math.exp(Z95 * sigma)
    polydom = PolyDom(epsilon=epsilon).fit(work.evaluate, p95, SIZE_DOMAIN)
    # Greedy builds its sequences at one size; the paper uses the median item size (the
    # middle of the domain here, the size the benchmark serves).
    reference = (SIZE_DOMAIN[0] + SIZE_DOMAIN[1]) / 2.0
    greedy_fits = {
        variant: factory(reference_size=reference).fit(work.evaluate, p95, SIZE_DOMAIN)
        for variant, factory in GREEDY_VARIANTS.items()
    }
    masks: set[int] = {0}
    for candidate in polydom.candidates_:
        masks.update(subsets_of(candidate))
    for fit in greedy_fits.values():
        for sequence in fit.sequences_:
            masks.update(sequence.prefix_masks)
    models = []
    for mask in sorted(masks, key=lambda k: (k.bit_count(), k)):
        feats = mask_features(names, mask)
        acc = work.evaluate(mask)
        if feats:
            models.append(
                ModelSpec(
                    id=model_id_for(feats),
                    features=feats,
                    accuracy=acc,
                    file=f"{model_id_for(feats).replace('+', '__')}.onnx",
                    input_dims=len(feats),
                )
            )
        else:
            models.append(
                ModelSpec(id="prior", features=[], accuracy=acc, prior=[0.5, 0.5], input_dims=0)
            )
    strategies = make_strategies(names, polydom, greedy_fits)
    manifest = Manifest(
        name=f"synthetic-m{m}-g{gamma:g}-s{seed}",
        version="simulated",
        classes=["0", "1"],
        cost_unit="units",
        item=ItemSpec(kind="image", max_pixels=int(SIZE_DOMAIN[1])),
        extractors=[
            ExtractorSpec(
                name=name,
                version="synthetic",
                dims=1,
                cost=CostPolynomial(
                    coefficients=[float(c) for c in p95[i]], unit="units", quantile=0.95
                ),
            )
            for i, name in enumerate(names)
        ],
        models=models,
        strategies=strategies,
        default_strategy="polydom-anytime",
        provenance=Provenance(
            created_at="simulated",
            data_fingerprint=f"synthetic:m={m},gamma={gamma},seed={seed}",
            parameters={"sigma": sigma, "epsilon": epsilon, "p95_factor": math.exp(Z95 * sigma)},
        ),
    )
    costs = CostModel(manifest)
    runtimes = {
        spec.name: strategy_for(spec.kind)(manifest, spec, {}, costs)
        for spec in manifest.strategies
    }
    return SimBundle(
        manifest=manifest,
        runtimes=runtimes,
        median_costs=median,
        p95_costs=p95,
        names=names,
        table=np.asarray(work.table, dtype=np.float64),
        polydom=polydom,
        workload=work,
        sigma=sigma,
        epsilon=epsilon,
    )


@dataclass(frozen=True)
class SimResult:
    """One simulated request. ``extracted`` maps each extracted feature, in extraction
    order, to the cost it took; ``over_budget`` is spent > budget."""

    answer: str
    accuracy: float
    spent: float
    over_budget: bool
    extracted: dict[str, float] = field(default_factory=dict)
    stopped_early: bool = False


class SimulatedCost:
    """A :class:`~service.execution.CostMeter` for the simulation: acquiring a feature costs
    its median × LogNormal(0, σ) drawn from ``rng`` (exactly the median when σ = 0);
    wall time is not charged."""

    def __init__(self, median: Mapping[str, float], rng: np.random.Generator, sigma: float) -> None:
        self.median = median
        self.rng = rng
        self.sigma = sigma
        self.total = 0.0

    def spent(self) -> float:
        return self.total

    def charge(self, feature: str, seconds: float) -> float:
        cost = self.median[feature]
        if self.sigma > 0:
            cost *= float(self.rng.lognormal(0.0, self.sigma))
        self.total += cost
        return cost


class SimulatedSource:
    """A :class:`~service.execution.FeatureSource` for the simulation: every feature with a
    cost (``names``) is 'acquired' as a placeholder vector; nothing is extracted."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = names

    def acquire(self, feature: str) -> FloatVector:
        return _VECTOR


def simulate(
    runtime: StrategyRuntime,
    median_costs: FloatArray | dict[str, float],
    n: int,
    budget: float,
    rng: np.random.Generator,
    sigma: float,
    reserve: float = 0.0,
) -> SimResult:
    """Drive one request through the service's own loop, ``service.execution.run_session``.

    Planning uses ``budget - reserve``; before every step, once spent > budget the session's
    fallback answers. Each extraction takes median(n) × LogNormal(0, σ) (exactly the median
    when σ = 0). ``median_costs`` is the (m x D) median coefficient matrix in the order of
    the runtime's extractors, or the per-feature medians already evaluated at ``n``. A
    runtime that breaks the session contract (acquires a feature twice, never answers)
    raises :class:`~service.execution.StrategyFault`.
    """
    if isinstance(median_costs, dict):
        median = median_costs
    else:
        median = median_at(median_costs, runtime.costs.names, n)
    meter = SimulatedCost(median, rng, sigma)
    run = run_session(
        runtime, n, budget, {}, SimulatedSource(median.keys()), meter, reserve=reserve
    )
    spent = meter.spent()
    return SimResult(
        answer=run.answer.model,
        accuracy=runtime.accuracy[run.answer.model],
        spent=spent,
        over_budget=spent > budget,
        extracted=run.charged,
        stopped_early=run.stopped_early,
    )


@dataclass(frozen=True)
class Cell:
    """Aggregate of ``requests`` simulated requests of one (strategy, size, budget)."""

    strategy: str
    n: int
    budget: float
    requests: int
    accuracy: float
    overrun_rate: float
    mean_spent: float
    max_overrun: float
    accuracy_se: float = 0.0


def sweep(
    bundle: SimBundle,
    sizes: Iterable[int],
    budgets: Iterable[float],
    requests: int,
    *,
    strategies: Sequence[str] = STRATEGIES,
    seed: int = 0,
    reserve: float = 0.0,
) -> list[Cell]:
    """Every (strategy, size, budget) cell with ``requests`` simulated requests each.

    With σ = 0 a request is deterministic, so a single one is simulated per cell (the
    others would be identical). Each cell draws its noise from its own seeded stream, so a
    cell's numbers do not depend on which other cells are run.
    """
    out: list[Cell] = []
    budget_list = [float(b) for b in budgets]
    count = 1 if bundle.sigma == 0 else requests
    for name in strategies:
        runtime = bundle.runtimes[name]
        for n in sizes:
            median = bundle.median_at(n)
            for budget in budget_list:
                key = int(np.float64(budget).view(np.uint64))
                rng = np.random.default_rng([seed, zlib.crc32(name.encode()), n, key])
                runs = [
                    simulate(runtime, median, n, budget, rng, bundle.sigma, reserve)
                    for _ in range(count)
                ]
                acc = np.array([r.accuracy for r in runs])
                spent = np.array([r.spent for r in runs])
                out.append(
                    Cell(
                        strategy=name,
                        n=n,
                        budget=budget,
                        requests=count,
                        accuracy=float(acc.mean()),
                        overrun_rate=float(np.mean(spent > budget)),
                        mean_spent=float(spent.mean()),
                        max_overrun=float(np.max(spent - budget)),
                        accuracy_se=float(acc.std(ddof=1) / np.sqrt(count)) if count > 1 else 0.0,
                    )
                )
    return out
