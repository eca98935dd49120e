"""§5, the boosting trick: CSTC on the outputs of boosted regression trees, paying for the raw
features each tree reads (usage matrix F) and for evaluating each tree (e_t)."""

from __future__ import annotations

import numpy as np
import pytest

from training.cstc import CSTCClassifier
from training.cstc.boosted import BoostedTreeFeatures

FEATURE_COSTS = [1.0, 1.0, 5.0, 5.0, 5.0, 5.0]
TREE_COST = 0.1


def _xor(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """XOR of two cheap features' signs (5 % label noise), four expensive noise features: no
    linear node can separate it, two-level trees can."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 6))
    y = ((X[:, 0] > 0) ^ (X[:, 1] > 0)).astype(int)
    return X, np.where(rng.uniform(size=n) < 0.05, 1 - y, y)


def test_usage_matrix_and_cost_groups() -> None:
    X, y = _xor(500, 0)
    bt = BoostedTreeFeatures(n_trees=5, max_depth=2).fit(X, y)
    assert bt.usage_.shape == (6, 5)
    for t, est in enumerate(bt.model_.estimators_):
        split_on = set(est[0].tree_.feature[est[0].tree_.feature >= 0].tolist())
        assert set(np.flatnonzero(bt.usage_[:, t]).tolist()) == split_on
    groups, costs, names = bt.cost_groups(FEATURE_COSTS, TREE_COST)
    assert names[-5:] == [f"tree {t}" for t in range(5)] and costs[-5:] == [TREE_COST] * 5
    for group, cost, name in zip(groups, costs, names, strict=True):
        if name.startswith("feature"):
            a = int(name.split()[1])
            assert group == np.flatnonzero(bt.usage_[a]).tolist() and cost == FEATURE_COSTS[a]
    np.testing.assert_allclose(
        bt.transform(X).sum(axis=1) + bt.model_.init_.constant_[0][0], bt.model_.predict(X)
    )
    with pytest.raises(ValueError, match="3 classes"):
        BoostedTreeFeatures().fit(X, np.arange(len(X)) % 3)


def test_boosted_tree_beats_linear_nodes_and_pays_per_eq_22() -> None:
    X, y = _xor(2000, 0)
    X_test, y_test = _xor(2000, 1)
    linear = CSTCClassifier(costs=FEATURE_COSTS, lam=0.01, depth=3, sharpness=10.0).fit(X, y)
    bt = BoostedTreeFeatures(n_trees=20, max_depth=2).fit(X, y)
    groups, costs, names = bt.cost_groups(FEATURE_COSTS, TREE_COST)
    P, P_test = bt.transform(X), bt.transform(X_test)
    tree = CSTCClassifier(
        costs=costs, groups=groups, lam=0.01, depth=3, sharpness=10.0, standardize=False
    ).fit(P, y)
    acc_linear = float(np.mean(linear.predict(X_test) == y_test))
    acc_tree = float(np.mean(tree.predict(P_test) == y_test))
    assert acc_linear < 0.6 < 0.8 < acc_tree
    for walk in tree.walk(P_test[:300]):
        acquired = {names[g] for a in walk.acquired for g in a}
        trees = {int(n.split()[1]) for n in acquired if n.startswith("tree")}
        raw = {int(n.split()[1]) for n in acquired if n.startswith("feature")}
        # every raw feature a used tree reads is paid for, and nothing else (eq. 22's ℓ0)
        assert raw == {a for t in trees for a in np.flatnonzero(bt.usage_[:, t]).tolist()}
        assert raw <= {0, 1}  # the noise features are never worth their cost
        want = sum(FEATURE_COSTS[a] for a in raw) + TREE_COST * len(trees)
        assert walk.cost == pytest.approx(want)
