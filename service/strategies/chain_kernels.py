"""The chain's per-word passes compiled (numba): what the structured runtimes run per request.

:mod:`service.strategies.chain` computes the same quantities with numpy, a fixed number of
array operations per part; on a word of a few letters numpy's cost per call (about a
microsecond) is most of the time, and the per-letter overhead of policy and decoding came to
half a HOG template (issue 28). These kernels loop over parts and labels in compiled code,
without the GIL (``nogil``: extraction threads decode side by side), and the numpy functions
stay the reference they are tested against (brute force on small chains, the plain
``letters-v1`` recipe).

Compiling takes a second or two per process, on first use: the structured runtimes call
:func:`compile_kernels` from their warm-up at load, so no request pays it. Nothing is cached
on disk (a read-only image has nowhere to write). This module is imported only by the
structured runtimes, so a server without structured bundles never loads numba.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from service.strategies.chain import ChainParams

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


@njit(nogil=True, cache=False)
def _viterbi(emission: F64, trans_t: F64, start: F64, end: F64) -> I64:  # pragma: no cover
    # (compiled: coverage cannot see inside; tests compare it with the numpy reference)
    length, y = emission.shape
    best = np.empty((length, y))
    back = np.zeros((length, y), dtype=np.int64)
    for b in range(y):
        best[0, b] = start[b] + emission[0, b]
    for t in range(1, length):
        for b in range(y):
            e = emission[t, b]
            m = -np.inf
            arg = 0
            for a in range(y):
                # the reference's order of additions, so ties break alike: (T[b, a] + e) + best
                v = (trans_t[b, a] + e) + best[t - 1, a]
                if v > m:
                    m = v
                    arg = a
            best[t, b] = m
            back[t, b] = arg
    out = np.empty(length, dtype=np.int64)
    m = -np.inf
    label = 0
    for b in range(y):
        v = best[length - 1, b] + end[b]
        if v > m:
            m = v
            label = b
    out[length - 1] = label
    for t in range(length - 1, 0, -1):
        label = back[t, label]
        out[t - 1] = label
    return out


# The sums of the forward-backward passes may be reassociated (vectorised): it changes them
# by a few ulps; no flag that assumes away NaN or infinity.
_SUMS = {"reassoc", "contract", "arcp"}


@njit(nogil=True, cache=False, fastmath=_SUMS)
def _marginals(
    emission: F64, trans: F64, trans_t: F64, start: F64, end: F64
) -> F64:  # pragma: no cover
    # Forward-backward in probability space with Rabiner's scaling at every part (never
    # underflows, whatever the spread); trans/start/end: exp of the max-shifted scores,
    # trans_t: trans transposed (C order), so both passes read memory contiguously.
    length, y = emission.shape
    phi = np.empty((length, y))
    for t in range(length):
        top = emission[t, 0]
        for b in range(1, y):
            if emission[t, b] > top:
                top = emission[t, b]
        for b in range(y):
            phi[t, b] = np.exp(emission[t, b] - top)
    alpha = np.empty((length, y))
    scale = np.empty(length)
    s = 0.0
    for b in range(y):
        alpha[0, b] = start[b] * phi[0, b]
        s += alpha[0, b]
    scale[0] = s
    for b in range(y):
        alpha[0, b] /= s
    for t in range(1, length):
        s = 0.0
        for b in range(y):
            acc = 0.0
            for a in range(y):
                acc += alpha[t - 1, a] * trans_t[b, a]
            acc *= phi[t, b]
            alpha[t, b] = acc
            s += acc
        scale[t] = s
        for b in range(y):
            alpha[t, b] /= s
    beta = np.empty((length, y))
    weighted = np.empty(y)
    for b in range(y):
        beta[length - 1, b] = end[b]
    for t in range(length - 2, -1, -1):
        for b in range(y):
            weighted[b] = phi[t + 1, b] * beta[t + 1, b]
        for a in range(y):
            acc = 0.0
            for b in range(y):
                acc += trans[a, b] * weighted[b]
            beta[t, a] = acc / scale[t + 1]
    out = np.empty((length, y))
    for t in range(length):
        s = 0.0
        for b in range(y):
            out[t, b] = alpha[t, b] * beta[t, b]
            s += out[t, b]
        for b in range(y):
            out[t, b] /= s
    return out


@njit(nogil=True, cache=False)
def _decode(
    emission: F64,
    score_t: F64,
    start_score: F64,
    end_score: F64,
    trans: F64,
    trans_t: F64,
    start: F64,
    end: F64,
) -> tuple[I64, F64]:  # pragma: no cover
    # Viterbi and the marginals in one call (what decoding a word needs)
    return (
        _viterbi(emission, score_t, start_score, end_score),
        _marginals(emission, trans, trans_t, start, end),
    )


@njit(nogil=True, cache=False)
def _s0_pass(
    base: F32, emission: F64, trans: F64, trans_t: F64, start: F64, end: F64
) -> tuple[F64, F32]:  # pragma: no cover
    # the S0 marginals and the policy's inputs from them, in one call
    marg = _marginals(emission, trans, trans_t, start, end)
    return marg, _policy_inputs(base, emission, marg)


@njit(nogil=True, cache=False)
def _policy_inputs(base: F32, emission: F64, marg: F64) -> F32:  # pragma: no cover
    # letters-v1 (service.strategies.chain.policy_inputs_v1): the base features, then per
    # part the softmax's top, top - second and entropy, the marginals' top and top - second,
    # and the previous and next parts' marginal top (1 at the ends).
    length, y = emission.shape
    d = base.shape[1]
    out = np.empty((length, d + 7), dtype=np.float32)
    mtop = np.empty(length)
    for t in range(length):
        for j in range(d):
            out[t, j] = base[t, j]
        top = emission[t, 0]
        for b in range(1, y):
            if emission[t, b] > top:
                top = emission[t, b]
        total = 0.0
        for b in range(y):
            total += np.exp(emission[t, b] - top)
        first = -1.0
        second = -1.0
        pz = 0.0
        for b in range(y):
            z = emission[t, b] - top
            p = np.exp(z) / total
            pz += p * z
            if p > first:
                second = first
                first = p
            elif p > second:
                second = p
        out[t, d] = first
        out[t, d + 1] = first - second
        out[t, d + 2] = np.log(total) - pz
        first = -1.0
        second = -1.0
        for b in range(y):
            p = marg[t, b]
            if p > first:
                second = first
                first = p
            elif p > second:
                second = p
        mtop[t] = first
        out[t, d + 3] = first
        out[t, d + 4] = first - second
    for t in range(length):
        out[t, d + 5] = 1.0 if t == 0 else mtop[t - 1]
        out[t, d + 6] = 1.0 if t == length - 1 else mtop[t + 1]
    return out


@njit(nogil=True, cache=False)
def _summary(marg: F64, labels: I64) -> tuple[F64, F32]:  # pragma: no cover
    # each part's marginal of its label, and the marginals' mean over parts (float32)
    length, y = marg.shape
    conf = np.empty(length)
    mean = np.zeros(y, dtype=np.float32)
    total = np.zeros(y)
    for t in range(length):
        conf[t] = marg[t, labels[t]]
        for b in range(y):
            total[b] += marg[t, b]
    for b in range(y):
        mean[b] = total[b] / length
    return conf, mean


def _check_word(emission: F64) -> None:
    # the kernels do not check bounds: an empty word would read out of bounds
    if len(emission) == 0:
        raise ValueError("a word has at least one part")


def summary(marg: F64, labels: I64) -> tuple[F64, F32]:
    """Each part's marginal probability of its label (L,) and the marginals' mean over the
    parts (Y,) as float32 (the class probabilities a structured answer reports)."""
    out: tuple[F64, F32] = _summary(
        np.ascontiguousarray(marg, dtype=np.float64), np.ascontiguousarray(labels, dtype=np.int64)
    )
    return out


def viterbi(emission: F64, chain: ChainParams) -> I64:
    """:func:`service.strategies.chain.viterbi_one`, compiled: the best labels of one word
    (L, Y); ties go to the lowest label."""
    _check_word(emission)
    out: I64 = _viterbi(
        np.ascontiguousarray(emission, dtype=np.float64),
        chain.transition_t,
        chain.start,
        chain.end,
    )
    return out


def decode(emission: F64, chain: ChainParams) -> tuple[I64, F64]:
    """:func:`viterbi` and the per-part label marginals of one word (L, Y) in one compiled
    call (:func:`service.strategies.chain.marginals_one`'s, rescaled at every part)."""
    _check_word(emission)
    trans, start, end = chain.probabilities
    out: tuple[I64, F64] = _decode(
        np.ascontiguousarray(emission, dtype=np.float64),
        chain.transition_t,
        chain.start,
        chain.end,
        trans,
        chain.probabilities_t,
        start,
        end,
    )
    return out


def s0_pass(base_features: F32, emission: F64, chain: ChainParams) -> tuple[F64, F32]:
    """The S0 marginals and the policy's inputs from them
    (:func:`service.strategies.chain.policy_inputs_v1`) in one compiled call."""
    _check_word(emission)
    trans, start, end = chain.probabilities
    out: tuple[F64, F32] = _s0_pass(
        np.ascontiguousarray(base_features, dtype=np.float32),
        np.ascontiguousarray(emission, dtype=np.float64),
        trans,
        chain.probabilities_t,
        start,
        end,
    )
    return out


def compile_kernels(chain: ChainParams, dims: int) -> None:
    """Compile every kernel for ``chain``'s label count and base features of ``dims``
    columns (a no-op after the first time in a process)."""
    emission = np.zeros((2, chain.n_labels))
    viterbi(emission, chain)
    labels, marg = decode(emission, chain)
    s0_pass(np.zeros((2, dims), dtype=np.float32), emission, chain)
    summary(marg, labels)
