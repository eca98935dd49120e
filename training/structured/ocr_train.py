"""Train everything the OCR bundle serves: the chain, one-shot policies (one per λ) and the
anytime policy, on the training folds; cross-fitted as in the paper's Appendix B."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from training.structured.ocr import (
    ChainModel,
    OcrData,
    cross_fit,
    fit_chain,
    ocr_templates,
    template_features,
)
from training.structured.policies import (
    AnytimePolicy,
    OneShotPolicy,
    Standardiser,
    fit_anytime,
    fit_one_shot,
    greedy_trajectories,
)
from training.structured.problem import ChainProblem
from training.structured.state import TemplateSet
from training.structured.stops import STOP_TOLERANCE, stop_table

F32 = npt.NDArray[np.float32]

# λ in letters of Hamming error per unit of cost (the costs are µs per letter): a letter's
# HOG (~100-150 µs) is worth it when it fixes about λ·δ_hog letters.
DEFAULT_LAMBDAS = (0.0, 0.0005, 0.001, 0.002)
# Class weights of the parts whose pseudo-label adds a template (Appendix B of the paper).
DEFAULT_POSITIVE_WEIGHTS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


@dataclass
class OcrTraining:
    templates: TemplateSet
    features: list[F32]
    chain: ChainModel
    standardiser: Standardiser
    one_shot: list[OneShotPolicy]
    anytime: AnytimePolicy
    train_words: list[int]
    test_words: list[int]
    policy_words: list[int]
    seconds: dict[str, float] = field(default_factory=dict)
    policy_problem: ChainProblem | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "train_words": len(self.train_words),
            "policy_words": len(self.policy_words),
            "test_words": len(self.test_words),
            "alpha": self.chain.alpha,
            "seconds": {k: round(v, 1) for k, v in self.seconds.items()},
        }


def split_words(data: OcrData, test_fold: int = 0) -> tuple[list[int], list[int]]:
    """The paper's 90/10 split: one fold (of ten, per word) held out for test."""
    words = np.arange(data.n_words)
    return [int(w) for w in words[data.folds != test_fold]], [
        int(w) for w in words[data.folds == test_fold]
    ]


def train_ocr(
    data: OcrData,
    costs_us: dict[str, float],
    *,
    chain_words: int | None = None,
    policy_words: int = 1500,
    lambdas: tuple[float, ...] = DEFAULT_LAMBDAS,
    positive_weights: tuple[float, ...] = DEFAULT_POSITIVE_WEIGHTS,
    folds: int = 3,
    max_iter: int = 150,
    anytime_lambda: float = 0.0,
    seed: int = 0,
    features: list[F32] | None = None,
    log: Any = None,
) -> OcrTraining:
    """``chain_words``: training words the deployed chain is fitted on (None: all of the
    training folds); ``policy_words``: training words the policies are learned on, each
    scored by a chain cross-fitted without it."""
    rng = np.random.default_rng(seed)
    say = log or (lambda _msg: None)
    seconds: dict[str, float] = {}
    templates = ocr_templates(costs_us["pixels"], costs_us["hog"])
    t0 = time.perf_counter()
    feats = features if features is not None else template_features(data)
    seconds["features"] = time.perf_counter() - t0
    train, test = split_words(data)
    chain_set = (
        train
        if chain_words is None or chain_words >= len(train)
        else sorted(int(w) for w in rng.choice(train, chain_words, replace=False))
    )
    policy_set = sorted(
        int(w) for w in rng.choice(train, min(policy_words, len(train)), replace=False)
    )
    t0 = time.perf_counter()
    say(f"fitting the chain on {len(chain_set)} words")
    chain = fit_chain(data, feats, chain_set, rng, replicas=2, max_iter=max_iter)
    seconds["chain"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    say(f"cross-fitting {folds} chains for {len(policy_set)} policy words")
    problem = cross_fit(data, feats, policy_set, templates, rng, folds=folds, max_iter=max_iter)
    seconds["cross_fit"] = time.perf_counter() - t0
    standardiser = Standardiser.fit(np.concatenate(problem.inputs))
    t0 = time.perf_counter()
    say("greedy trajectories (pseudo-labels)")
    trajectories = greedy_trajectories(problem)
    seconds["trajectories"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    one_shot = [
        fit_one_shot(problem, trajectories, lam, standardiser, positive_weight=pw)
        for lam in lambdas
        for pw in positive_weights
    ]
    seconds["one_shot"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    say("anytime policies (Alg. 1)")
    anytime = fit_anytime(problem, standardiser, lam=anytime_lambda)
    anytime.stop_table = stop_table(anytime, problem)
    anytime.stop_below = dict(anytime.stop_table)[STOP_TOLERANCE]
    seconds["anytime"] = time.perf_counter() - t0
    order = getattr(problem, "words", policy_set)
    return OcrTraining(
        templates=templates,
        features=feats,
        chain=chain,
        standardiser=standardiser,
        one_shot=one_shot,
        anytime=anytime,
        train_words=chain_set,
        test_words=test,
        policy_words=list(order),
        seconds=seconds,
        policy_problem=problem,
    )
