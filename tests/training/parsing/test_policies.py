"""The generic parts × templates pseudo-label searches against exhaustive checks."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from benchmarks.parsing import depths
from training.parsing.policies import (
    Trajectory,
    fit_word_policy,
    greedy_trajectory,
    parsimonious_labels,
    policy_scores,
)


def table_loss(n: int, seed: int) -> dict[tuple[bool, ...], float]:
    """A random integer loss over every state of ``n`` parts (upgrading tends to help)."""
    rng = np.random.default_rng(seed)
    return {
        state: float(rng.integers(0, 4) + 2 * (n - sum(state)))
        for state in itertools.product([False, True], repeat=n)
    }


def lookup(table: dict[tuple[bool, ...], float]) -> Callable[[np.ndarray], float]:
    def loss(state: np.ndarray) -> float:
        return table[tuple(bool(v) for v in state)]

    return loss


def test_greedy_trajectory_takes_the_best_single_upgrade_each_step() -> None:
    for seed in range(40):
        n = 4
        table = table_loss(n, seed)
        trajectory = greedy_trajectory(n, lookup(table))
        state = [False] * n
        assert trajectory.losses[0] == table[tuple(state)]
        for part, loss in zip(trajectory.order, trajectory.losses[1:], strict=True):
            options = {
                p: table[tuple([*state[:p], True, *state[p + 1 :]])]
                for p in range(n)
                if not state[p]
            }
            assert loss == min(options.values()) and options[part] == loss
            assert loss < table[tuple(state)]  # every step lowers the loss
            state[part] = True
        # It stops only at zero loss, all parts upgraded, or when no upgrade helps.
        rest = [p for p in range(n) if not state[p]]
        current = table[tuple(state)]
        assert (
            current == 0
            or not rest
            or all(table[tuple([*state[:p], True, *state[p + 1 :]])] >= current for p in rest)
        )


def test_prefix_minimises_loss_plus_lambda_cost() -> None:
    trajectory = Trajectory(order=[3, 1, 0], losses=[5.0, 2.0, 1.5, 0.0])
    for lam in (0.0, 0.4, 1.0, 2.0, 4.0):
        best = min(range(4), key=lambda t: (trajectory.losses[t] + lam * t, t))
        assert trajectory.prefix(lam) == trajectory.order[:best]


def test_parsimonious_labels_are_the_single_upgrades_that_help() -> None:
    for seed in range(20):
        n = 5
        table = table_loss(n, seed)
        labels = parsimonious_labels(n, lookup(table))
        base = table[(False,) * n]
        expected = [p for p in range(n) if table[tuple(i == p for i in range(n))] < base]
        assert labels == expected


def test_word_policy_learns_a_separable_rule() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 3))
    y = x[:, 0] > 0.3
    coef = fit_word_policy(x, y, positive_weight=1.0)
    assert ((policy_scores(coef, x) > 0) == y).mean() > 0.95
    assert (fit_word_policy(x, np.zeros(400, bool), 1.0)[:-1] == 0).all()


def test_depths_in_a_tree() -> None:
    # 2 is the root's dependent; 1 and 3 hang from 2; 4 from 3.
    assert depths([2, 0, 2, 3]) == [1, 0, 1, 2]
