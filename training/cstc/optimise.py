"""The optimisation of a cost-sensitive tree or cascade of linear nodes (paper 003, §3–5).

A structure is a list of nodes; node k has an ``upper`` and a ``lower`` child (a node index,
or None for a terminal element: an exit that returns node k's prediction). A node with no
child at all does not route (a CSTC leaf, the last stage of a cascade). Every node holds
prediction weights ``B`` (d x C, on standardised inputs), an unpenalised intercept ``b`` (C),
a fixed routing direction ``u`` (C) and a threshold ``theta``: the soft probability of going
to the upper child is σ(τ·(h·u − θ)) with h = xB + b (eq. 4; τ = ``sharpness``, 1 in the
paper), at test time the hard rule h·u > θ.

The objective (eq. 12 for trees, 19 for cascades, the Cronus variant of §4.1, and eq. 22
when the columns are boosted trees) is

    (1/n) Σ_i Σ_k w_yi p_ik ℓ_ik  +  ρ Σ_k Σ_t ‖B^k_t‖
        +  λ Σ_l P_l Σ_g c_g √(Σ_{j∈π_l} Σ_{t∈g} ‖B^j_t‖²)

with ℓ the squared loss ‖h − y‖², p_ik the probability of reaching node k (trees) or of
exiting there (cascades), P_l the average probability of leaving through terminal l, π_l
its path, and cost groups g (a raw feature, a sensor of several columns, or a boosted tree
with its evaluation cost and the raw features it reads through the usage matrix F). Every
√· (and ‖·‖) is handled by Lemma 1: √g = min_z ½(g/z + z), z = √g at the current weights,
so with z fixed the objective is smooth; weights whose group norm falls below ``CLAMP``
are set to zero and stay there (the paper's clamp). Leaves (nodes that do not route) are
solved in closed form (eq. 16); routing nodes with L-BFGS on the smooth objective.

The module stays whole (over 450 lines): the forward pass, the relaxed cost, its Lemma-1
auxiliaries and the node solvers are one objective and its gradient, read together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from scipy.optimize import minimize

Array = npt.NDArray[np.float64]
CLAMP = 1e-3


@dataclass
class Node:
    upper: int | None
    lower: int | None
    B: Array
    b: Array
    u: Array
    theta: float = 0.0

    @property
    def routes(self) -> bool:
        return self.upper is not None or self.lower is not None


@dataclass
class Problem:
    """What one fit optimises: standardised X (n x d), targets Y (n x C), per-row class
    weights, the cost groups (column index arrays) with their costs, and the trade-offs."""

    X: Array
    Y: Array
    weights: Array
    groups: list[npt.NDArray[np.intp]]
    group_costs: Array
    lam: float
    rho: float
    sharpness: float
    mode: Literal["tree", "cascade"]
    cost_model: Literal["paths", "cronus"]
    # column -> groups containing it, as a (d x G) 0/1 matrix
    membership: Array = field(init=False)

    def __post_init__(self) -> None:
        d = self.X.shape[1]
        self.membership = np.zeros((d, len(self.groups)))
        for g, cols in enumerate(self.groups):
            self.membership[cols, g] = 1.0


def sigmoid(s: Array) -> Array:
    out: Array = 0.5 * (1.0 + np.tanh(0.5 * s))
    return out


def parents(nodes: list[Node]) -> dict[int, tuple[int, str]]:
    out: dict[int, tuple[int, str]] = {}
    for k, node in enumerate(nodes):
        if node.upper is not None:
            out[node.upper] = (k, "upper")
        if node.lower is not None:
            out[node.lower] = (k, "lower")
    return out


def level_order(nodes: list[Node]) -> list[int]:
    order, queue = [], [0]
    while queue:
        k = queue.pop(0)
        order.append(k)
        node = nodes[k]
        queue.extend(c for c in (node.upper, node.lower) if c is not None)
    return order


def terminals(nodes: list[Node]) -> list[tuple[int, str]]:
    """Exits (node, side): side 'upper'/'lower' for a routing node's missing child, 'leaf'
    for a node that does not route."""
    out: list[tuple[int, str]] = []
    for k in level_order(nodes):
        node = nodes[k]
        if not node.routes:
            out.append((k, "leaf"))
            continue
        if node.upper is None:
            out.append((k, "upper"))
        if node.lower is None:
            out.append((k, "lower"))
    return out


def path_to(nodes: list[Node], k: int) -> list[int]:
    up = parents(nodes)
    path = [k]
    while path[-1] in up:
        path.append(up[path[-1]][0])
    return path[::-1]


@dataclass
class Forward:
    h: list[Array]  # per node: n x C predictions
    sig: list[Array]  # per node: n, P(upper) (ones for non-routing nodes)
    reach: list[Array]  # per node: n, P(reach node)
    loss: list[Array]  # per node: n, squared loss


def forward(problem: Problem, nodes: list[Node]) -> Forward:
    X, Y = problem.X, problem.Y
    n = X.shape[0]
    h = [X @ nd.B + nd.b for nd in nodes]
    sig = [
        sigmoid(problem.sharpness * (hk @ nd.u - nd.theta)) if nd.routes else np.ones(n)
        for hk, nd in zip(h, nodes, strict=True)
    ]
    reach = [np.zeros(n) for _ in nodes]
    reach[0] = np.ones(n)
    for k in level_order(nodes):
        nd = nodes[k]
        if nd.upper is not None:
            reach[nd.upper] = reach[k] * sig[k]
        if nd.lower is not None:
            reach[nd.lower] = reach[k] * (1.0 - sig[k])
    loss = [np.sum((hk - Y) ** 2, axis=1) for hk in h]
    return Forward(h, sig, reach, loss)


def exit_prob(fw: Forward, k: int, side: str) -> Array:
    if side == "leaf":
        return fw.reach[k]
    if side == "upper":
        return fw.reach[k] * fw.sig[k]
    return fw.reach[k] * (1.0 - fw.sig[k])


def loss_weight(problem: Problem, nodes: list[Node], fw: Forward, k: int) -> Array:
    """The weight of node k's loss per row: reach (CSTC) or exit (CSCC, Cronus) probability,
    times the class weight."""
    nd = nodes[k]
    if problem.mode == "tree" or not nd.routes:
        base = fw.reach[k]
    else:
        base = sum(
            (exit_prob(fw, k, s) for s in ("upper", "lower") if getattr(nd, s) is None),
            np.zeros_like(fw.reach[k]),
        )
    out: Array = base * problem.weights
    return out


def column_norms(nd: Node) -> Array:
    out: Array = np.sum(nd.B**2, axis=1)
    return out


def path_group_norms(problem: Problem, nodes: list[Node], path: list[int]) -> Array:
    """Σ_{j∈path} Σ_{t∈g} ‖B^j_t‖² per group."""
    total = sum((column_norms(nodes[j]) for j in path), np.zeros(problem.X.shape[1]))
    out: Array = total @ problem.membership
    return out


def objective(problem: Problem, nodes: list[Node], fw: Forward | None = None) -> float:
    """The relaxed objective (with the true square roots, not the Lemma-1 bound)."""
    fw = forward(problem, nodes) if fw is None else fw
    n = problem.X.shape[0]
    total = 0.0
    for k in range(len(nodes)):
        total += float(np.sum(loss_weight(problem, nodes, fw, k) * fw.loss[k])) / n
        total += problem.rho * float(np.sum(np.sqrt(column_norms(nodes[k]))))
    total += problem.lam * cost_penalty(problem, nodes, fw)
    return total


def cost_penalty(problem: Problem, nodes: list[Node], fw: Forward) -> float:
    if problem.cost_model == "cronus":
        sq = sum(
            (float(np.mean(fw.reach[k])) ** 2 * column_norms(nodes[k]) for k in range(len(nodes))),
            np.zeros(problem.X.shape[1]),
        )
        return float(problem.group_costs @ np.sqrt(sq @ problem.membership))
    total = 0.0
    for k, side in terminals(nodes):
        pl = float(np.mean(exit_prob(fw, k, side)))
        norms = path_group_norms(problem, nodes, path_to(nodes, k))
        total += pl * float(problem.group_costs @ np.sqrt(norms))
    return total


# --------------------------------------------------------------------------------------------
# One node's block
# --------------------------------------------------------------------------------------------


@dataclass
class Side:
    """What lies beyond one side of node k, given the other nodes: per row, the expected
    downstream loss V (conditional on taking the side), the cost constant T0 and the per-
    column coefficients Q of ‖B^k_t‖² in the Lemma-1 bound of the expected path cost; and
    whether node k's own loss is counted on this side (a cascade's exit)."""

    V: Array
    T0: Array
    Q: Array
    own_loss: bool


def _eta(norms: Array) -> Array:
    out: Array = np.maximum(np.sqrt(norms), CLAMP)
    return out


def _subtree(
    problem: Problem, nodes: list[Node], fw: Forward, c: int, k: int
) -> tuple[Array, Array, Array]:
    """(V, T0, Q) of the subtree rooted at node c, conditional on reaching c."""
    n, d = problem.X.shape
    G = problem.group_costs
    V = np.zeros(n)
    T0 = np.zeros(n)
    Q = np.zeros((n, d))
    # Walk the subtree with conditional reach probabilities.
    stack: list[tuple[int, Array]] = [(c, np.ones(n))]
    while stack:
        j, r = stack.pop()
        nd = nodes[j]
        if problem.mode == "tree" or not nd.routes:
            V += r * problem.weights * fw.loss[j]
        exits: list[tuple[str, Array]] = []
        if not nd.routes:
            exits.append(("leaf", r))
        else:
            if nd.upper is None:
                exits.append(("upper", r * fw.sig[j]))
            else:
                stack.append((nd.upper, r * fw.sig[j]))
            if nd.lower is None:
                exits.append(("lower", r * (1.0 - fw.sig[j])))
            else:
                stack.append((nd.lower, r * (1.0 - fw.sig[j])))
        if not exits:
            continue
        path = path_to(nodes, j)
        others = [p for p in path if p != k]
        rest = path_group_norms(problem, nodes, others)
        eta = _eta(rest + column_norms(nodes[k]) @ problem.membership)
        const = float(np.sum(G * 0.5 * (rest / eta + eta)))
        coef = problem.membership @ (G / (2.0 * eta))  # per column
        for side, prob in exits:
            if problem.mode == "cascade" and nd.routes:
                V += prob * problem.weights * fw.loss[j]
            _ = side
            T0 += prob * const
            Q += np.outer(prob, coef)
    return V, T0, Q


def _side(problem: Problem, nodes: list[Node], fw: Forward, k: int, side: str) -> Side:
    nd = nodes[k]
    child = getattr(nd, side)
    n = problem.X.shape[0]
    if child is not None:
        V, T0, Q = _subtree(problem, nodes, fw, child, k)
        return Side(V, T0, Q, own_loss=False)
    # A terminal: node k's own exit.
    G = problem.group_costs
    path = path_to(nodes, k)
    rest = path_group_norms(problem, nodes, [p for p in path if p != k])
    eta = _eta(rest + column_norms(nd) @ problem.membership)
    const = float(np.sum(G * 0.5 * (rest / eta + eta)))
    coef = problem.membership @ (G / (2.0 * eta))
    return Side(
        np.zeros(n), np.full(n, const), np.tile(coef, (n, 1)), own_loss=problem.mode == "cascade"
    )


def _cronus_terms(
    problem: Problem, nodes: list[Node], fw: Forward, k: int
) -> tuple[Array, list[tuple[float, Array]]]:
    """Cronus: λ Σ_g c_g √(Σ_j P_j² ‖B^j_g‖²), bounded with z = current value. Returns the
    per-column coefficient of ‖B^k_t‖² (times P_k², constant for node k) and, for each
    descendant j, (D_j, R_j): D_j Σ_t-coefficient times ‖B^j‖², R_j the conditional reach
    from node k's upper side (cascades route on through ``upper``)."""
    d = problem.X.shape[1]
    sq = sum(
        (float(np.mean(fw.reach[j])) ** 2 * column_norms(nodes[j]) for j in range(len(nodes))),
        np.zeros(d),
    )
    eta = _eta(sq @ problem.membership)
    coef = problem.membership @ (problem.group_costs / (2.0 * eta))
    desc: list[tuple[float, Array]] = []
    nd = nodes[k]
    if nd.upper is not None:
        r = np.ones(problem.X.shape[0])
        j: int | None = nd.upper
        while j is not None:
            desc.append((float(coef @ column_norms(nodes[j])), r.copy()))
            r = r * fw.sig[j] if nodes[j].routes else r
            j = nodes[j].upper
    return coef, desc


def optimise_node(
    problem: Problem, nodes: list[Node], k: int, *, inner: int = 8, maxiter: int = 100
) -> None:
    """Block k of the coordinate descent: Lemma-1 auxiliaries, then the smooth minimisation
    (closed form for a leaf), repeated ``inner`` times."""
    if not nodes[k].routes:
        inner *= 4  # closed form: cheap, and the Lemma-1 iterations converge linearly
    gram: dict[str, npt.NDArray[Any]] = {}
    for _ in range(inner):
        fw = forward(problem, nodes)
        nd = nodes[k]
        gamma = np.maximum(np.sqrt(column_norms(nd)), CLAMP)
        active = np.sqrt(column_norms(nd)) > CLAMP
        if not active.any() and nd.B.any():
            nd.B[:] = 0.0
        if not nd.routes:
            _leaf_closed_form(problem, nodes, fw, k, gamma, active, gram=gram)
        else:
            _routing_lbfgs(problem, nodes, fw, k, gamma, active, maxiter)
        _clamp(nd)


def _clamp(nd: Node) -> None:
    small = np.sqrt(column_norms(nd)) < CLAMP
    nd.B[small] = 0.0


def _leaf_closed_form(
    problem: Problem,
    nodes: list[Node],
    fw: Forward,
    k: int,
    gamma: Array,
    active: npt.NDArray[np.bool_],
    *,
    with_cost: bool = True,
    gram: dict[str, npt.NDArray[Any]] | None = None,
) -> None:
    """Node k as a leaf, in closed form (eq. 16). ``gram`` keeps the weighted Gram matrix
    between the Lemma-1 iterations of one block: a leaf's row weights depend on its
    ancestors only, and its active columns only shrink, so later iterations take a
    sub-block instead of recomputing X'ΩX (the bulk of the cost on wide data)."""
    nd = nodes[k]
    n = problem.X.shape[0]
    omega = loss_weight(problem, nodes, fw, k) / n
    reg = problem.rho / (2.0 * gamma)
    if with_cost:
        if problem.cost_model == "cronus":
            coef, _ = _cronus_terms(problem, nodes, fw, k)
            reg = reg + problem.lam * float(np.mean(fw.reach[k])) ** 2 * coef
        else:
            side = _side(problem, nodes, fw, k, "lower")  # a leaf's terminal
            pl = float(np.mean(fw.reach[k]))
            reg = reg + problem.lam * pl * side.Q[0]
    cols = np.flatnonzero(active)
    nd.B[:] = 0.0
    cached = gram is not None and "A" in gram and np.array_equal(gram["omega"], omega)
    if cached and gram is not None and np.isin(cols, gram["cols"]).all():
        pick = np.append(np.searchsorted(gram["cols"], cols), len(gram["cols"]))
        A = gram["A"][np.ix_(pick, pick)]
        rhs = gram["rhs"][pick]
    else:
        Xa = np.hstack([problem.X[:, cols], np.ones((n, 1))])
        A = Xa.T @ (Xa * omega[:, None])
        rhs = Xa.T @ (problem.Y * omega[:, None])
        if gram is not None:
            gram.update(A=A.copy(), rhs=rhs, cols=cols, omega=omega)
    A[np.arange(len(cols)), np.arange(len(cols))] += reg[cols]
    A[np.diag_indices_from(A)] += 1e-10 * (1.0 + np.trace(A) / len(A))
    sol = np.linalg.solve(A, rhs)
    nd.B[cols] = sol[:-1]
    nd.b[:] = sol[-1]


def _routing_lbfgs(
    problem: Problem,
    nodes: list[Node],
    fw: Forward,
    k: int,
    gamma: Array,
    active: npt.NDArray[np.bool_],
    maxiter: int,
) -> None:
    nd = nodes[k]
    X, Y, w = problem.X, problem.Y, problem.weights
    n = X.shape[0]
    C = Y.shape[1]
    cols = np.flatnonzero(active)
    Xa = X[:, cols]
    p = fw.reach[k]
    up = _side(problem, nodes, fw, k, "upper")
    lo = _side(problem, nodes, fw, k, "lower")
    lam, tau = problem.lam, problem.sharpness
    reg = problem.rho / (2.0 * gamma[cols])
    cron_coef: Array | None = None
    cron_desc: list[tuple[float, Array]] = []
    if problem.cost_model == "cronus":
        coef, cron_desc = _cronus_terms(problem, nodes, fw, k)
        cron_coef = coef[cols] * float(np.mean(p)) ** 2
        # Cronus replaces the per-path cost: drop the path terms.
        up = Side(up.V, np.zeros(n), np.zeros_like(up.Q), up.own_loss)
        lo = Side(lo.V, np.zeros(n), np.zeros_like(lo.Q), lo.own_loss)
    own = 1.0 if problem.mode == "tree" else 0.0
    Qu, Ql = up.Q[:, cols], lo.Q[:, cols]
    m = len(cols)

    def unpack(z: Array) -> tuple[Array, Array, float]:
        return z[: m * C].reshape(m, C), z[m * C : m * C + C], float(z[-1])

    def fun(z: Array) -> tuple[float, Array]:
        B, b, theta = unpack(z)
        h = Xa @ B + b
        r = h - Y
        ell = np.sum(r**2, axis=1)
        s = tau * (h @ nd.u - theta)
        sg = sigmoid(s)
        nb = np.sum(B**2, axis=1)
        Eu = up.V + (w * ell if up.own_loss else 0.0) + lam * (up.T0 + Qu @ nb)
        El = lo.V + (w * ell if lo.own_loss else 0.0) + lam * (lo.T0 + Ql @ nb)
        val = np.sum(p * (own * w * ell + sg * Eu + (1.0 - sg) * El)) / n
        val += float(np.sum(reg * nb))
        own_w = own * w + (sg * w if up.own_loss else 0.0)
        own_w = own_w + ((1.0 - sg) * w if lo.own_loss else 0.0)
        ds = sg * (1.0 - sg) * tau * (Eu - El)
        cost_col = lam * ((p * sg) @ Qu + (p * (1.0 - sg)) @ Ql) / n
        if cron_coef is not None:
            val += lam * float(np.sum(cron_coef * nb))
            cost_col = cost_col + lam * cron_coef
            for D, R in cron_desc:
                P = float(np.mean(p * sg * R))
                val += lam * D * P**2
                ds = ds + lam * D * 2.0 * P * R * sg * (1.0 - sg) * tau
        gh = (p[:, None] * (own_w[:, None] * 2.0 * r + ds[:, None] * nd.u[None, :])) / n
        gB = Xa.T @ gh + 2.0 * B * (reg + cost_col)[:, None]
        gb = gh.sum(axis=0)
        gtheta = -float(np.sum(p * ds)) / n
        return float(val), np.concatenate([gB.ravel(), gb, [gtheta]])

    z0 = np.concatenate([nd.B[cols].ravel(), nd.b, [nd.theta]])
    res = minimize(fun, z0, jac=True, method="L-BFGS-B", options={"maxiter": maxiter})
    B, b, theta = unpack(np.asarray(res.x, dtype=np.float64))
    nd.B[:] = 0.0
    nd.B[cols] = B
    nd.b[:] = b
    nd.theta = theta


def finetune_leaf(problem: Problem, nodes: list[Node], k: int, *, inner: int = 3) -> None:
    """§3.5: re-fit a final classifier's loss (ρ, no cost term) with its zero weights fixed."""
    gram: dict[str, npt.NDArray[Any]] = {}
    for _ in range(inner):
        fw = forward(problem, nodes)
        nd = nodes[k]
        gamma = np.maximum(np.sqrt(column_norms(nd)), CLAMP)
        active = np.sqrt(column_norms(nd)) > 0
        _leaf_closed_form(problem, nodes, fw, k, gamma, active, with_cost=False, gram=gram)
