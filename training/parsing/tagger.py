"""Training the part-of-speech tagger a parser bundle carries (``service.extractors.tagging``).

A greedy averaged perceptron (Collins 2002): each word is tagged left to right with the tags
already *predicted* before it (as at serving time), and on a mistake the weights of its
features move toward the gold tag and away from the guess. The averaged weights (every
update weighted by how long it stood) are exported, a ``(buckets, 17)`` float32 array.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from service.extractors.parsing import UPOS, UPOS_ID, Sentence
from service.extractors.tagging import NO_TAG, DynamicRows, Tagger, static_ids

#: Weight rows of a bundle's tagger (8.9 MB of float32 at 17 tags).
DEFAULT_TAGGER_BUCKETS = 1 << 17


def train_tagger(
    sentences: Sequence[Sentence],
    *,
    buckets: int = DEFAULT_TAGGER_BUCKETS,
    epochs: int = 5,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> npt.NDArray[np.float32]:
    """The averaged weights after ``epochs`` shuffled passes over ``sentences`` (their
    ``forms`` and gold ``upos``)."""
    if buckets < 2 or buckets & (buckets - 1):
        raise ValueError(f"buckets must be a power of two >= 2, got {buckets}")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    weights = np.zeros((buckets, len(UPOS)), dtype=np.float64)
    stamped = np.zeros_like(weights)  # Σ c · update, for the average
    dynamic = DynamicRows(buckets)
    static = [static_ids(s.forms, buckets) for s in sentences]
    gold = [[UPOS_ID[t] for t in s.upos] for s in sentences]
    rng = np.random.default_rng(seed)
    c = 1
    for epoch in range(epochs):
        right = total = 0
        for k in rng.permutation(len(sentences)):
            forms, ids, want = sentences[k].forms, static[k], gold[k]
            prev2, prev = NO_TAG
            for i, form in enumerate(forms):
                rows = np.concatenate((ids[i], dynamic(prev2, prev, form.lower())))
                guess = int(np.argmax(weights[rows].sum(axis=0)))
                g = int(want[i])
                if guess != g:
                    # Columns are views: a row listed twice (a hash collision) counts twice.
                    np.add.at(weights[:, g], rows, 1.0)
                    np.add.at(weights[:, guess], rows, -1.0)
                    np.add.at(stamped[:, g], rows, float(c))
                    np.add.at(stamped[:, guess], rows, -float(c))
                else:
                    right += 1
                total += 1
                c += 1
                prev2, prev = prev, UPOS[guess]
        if log is not None:
            share = right / max(total, 1)
            log(f"tagger: epoch {epoch + 1}/{epochs}, training accuracy {share:.4f}")
    return (weights - stamped / c).astype(np.float32)


def tag_accuracy(tagger: Tagger, sentences: Sequence[Sentence]) -> float:
    """Share of tokens of ``sentences`` whose predicted tag is the gold one."""
    right = total = 0
    for s in sentences:
        predicted = tagger.tag(s.forms)
        right += sum(p == g for p, g in zip(predicted, s.upos, strict=True))
        total += len(s.upos)
    return right / total if total else 0.0


def build_tagger(
    train: Sequence[Sentence],
    held_out: Sequence[Sentence],
    epochs: int,
    seed: int,
    *,
    reuse: Path | None = None,
    log: Callable[[str], None] = print,
) -> tuple[npt.NDArray[np.float32], float]:
    """A bundle's tagger weights, trained on ``train`` (or an earlier build's ``tagger.npy``,
    ``reuse``), and their tag accuracy on ``held_out``."""
    if reuse is None:
        log(f"tagger: {len(train)} training sentences, {epochs} epochs")
        weights = train_tagger(train, epochs=epochs, seed=seed)
    else:
        weights = np.asarray(np.load(reuse, allow_pickle=False), dtype=np.float32)
        log(f"tagger: weights from {reuse} (not retrained)")
    accuracy = tag_accuracy(Tagger(weights), held_out)
    log(f"tagger: {accuracy:.4f} tag accuracy on {len(held_out)} held-out sentences")
    return weights, accuracy


def jackknifed(
    sentences: Sequence[Sentence],
    *,
    folds: int = 4,
    epochs: int,
    seed: int,
    log: Callable[[str], None] = print,
) -> list[Sentence]:
    """``sentences`` with tags predicted as at serving time, by jackknifing: each of
    ``folds`` parts is tagged by a tagger trained on the other parts, so a parser trained on
    them learns from the tagger's kind of mistakes, not from tags no client would send."""
    if folds < 2:
        raise ValueError(f"folds must be >= 2, got {folds}")
    part = np.random.default_rng(seed).permutation(len(sentences)) % folds
    out: list[Sentence] = list(sentences)
    right = total = 0
    for k in range(folds):
        rest = [s for s, f in zip(sentences, part, strict=True) if f != k]
        tagger = Tagger(train_tagger(rest, epochs=epochs, seed=seed + k))
        for i in np.flatnonzero(part == k).tolist():
            predicted = tagger.tag(sentences[i].forms)
            right += sum(p == g for p, g in zip(predicted, sentences[i].upos, strict=True))
            total += len(predicted)
            out[i] = Sentence(sentences[i].forms, predicted)
    log(f"tagger: training sentences jackknifed ({folds} folds), {right / max(total, 1):.4f} right")
    return out
