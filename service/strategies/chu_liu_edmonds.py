"""Chu–Liu–Edmonds maximum spanning arborescence, the decoder of the dependency parser.

``scores[h, d]`` is the score of the edge head h → dependent d over nodes 0 … n, node 0
being the artificial root; the result gives every token its head (``heads[0] = -1``) and
maximises the sum of the chosen edges' scores over all trees rooted at 0 (non-projective
trees included). With ``single_root`` exactly one token hangs from the root, as in
Universal Dependencies: every root edge is lowered by more than any tree's score range, so
a tree with k root edges loses to every tree with fewer, and among the trees with one root
edge the order is unchanged (exact, not a heuristic). That second decode runs only when the
unconstrained best tree has several root children. Checked against enumerating every
tree in ``tests/training/parsing``.

Pruned arcs (the length-dictionary filter) score ``-inf``: they are never chosen as long as
some tree of finite arcs exists, which holds when every token can be reached from the root
through finite arcs (the filter always keeps the root's arcs). When no tree of finite arcs
has a single root child, the single-root decode returns the best tree with the fewest root
children (the penalty on root arcs orders trees by their count first).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatMatrix = npt.NDArray[np.float64]
IntVector = npt.NDArray[np.int64]


def _find_cycle(heads: list[int]) -> list[int] | None:
    state = [0] * len(heads)  # 0: unseen, 1: on the current path, 2: reaches the root
    for start in range(1, len(heads)):
        if state[start]:
            continue
        path: list[int] = []
        v = start
        while v > 0 and state[v] == 0:
            state[v] = 1
            path.append(v)
            v = heads[v]
        if v > 0 and state[v] == 1:
            return path[path.index(v) :]
        for p in path:
            state[p] = 2
    return None


def _mst(scores: FloatMatrix) -> IntVector:
    m = scores.shape[0]
    heads: IntVector = scores.argmax(axis=0).astype(np.int64)
    heads[0] = -1
    cycle = _find_cycle(heads.tolist())
    if cycle is None:
        return heads
    cyc = np.asarray(cycle, dtype=np.int64)
    in_cycle = np.zeros(m, dtype=bool)
    in_cycle[cyc] = True
    rest = np.flatnonzero(~in_cycle)
    k = len(rest)
    contracted = np.full((k + 1, k + 1), -np.inf)
    from_rest = scores[rest]
    contracted[:k, :k] = from_rest[:, rest]
    # Entering the cycle at v from u: replace v's cycle edge by u → v.
    enter = from_rest[:, cyc] - scores[heads[cyc], cyc][None, :]
    best_in = enter.argmax(axis=1)
    contracted[:k, k] = enter[np.arange(k), best_in]
    # Leaving the cycle to w: the best cycle node as its head.
    leave = scores[cyc][:, rest]
    best_out = leave.argmax(axis=0)
    contracted[k, :k] = leave[best_out, np.arange(k)]
    contracted[:, 0] = -np.inf
    contracted[k, k] = -np.inf
    sub = _mst(contracted)
    out: IntVector = heads.copy()
    for idx in range(1, k):  # rest[0] is the root (node 0 is never in a cycle)
        h = int(sub[idx])
        out[rest[idx]] = rest[h] if h < k else cyc[best_out[idx]]
    u = int(sub[k])
    out[cyc[best_in[u]]] = rest[u]
    return out


def chu_liu_edmonds(scores: FloatMatrix, *, single_root: bool = True) -> IntVector:
    """Heads of the maximum spanning tree of ``scores`` (n+1 × n+1, finite off the diagonal
    and the root column; both are ignored)."""
    m = scores.shape[0]
    if scores.shape != (m, m) or m < 2:
        raise ValueError(f"scores must be (n+1) x (n+1) with n >= 1, got {scores.shape}")
    s = np.array(scores, dtype=np.float64)
    np.fill_diagonal(s, -np.inf)
    s[:, 0] = -np.inf
    heads = _mst(s)
    if not single_root or m <= 2 or int((heads[1:] == 0).sum()) == 1:
        return heads  # the best tree has one root child: it is the best such tree too
    finite = s[np.isfinite(s)]  # the diagonal, the root column and pruned arcs are -inf
    low, high = float(finite.min()), float(finite.max())
    s[0, 1:] -= (m - 1) * (high - low) + 1.0
    return _mst(s)


def tree_score(scores: FloatMatrix, heads: IntVector) -> float:
    """The sum of the edge scores of ``heads``."""
    deps = np.arange(1, len(heads))
    return float(scores[heads[1:], deps].sum())
