"""The linear chain of :mod:`service.strategies.chain` (the one the service decodes with),
plus what only training needs: padding words into batches and the brute-force oracle."""

from __future__ import annotations

import itertools

import numpy as np
import numpy.typing as npt

from service.strategies.chain import ChainParams, emissions, marginals, viterbi

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Bool = npt.NDArray[np.bool_]

__all__ = ["ChainParams", "brute_force", "emissions", "marginals", "pad", "viterbi"]


def brute_force(emission: F64, chain: ChainParams) -> tuple[I64, F64]:
    """Exhaustive search for one word (L, Y): its best labels and the marginals. Oracle of
    :func:`viterbi` and :func:`marginals`; only for tiny L and Y."""
    length, y = emission.shape
    best_score = -np.inf
    best: tuple[int, ...] = ()
    scores = []
    sequences = list(itertools.product(range(y), repeat=length))
    for seq in sequences:
        s = (
            chain.start[seq[0]]
            + chain.end[seq[-1]]
            + sum(emission[i, seq[i]] for i in range(length))
        )
        s += sum(chain.transition[seq[i - 1], seq[i]] for i in range(1, length))
        scores.append(s)
        if s > best_score:
            best_score, best = s, seq
    arr = np.asarray(scores)
    p = np.exp(arr - arr.max())
    p /= p.sum()
    marg = np.zeros((length, y))
    for prob, seq in zip(p, sequences, strict=True):
        for i, label in enumerate(seq):
            marg[i, label] += prob
    return np.asarray(best, dtype=np.int64), marg


def pad(rows: list[F64], width: int | None = None) -> tuple[F64, Bool]:
    """Stack per-word arrays (L_w, ...) into (B, L_max, ...) with the mask of real parts."""
    length = width or max(len(r) for r in rows)
    shape = (len(rows), length, *rows[0].shape[1:])
    out = np.zeros(shape, dtype=np.float64)
    mask = np.zeros((len(rows), length), dtype=bool)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
        mask[i, : len(r)] = True
    return out, mask
