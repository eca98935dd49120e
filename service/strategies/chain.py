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
from functools import cached_property

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

    @cached_property
    def probabilities(self) -> tuple[F64, F64, F64]:
        """``exp`` of the transition, start and end scores, each shifted by its maximum
        (the scaled forward-backward's factors), computed once per chain."""
        return (
            np.exp(self.transition - self.transition.max()),
            np.exp(self.start - self.start.max()),
            np.exp(self.end - self.end.max()),
        )

    @cached_property
    def probabilities_t(self) -> F64:
        """The shifted ``exp`` of the transition scores transposed, in C order (``[b, a]``),
        so the compiled forward pass reads each label's predecessors contiguously."""
        return np.ascontiguousarray(self.probabilities[0].T)

    @cached_property
    def transition_t(self) -> F64:
        """``transition.T`` in C order (``[b, a]``: a followed by b), so that a word's
        Viterbi steps are formed in one array operation (:func:`viterbi_one`)."""
        return np.ascontiguousarray(self.transition.T)

    @cached_property
    def spread(self) -> float:
        """The largest drop, in log space, of the shifted scores one part of a word
        multiplies in (transition, start or end; emissions are shifted row by row)."""
        return float(max(np.ptp(self.transition), np.ptp(self.start), np.ptp(self.end)))


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


def policy_inputs_v1(
    base_features: F32, emission: F64, chain: ChainParams, marginals: F64 | None = None
) -> F32:
    """Per-part policy inputs from the initial state S0, recipe ``letters-v1``, given the
    base template's features (L, d) and the S0 emission scores (L, Y): the features; the
    part's own emission softmax top probability, margin to the second and entropy; the
    chain's S0 marginal top probability and margin (one forward-backward: the paper's
    "complex" policy features, paid for in inference time); the previous and next
    parts' S0 marginal top (1 at the ends). ``marginals``: the S0 marginals when the caller
    has them already (:func:`marginals_one` of ``emission``).
    Training (``training.structured.ocr``) and the structured runtimes both call this; it
    works on the whole word at once (a fixed number of array operations, whatever its length).
    """
    length = len(emission)
    z = emission - emission.max(axis=1, keepdims=True)
    e = np.exp(z)
    total = e.sum(axis=1)
    p = e / total[:, None]
    marg = marginals_one(emission, chain) if marginals is None else marginals
    # the two largest of each row, of the softmax and of the marginals in one partition
    both = np.concatenate([p, marg])
    top2 = -np.partition(-both, 1, axis=1)[:, :2]
    out = np.empty((length, base_features.shape[1] + 7), dtype=np.float32)
    d = base_features.shape[1]
    out[:, :d] = base_features
    extra = out[:, d:]
    extra[:, 0] = top2[:length, 0]
    extra[:, 1] = top2[:length, 0] - top2[:length, 1]
    # entropy of the softmax: log Σ e^z − Σ p z (p log p summed without forming log p)
    extra[:, 2] = np.log(total) - np.einsum("ly,ly->l", p, z)
    mtop = top2[length:, 0]
    extra[:, 3] = mtop
    extra[:, 4] = mtop - top2[length:, 1]
    extra[0, 5] = 1.0
    extra[1:, 5] = mtop[:-1]
    extra[:-1, 6] = mtop[1:]
    extra[-1, 6] = 1.0
    return out


def viterbi_one(emission: F64, chain: ChainParams) -> I64:
    """:func:`viterbi` of one word (L, Y), with two array operations per part: every
    part's step scores ``transition + emission`` are formed for the whole word in one
    operation, then each part adds its predecessor's best scores in place and takes the
    row maxima; the best predecessors of every part come from one ``argmax`` over the
    whole word, and the backtrack runs on Python ints. Ties go to the lowest label, as in
    :func:`viterbi`."""
    length, y = emission.shape
    # steps[t - 1, b, a]: label a at part t - 1 followed by b at part t
    steps = chain.transition_t[None, :, :] + emission[1:, :, None]
    best = np.empty((length, y))
    np.add(chain.start, emission[0], out=best[0])
    for t in range(1, length):
        step = steps[t - 1]
        step += best[t - 1]
        step.max(axis=1, out=best[t])
    label = int(np.argmax(best[-1] + chain.end))
    out = [label]
    if length > 1:
        pointers = steps.argmax(axis=2).tolist()
        for t in range(length - 2, -1, -1):
            label = pointers[t][label]
            out.append(label)
    return np.asarray(out[::-1], dtype=np.int64)


# Largest spread (max - min, in log space) of the scores multiplied along a word for which
# the unscaled forward-backward stays far from float64 underflow (e^-600 ~ 1e-261).
_UNSCALED_SPREAD = 600.0


def marginals_one(emission: F64, chain: ChainParams) -> F64:
    """:func:`marginals` of one word (L, Y): forward-backward in probability space. Each
    part's factor ``exp(transition) * exp(emission)`` is formed for all parts in one array
    operation. Scores are shifted to a maximum of 0 (row by row for emissions), so a pass
    can shrink the mass by at most e^-spread per part; when that cannot reach underflow
    the two passes run unscaled and together, one batched vector-matrix product per part
    (the forward pass at part t beside the backward pass at part L-1-t); otherwise each
    step is rescaled (Rabiner's scaling)."""
    trans, start, end = chain.probabilities
    length, y = emission.shape
    phi = np.exp(emission - emission.max(axis=1, keepdims=True))
    if length == 1:
        single: F64 = (start * phi[0] * end)[None, :]
        single /= single.sum()
        return single
    factor = trans[None, :, :] * phi[1:, None, :]  # factor[t-1, a, b]: into part t
    if chain.spread * length < _UNSCALED_SPREAD:
        # passes[t, 0] = alpha[t]; passes[t, 1] = beta[L-1-t] (row vectors)
        pair = np.empty((length - 1, 2, y, y))
        pair[:, 0] = factor
        pair[:, 1] = factor[::-1].transpose(0, 2, 1)
        passes = np.empty((length, 2, 1, y))
        passes[0, 0, 0] = start * phi[0]
        passes[0, 1, 0] = end
        for t in range(1, length):
            np.matmul(passes[t - 1], pair[t - 1], out=passes[t])
        out: F64 = passes[:, 0, 0] * passes[::-1, 1, 0]
    else:
        alpha = np.empty_like(phi)
        beta = np.empty_like(phi)
        alpha[0] = start * phi[0]
        beta[-1] = end
        scale = np.empty(length)
        scale[0] = alpha[0].sum()
        alpha[0] /= scale[0]
        for t in range(1, length):
            a = alpha[t - 1] @ factor[t - 1]
            scale[t] = s = a.sum()
            np.divide(a, s, out=alpha[t])
        for t in range(length - 2, -1, -1):
            np.divide(factor[t] @ beta[t + 1], scale[t + 1], out=beta[t])
        out = alpha * beta
    out /= out.sum(axis=1, keepdims=True)
    return out
