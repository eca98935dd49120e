"""Poly-Dom: lattice pruning, candidate sets and the size x budget index (paper 002)."""

from __future__ import annotations

from training.polydom.candidates import prune_candidates
from training.polydom.estimator import PolyDom, PolyDomStats
from training.polydom.index import (
    PolyDomIndex,
    build_index,
    index_all,
    index_all_size,
    intersection_points,
    skyline_at,
)
from training.polydom.lattice import ExpansionResult, expand_all, expand_polydom
from training.polydom.poly import set_costs

__all__ = [
    "ExpansionResult",
    "PolyDom",
    "PolyDomIndex",
    "PolyDomStats",
    "build_index",
    "expand_all",
    "expand_polydom",
    "index_all",
    "index_all_size",
    "intersection_points",
    "prune_candidates",
    "set_costs",
    "skyline_at",
]
