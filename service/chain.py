"""A linear-chain model over parts, decoded exactly (shared by the structured strategies and
by ``training.structured``, which adds the brute-force oracle).

Scores: ``score(y) = start[y_0] + Σ_i emission[i, y_i] + Σ_i transition[y_{i-1}, y_i]
+ end[y_{L-1}]``. Batched over words padded to one length, with a mask of real parts.
The emission of part i in state S is additive over templates::

    emission[i] = base + Σ_k S[i, k] · contribution[k][i]

so one array of per-template contributions evaluates any state (:func:`emissions`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Bool = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class ChainParams:
    """Transition scores between labels (``transition[a, b]``: label a followed by b) and
    the scores of the first and last labels."""

    transition: F64
    start: F64
    end: F64

    @property
    def n_labels(self) -> int:
        return int(self.transition.shape[0])


def emissions(base: F64, contributions: F64, states: Bool) -> F64:
    """Emission scores (B, L, Y) of states (B, L, K) from per-template contributions
    (B, L, K, Y) and the state-independent ``base`` (Y,)."""
    out: F64 = base[None, None, :] + np.einsum(
        "blk,blky->bly", states.astype(np.float64), contributions
    )
    return out


def viterbi(emission: F64, mask: Bool, chain: ChainParams) -> I64:
    """Best label sequence of each word: (B, L) labels (-1 where ``mask`` is False).

    ``mask`` (B, L) marks the real parts; every word has its parts first (a prefix)."""
    b, length, y = emission.shape
    lengths = mask.sum(axis=1)
    delta = chain.start[None, :] + emission[:, 0, :]
    back = np.zeros((b, length, y), dtype=np.int64)
    for t in range(1, length):
        scores = delta[:, :, None] + chain.transition[None, :, :]
        best = scores.argmax(axis=1)
        new = np.take_along_axis(scores, best[:, None, :], axis=1)[:, 0, :] + emission[:, t, :]
        live = mask[:, t]
        delta = np.where(live[:, None], new, delta)
        back[:, t, :] = np.where(live[:, None], best, np.arange(y)[None, :])
    delta = delta + chain.end[None, :]
    out = np.full((b, length), -1, dtype=np.int64)
    label = delta.argmax(axis=1)
    for t in range(length - 1, -1, -1):
        live = t < lengths
        out[:, t] = np.where(live, label, -1)
        if t > 0:
            prev = back[np.arange(b), t, label]
            label = np.where(live, prev, label)
    return out


def _logsumexp(a: F64, axis: int) -> F64:
    m = a.max(axis=axis, keepdims=True)
    out: F64 = np.squeeze(m, axis=axis) + np.log(np.exp(a - m).sum(axis=axis))
    return out


def marginals(emission: F64, mask: Bool, chain: ChainParams) -> F64:
    """Per-part label marginals (B, L, Y) of the chain's Gibbs distribution (rows of
    padded parts are zero)."""
    b, length, y = emission.shape
    lengths = mask.sum(axis=1)
    alpha = np.zeros((b, length, y))
    alpha[:, 0] = chain.start[None, :] + emission[:, 0]
    for t in range(1, length):
        alpha[:, t] = (
            _logsumexp(alpha[:, t - 1, :, None] + chain.transition[None], axis=1) + emission[:, t]
        )
    beta = np.zeros((b, length, y))
    last = lengths - 1
    beta[np.arange(b), last] = chain.end[None, :].repeat(b, axis=0)
    for t in range(length - 2, -1, -1):
        inner = _logsumexp(
            chain.transition[None] + (emission[:, t + 1] + beta[:, t + 1])[:, None, :], axis=2
        )
        beta[:, t] = np.where((t < last)[:, None], inner, beta[:, t])
    log_z = _logsumexp(alpha[np.arange(b), last] + chain.end[None, :], axis=1)
    out: F64 = np.exp(alpha + beta - log_z[:, None, None])
    out[~mask] = 0.0
    return out


def policy_inputs_v1(base_features: F32, emission: F64, chain: ChainParams) -> F32:
    """Per-part policy inputs from the initial state S0, recipe ``letters-v1``, given the
    base template's features (L, d) and the S0 emission scores (L, Y): the features; the
    part's own emission softmax top probability, margin to the second and entropy; the
    chain's S0 marginal top probability and margin (one forward-backward: the paper's
    "complex" policy features, paid for in inference time); the previous and next
    parts' S0 marginal top (1 at the ends).
    Training (``training.structured.ocr``) and the structured runtimes both call this."""
    s = emission
    z = s - s.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    top2 = -np.sort(-p, axis=1)[:, :2]
    entropy = -(p * np.log(np.maximum(p, 1e-12))).sum(axis=1)
    marg = marginals_one(s, chain)
    mtop2 = -np.sort(-marg, axis=1)[:, :2]
    prev_top = np.concatenate([[1.0], mtop2[:-1, 0]])
    next_top = np.concatenate([mtop2[1:, 0], [1.0]])
    extra = np.stack(
        [
            top2[:, 0],
            top2[:, 0] - top2[:, 1],
            entropy,
            mtop2[:, 0],
            mtop2[:, 0] - mtop2[:, 1],
            prev_top,
            next_top,
        ],
        axis=1,
    )
    return np.concatenate([base_features.astype(np.float32), extra.astype(np.float32)], axis=1)


def viterbi_one(emission: F64, chain: ChainParams) -> I64:
    """:func:`viterbi` of one word (L, Y), with less per-step overhead (the service's path)."""
    length = len(emission)
    delta = chain.start + emission[0]
    back = np.zeros((length, emission.shape[1]), dtype=np.int64)
    for t in range(1, length):
        scores = delta[:, None] + chain.transition
        back[t] = scores.argmax(axis=0)
        delta = scores.max(axis=0) + emission[t]
    out = np.zeros(length, dtype=np.int64)
    out[-1] = int(np.argmax(delta + chain.end))
    for t in range(length - 1, 0, -1):
        out[t - 1] = back[t, out[t]]
    return out


def marginals_one(emission: F64, chain: ChainParams) -> F64:
    """:func:`marginals` of one word (L, Y): scaled forward-backward in probability space."""
    length = len(emission)
    shift = emission.max(axis=1, keepdims=True)
    phi = np.exp(emission - shift)
    trans = np.exp(chain.transition - chain.transition.max())
    alpha = np.zeros_like(phi)
    a = np.exp(chain.start - chain.start.max()) * phi[0]
    alpha[0] = a / a.sum()
    for t in range(1, length):
        a = (alpha[t - 1] @ trans) * phi[t]
        alpha[t] = a / a.sum()
    beta = np.zeros_like(phi)
    b = np.exp(chain.end - chain.end.max())
    beta[-1] = b / b.sum()
    for t in range(length - 2, -1, -1):
        b = trans @ (phi[t + 1] * beta[t + 1])
        beta[t] = b / b.sum()
    out: F64 = alpha * beta
    out /= out.sum(axis=1, keepdims=True)
    return out
