"""The "parts x templates" state of paper 004 (Section 2.1), independent of any task.

A state of one example with P parts and K feature templates is a boolean array S of shape
(P, K): ``S[p, k]`` says template k is computed for part p. Its cost is
``c(S) = Σ_p Σ_k S[p, k] · δ_k`` (δ_k: the measured cost of template k for one part).
Templates flagged ``base`` are in every initial state S0 (the paper's "features with
negligible cost"); the policies choose among the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Bool = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class Template:
    """A feature template: its name, the cost of computing it for one part (any unit, the
    same for all templates) and whether every initial state has it."""

    name: str
    cost: float
    base: bool = False


@dataclass(frozen=True)
class TemplateSet:
    templates: tuple[Template, ...]

    @classmethod
    def of(cls, templates: Sequence[Template]) -> TemplateSet:
        if not templates:
            raise ValueError("a template set needs at least one template")
        names = [t.name for t in templates]
        if len(set(names)) != len(names):
            raise ValueError(f"template names repeat: {names}")
        return cls(tuple(templates))

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.templates]

    @property
    def costs(self) -> npt.NDArray[np.float64]:
        return np.asarray([t.cost for t in self.templates], dtype=np.float64)

    @property
    def base_mask(self) -> Bool:
        return np.asarray([t.base for t in self.templates], dtype=bool)

    @property
    def optional(self) -> list[int]:
        """Indices of the templates a policy chooses (the non-base ones)."""
        return [k for k, t in enumerate(self.templates) if not t.base]

    def __len__(self) -> int:
        return len(self.templates)

    def initial(self, parts: int) -> Bool:
        """S0: the base templates for every part."""
        return np.repeat(self.base_mask[None, :], parts, axis=0)

    def full(self, parts: int) -> Bool:
        return np.ones((parts, len(self.templates)), dtype=bool)

    def cost(self, state: Bool) -> float:
        """c(S) = Σ S[p, k] δ_k."""
        return float(state.astype(np.float64).sum(axis=0) @ self.costs)

    def subsets(self) -> list[tuple[int, ...]]:
        """Every subset of the optional templates, as sorted index tuples, the empty one
        first: the labels of a per-part one-shot policy."""
        opt = self.optional
        out: list[tuple[int, ...]] = []
        for mask in range(1 << len(opt)):
            out.append(tuple(k for j, k in enumerate(opt) if mask >> j & 1))
        return out


def additions(state: Bool, optional: Sequence[int]) -> list[tuple[int, int]]:
    """The one-step transitions 𝒮(S) = {S' : d(S', S) = 1, S' ∧ S = S}, restricted to the
    optional templates: the (part, template) pairs not yet in ``state``."""
    return [(p, k) for p in range(state.shape[0]) for k in optional if not state[p, k]]


def with_added(state: Bool, part: int, template: int) -> Bool:
    out = state.copy()
    out[part, template] = True
    return out
