"""Synthetic Poly-Dom workloads (paper 002, Section 5.1, "Synthetic Prediction").

The paper's constants were lost in the text; ours, chosen so cost curves cross many times
over sizes n in [1, 1000] (each term reaches up to ~1000 time units at n = 1000):

* cost c(n) = a0 + a1·n + a2·n² with a0 ~ U[0, 1000], a1 ~ U[0, 1], a2 ~ U[0, 0.001]
  (a2 is smallest because it multiplies n², as the paper notes);
* single-feature accuracy: "helpful" with probability p (default 0.5) and then
  ~ U[0.7, 0.9], else near chance ~ U[0.5, 0.6];
* combiner over the set's accuracies sorted a_(1) >= a_(2) >= ...:
  a(F) = 1 − (1 − a_(1)) · Π_{j≥2} (1 − γ·a_(j)), a(∅) = 0.5 (chance). Monotone for
  γ ∈ [0, 1] (Axiom 2.1): γ = 0 is the best single feature, γ = 1 lets every feature add.

A second family, :func:`saturating_accuracies`, pushes random additive weights through a
saturating map, and :func:`perturb` adds bounded non-monotone noise (Axiom 3.10 with δ).
All tables are indexed by feature-set bitmask, so ``evaluate = table.__getitem__``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.types import FloatArray

#: Size domain of the synthetic workload.
SIZE_DOMAIN = (1.0, 1000.0)
#: Accuracy of the empty feature set (chance on a balanced binary task).
CHANCE = 0.5


def random_costs(m: int, rng: np.random.Generator, degree: int = 2) -> FloatArray:
    """(m x degree+1) non-negative coefficients; term k scaled by 1000 / 1000**k."""
    scales = 1000.0 / 1000.0 ** np.arange(degree + 1)
    return rng.uniform(0.0, 1.0, size=(m, degree + 1)) * scales


def single_accuracies(m: int, rng: np.random.Generator, p_helpful: float = 0.5) -> FloatArray:
    """Per-feature accuracies: U[0.7, 0.9] with probability p, else U[0.5, 0.6]."""
    helpful = rng.random(m) < p_helpful
    return np.where(helpful, rng.uniform(0.7, 0.9, m), rng.uniform(0.5, 0.6, m))


def _subset_tables(values: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Per mask: max of ``values`` over members (-inf for ∅) and Σ log(1 − values)."""
    m = len(values)
    top = np.full(1 << m, -np.inf)
    logs = np.zeros(1 << m)
    for j in range(m):
        size = 1 << j
        top_v = top.reshape(-1, 2, size)
        top_v[:, 1, :] = np.maximum(top_v[:, 0, :], values[j])
        log_v = logs.reshape(-1, 2, size)
        log_v[:, 1, :] = log_v[:, 0, :] + np.log1p(-values[j])
    return top, logs


def combiner_accuracies(single: FloatArray, gamma: float, chance: float = CHANCE) -> FloatArray:
    """a(F) for every mask under the paper's combiner, vectorised over the 2^m sets.

    1 − a(F) = (1 − a_(1)) Π_{j≥2}(1 − γ a_(j)) = (1 − a_(1)) / (1 − γ a_(1)) · Π_j (1 − γ a_j).
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma={gamma!r}; a value in [0, 1] is required.")
    _, logs = _subset_tables(gamma * np.asarray(single, dtype=np.float64))
    best, _ = _subset_tables(np.asarray(single, dtype=np.float64))
    out = np.full(best.shape, chance)
    nz = np.isfinite(best)
    out[nz] = 1.0 - (1.0 - best[nz]) / (1.0 - gamma * best[nz]) * np.exp(logs[nz])
    return out


def saturating_accuracies(
    m: int, rng: np.random.Generator, chance: float = CHANCE, ceiling: float = 0.95
) -> FloatArray:
    """Second monotone family: a(F) = chance + (ceiling − chance)(1 − exp(−Σ_{j∈F} w_j)).

    Weights are exponential with random scales, a third of them near zero (useless
    features), so the lattice has plateaus and steep steps.
    """
    w = rng.exponential(1.0, m) * np.where(rng.random(m) < 1 / 3, 0.01, 1.0)
    total = np.zeros(1 << m)
    for j in range(m):
        view = total.reshape(-1, 2, 1 << j)
        view[:, 1, :] = view[:, 0, :] + w[j]
    return chance + (ceiling - chance) * (1.0 - np.exp(-total))


def perturb(table: FloatArray, delta: float, rng: np.random.Generator) -> FloatArray:
    """Add U[0, δ] noise: monotonicity may break, but only by δ (Axiom 3.10)."""
    return table + rng.uniform(0.0, delta, table.shape)


@dataclass(frozen=True)
class SyntheticWorkload:
    """One synthetic configuration: per-feature costs and the accuracy of every set."""

    costs: FloatArray
    single: FloatArray
    gamma: float
    table: FloatArray

    @property
    def m(self) -> int:
        return int(self.costs.shape[0])

    def evaluate(self, mask: int) -> float:
        """The black-box accuracy a(F) of bitmask ``mask``."""
        return float(self.table[mask])


def make_workload(
    m: int, gamma: float, seed: int, p_helpful: float = 0.5, degree: int = 2
) -> SyntheticWorkload:
    """The paper's synthetic configuration (m, γ, p) with a seeded generator."""
    rng = np.random.default_rng(seed)
    costs = random_costs(m, rng, degree)
    single = single_accuracies(m, rng, p_helpful)
    return SyntheticWorkload(costs, single, gamma, combiner_accuracies(single, gamma))
