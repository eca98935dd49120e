"""The policy machinery on a synthetic chain task whose answers are known."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import numpy.typing as npt

from training.structured.baselines import myopic_states, uniform_states
from training.structured.chain import ChainParams
from training.structured.policies import (
    AnytimePolicy,
    Standardiser,
    fit_anytime,
    fit_one_shot,
    greedy_trajectories,
)
from training.structured.problem import ChainProblem
from training.structured.state import Template, TemplateSet, additions
from training.structured.stops import STOP_GRID, STOP_TOLERANCE, STOP_TOLERANCES, stop_table

Y = 3


def choose_stop(
    policy: Any, problem: Any, *, grid: Any = STOP_GRID, tolerance: float = STOP_TOLERANCE
) -> float | None:
    """:func:`stop_table`'s threshold for one ``tolerance`` (the bundle's default one)."""
    return stop_table(policy, problem, grid=grid, tolerances=(tolerance,))[0][1]


def synthetic(n: int, seed: int = 0) -> ChainProblem:
    """Parts whose cheap template is right unless the part is 'hard' (input feature 0 is
    1); the expensive template is always right. No transitions: parts are independent."""
    rng = np.random.default_rng(seed)
    templates = TemplateSet.of([Template("cheap", 1.0, base=True), Template("rich", 10.0)])
    contributions, labels, inputs = [], [], []
    for _ in range(n):
        length = int(rng.integers(2, 6))
        y = rng.integers(0, Y, size=length)
        hard = rng.random(length) < 0.3
        c = np.zeros((length, 2, Y))
        wrong = (y + 1) % Y
        c[np.arange(length), 0, np.where(hard, wrong, y)] = 2.0
        c[np.arange(length), 1, y] = 5.0
        contributions.append(c)
        labels.append(y.astype(np.int64))
        x = np.stack([hard.astype(np.float32), rng.normal(size=length).astype(np.float32)], axis=1)
        inputs.append(x)
    chain = ChainParams(np.zeros((Y, Y)), np.zeros(Y), np.zeros(Y))
    return ChainProblem(templates, chain, np.zeros(Y), contributions, labels, inputs)


def _hard(problem: ChainProblem, i: int) -> npt.NDArray[np.bool_]:
    return problem.policy_inputs(i)[:, 0] > 0.5


def test_greedy_trajectory_adds_one_pair_per_step_and_finds_the_optimum() -> None:
    problem = synthetic(40)
    ts = problem.templates
    trajectories = greedy_trajectories(problem)
    for i, t in enumerate(trajectories):
        parts = problem.parts(i)
        assert len(t.states) == parts + 1
        for a, b in zip(t.states, t.states[1:], strict=False):
            assert (b & a == a).all() and (b ^ a).sum() == 1
        assert t.states[-1].all()
        # oracle: the best of all 2^parts states under C = Hamming + λ c
        lam = 0.01
        best = min(
            problem.losses([i], [_state(ts, parts, bits)], soft=False)[0]
            + lam * ts.cost(_state(ts, parts, bits))
            for bits in itertools.product([False, True], repeat=parts)
        )
        star = t.states[t.best(lam)]
        got = problem.losses([i], [star], soft=False)[0] + lam * ts.cost(star)
        assert got == best
        # the optimum adds the rich template exactly on the hard parts
        assert star[:, 1].tolist() == _hard(problem, i).tolist()


def _state(ts: TemplateSet, parts: int, bits: tuple[bool, ...]) -> npt.NDArray[np.bool_]:
    s = ts.initial(parts)
    s[:, 1] = bits
    return s


def test_one_shot_policy_learns_to_spend_on_hard_parts_only() -> None:
    train, test = synthetic(150, seed=1), synthetic(60, seed=2)
    standardiser = Standardiser.fit(np.concatenate(train.inputs))
    policy = fit_one_shot(train, greedy_trajectories(train), 0.01, standardiser)
    for i in range(test.n_examples):
        state = policy.state(test.policy_inputs(i), test.templates)
        assert state[:, 1].tolist() == _hard(test, i).tolist()
        assert state[:, 0].all()
    # a λ so large that nothing is worth it: no rich template anywhere
    stingy = fit_one_shot(train, greedy_trajectories(train), 1.0, standardiser)
    assert not any(
        stingy.state(test.policy_inputs(i), test.templates)[:, 1].any() for i in range(10)
    )


def test_anytime_policy_acquires_hard_parts_first() -> None:
    train, test = synthetic(150, seed=3), synthetic(60, seed=4)
    standardiser = Standardiser.fit(np.concatenate(train.inputs))
    policy = fit_anytime(train, standardiser)
    assert policy.train_loss[-1] == 0.0
    ts = test.templates
    for i in range(test.n_examples):
        order = policy.order(test.policy_inputs(i), ts.initial(test.parts(i)))
        hard = set(np.flatnonzero(_hard(test, i)).tolist())
        first = {p for p, _ in order[: len(hard)]}
        assert first == hard
        assert len(order) == test.parts(i)
        # Alg. 2: with budget for the cheap templates and one rich one, exactly one is added
        start = ts.initial(test.parts(i))
        state = policy.run(test.policy_inputs(i), start, ts, ts.cost(start) + 5.0)
        assert state[:, 1].sum() == 1


def test_the_anytime_stop_keeps_the_known_optimum_and_spends_less() -> None:
    """On the synthetic task the optimum is known: the rich template on the hard parts
    only. Without a stop, Alg. 2 with every budget buys it on every part; with the stop
    chosen on the training examples it buys exactly the hard parts of held-out examples
    (no error); on the training examples the threshold chosen is the highest of the grid that
    keeps training accuracy, the next one up costs more than the tolerance."""
    train, test = synthetic(150, seed=3), synthetic(60, seed=4)
    standardiser = Standardiser.fit(np.concatenate(train.inputs))
    policy = fit_anytime(train, standardiser)
    assert choose_stop(policy, train) in STOP_GRID
    # a grid reaching thresholds that stop before hard parts: the highest kept is chosen
    grid = tuple(float(g) for g in np.arange(-4.0, 30.01, 0.5))
    stop = choose_stop(policy, train, grid=grid)
    assert stop is not None and stop < max(grid)
    stopped = AnytimePolicy(policy.lam, policy.optional, policy.scorer, policy.steps, [], stop)
    ts = test.templates
    for i in range(test.n_examples):
        start = ts.initial(test.parts(i))
        everything = policy.run(test.policy_inputs(i), start, ts, np.inf)
        assert everything[:, 1].all()
        state = stopped.run(test.policy_inputs(i), start, ts, np.inf)
        assert (state[:, 1] == _hard(test, i)).all()
        order = stopped.order(test.policy_inputs(i), start)
        assert order == policy.order(test.policy_inputs(i), start)[: len(order)]
    idx = list(range(train.n_examples))
    starts = [train.templates.initial(train.parts(i)) for i in idx]

    def errors(rule: AnytimePolicy) -> float:
        states = [
            rule.run(train.policy_inputs(i), s, train.templates, np.inf)
            for i, s in zip(idx, starts, strict=True)
        ]
        return float(train.losses(idx, states, soft=False).sum())

    letters = sum(train.parts(i) for i in idx)
    assert errors(policy) == 0.0 and errors(stopped) / letters <= STOP_TOLERANCE
    # the next threshold up stops before hard parts: more than the tolerance is lost
    up = AnytimePolicy(policy.lam, policy.optional, policy.scorer, policy.steps, [], stop + 0.5)
    assert errors(up) / letters > STOP_TOLERANCE
    # no threshold can keep the accuracy when none may be lost and every one stops too soon
    assert choose_stop(policy, train, grid=(100.0,), tolerance=0.0) is None


def test_the_stop_table_gives_each_tolerance_its_highest_threshold() -> None:
    """One threshold per tolerance, each the highest of the grid that keeps the training
    accuracy within it (checked against every grid value by brute force): a larger
    tolerance never gets a lower threshold, tolerance 0 loses nothing on the training
    examples, and the bundle's default stop is the table's entry for its tolerance."""
    train = synthetic(150, seed=3)
    policy = fit_anytime(train, Standardiser.fit(np.concatenate(train.inputs)))
    grid = tuple(float(g) for g in np.arange(-4.0, 30.01, 0.5))
    table = stop_table(policy, train, grid=grid)
    assert [t for t, _ in table] == sorted(STOP_TOLERANCES)
    idx = list(range(train.n_examples))
    letters = sum(train.parts(i) for i in idx)

    def accuracy(stop: float | None) -> float:
        rule = AnytimePolicy(policy.lam, policy.optional, policy.scorer, policy.steps, [], stop)
        states = [
            rule.run(
                train.policy_inputs(i),
                train.templates.initial(train.parts(i)),
                train.templates,
                np.inf,
            )
            for i in idx
        ]
        return 1.0 - float(train.losses(idx, states, soft=False).sum()) / letters

    top = accuracy(None)
    by_grid = {g: accuracy(g) for g in grid}
    for tolerance, stop in table:
        kept = [g for g in grid if by_grid[g] >= top - tolerance]
        assert stop == (max(kept) if kept else None)
    thresholds = [-np.inf if stop is None else stop for _, stop in table]
    assert thresholds == sorted(thresholds)
    assert table[0][0] == 0.0 and table[0][1] is not None and by_grid[table[0][1]] == top
    assert choose_stop(policy, train, grid=grid) == dict(table)[STOP_TOLERANCE]


def test_baselines() -> None:
    problem = synthetic(50, seed=5)
    rng = np.random.default_rng(0)
    none = uniform_states(problem, 0.0, rng)
    full = uniform_states(problem, 1.0, rng)
    assert not any(s[:, 1].any() for s in none) and all(s.all() for s in full)
    states, conf = myopic_states(problem, threshold=2.0)  # every confidence is below 2
    assert all(s.all() for s in states) and (conf <= 1.0 + 1e-9).all()
    states, _ = myopic_states(problem, threshold=0.0)
    assert not any(s[:, 1].any() for s in states)
    assert additions(problem.templates.full(3), problem.templates.optional) == []
