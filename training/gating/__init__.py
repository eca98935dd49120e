"""Gating under a feature budget (Nan & Saligrama, NIPS 2017; paper 001): a low-cost model f1
and a gate g that sends some examples to the high-cost model f0.

:mod:`~training.gating.base` holds what every gated system shares (f0, routing, cost
accounting), :mod:`~training.gating.f0` the tuned f0, :mod:`~training.gating.solvers`
ADAPT-LIN's q-step and FISTA,
:mod:`~training.gating.linear` ADAPT-LIN and the L1 baseline, :mod:`~training.gating.gbrt`
ADAPT-GBRT and GreedyMiser, :mod:`~training.gating.sweep` the (P_full, λ/γ/C) sweep and its
Pareto set. Their ONNX graphs are in :mod:`training.export.gating`.
"""

from training.gating.base import FittedF0, default_f0
from training.gating.f0 import F0Choice, tune_gbrt_f0
from training.gating.gbrt import AdaptGbrt, default_gbrt_f0, greedy_miser
from training.gating.linear import AdaptLin, L1Baseline
from training.gating.solvers import q_step

__all__ = [
    "AdaptGbrt",
    "AdaptLin",
    "F0Choice",
    "FittedF0",
    "L1Baseline",
    "default_f0",
    "default_gbrt_f0",
    "greedy_miser",
    "q_step",
    "tune_gbrt_f0",
]
