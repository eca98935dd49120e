"""A small part-of-speech tagger, so a parser bundle takes raw tokenised text.

The parser's templates (``service.extractors.parsing``) read universal POS tags. A client
that has only word forms sends tokens without ``upos``; a bundle that carries a tagger
(``item.tagger`` in its manifest) tags them while the item is decoded, and the time it takes
is charged to the request like the rest of decoding.

The model is a greedy left-to-right averaged perceptron (Collins 2002), with the features
of Honnibal's "A good part-of-speech tagger in about 200 lines of Python": the word, its
prefix, suffixes and shape, its neighbours' words and suffixes (*static*: computed for the
whole sentence at once), and the two tags before it, alone, together and with the word
(*dynamic*: they depend on the tags already chosen). Features are hashed (CRC-32, the same in
every process) into ``buckets`` rows of a ``(buckets, 17)`` float32 weight array, one column
per universal POS tag. Training lives in ``training/parsing/tagger.py``; both sides compute
features with :func:`static_ids` and :class:`Tagger`.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from service.bundle import TaggerSpec
from service.errors import BundleError
from service.extractors.parsing import UPOS
from service.inference import bundle_file

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float32]

#: Static features per token (each a row of the weight array).
STATIC_FEATURES = 14
_START = "<s>"
_END = "</s>"
#: The "tags" two before and one before the first word.
NO_TAG = ("-START2-", "-START-")


def _id(kind: str, value: str, mask: int) -> int:
    return zlib.crc32(f"{kind}\x1f{value}".encode()) & mask


def shape(form: str) -> str:
    """The word's shape, runs collapsed: ``Xx``, ``d``, ``x-x``, ``X.X``."""
    out: list[str] = []
    for ch in form[:12]:
        c = "X" if ch.isupper() else "x" if ch.isalpha() else "d" if ch.isdigit() else ch
        if not out or out[-1] != c:
            out.append(c)
    return "".join(out)


def static_ids(forms: Sequence[str], buckets: int) -> IntArray:
    """``(n, STATIC_FEATURES)`` weight rows of the features that do not depend on tags."""
    mask = buckets - 1
    lower = [f.lower() for f in forms]
    padded = [_START, _START, *lower, _END, _END]
    n = len(forms)
    out = np.empty((n, STATIC_FEATURES), dtype=np.int64)
    bias = _id("bias", "", mask)
    for i in range(n):
        w = lower[i]
        form = forms[i]
        p = i + 2  # index in padded
        out[i] = (
            bias,
            _id("w", w, mask),
            _id("suf3", w[-3:], mask),
            _id("suf2", w[-2:], mask),
            _id("pre1", w[:1], mask),
            _id("shape", shape(form), mask),
            _id("first-cap", f"{i == 0}{form[:1].isupper()}", mask),
            _id("w-1", padded[p - 1], mask),
            _id("suf3-1", padded[p - 1][-3:], mask),
            _id("w-2", padded[p - 2], mask),
            _id("w+1", padded[p + 1], mask),
            _id("suf3+1", padded[p + 1][-3:], mask),
            _id("w+2", padded[p + 2], mask),
            _id("w-1+w", f"{padded[p - 1]}\x1f{w}", mask),
        )
    return out


class DynamicRows:
    """The weight rows of the features of the two tags before a word (and the word)."""

    def __init__(self, buckets: int) -> None:
        self.mask = buckets - 1
        prev = [NO_TAG[1], *UPOS]
        self._t1 = {t: _id("t-1", t, self.mask) for t in prev}
        self._t2 = {t: _id("t-2", t, self.mask) for t in [*NO_TAG, *UPOS]}
        self._t12 = {
            (a, b): _id("t-2+t-1", f"{a}\x1f{b}", self.mask) for a in self._t2 for b in prev
        }

    def __call__(self, prev2: str, prev: str, word: str) -> tuple[int, int, int, int]:
        return (
            self._t1[prev],
            self._t2[prev2],
            self._t12[(prev2, prev)],
            _id("t-1+w", f"{prev}\x1f{word}", self.mask),
        )


class Tagger:
    """Greedy tagging with a ``(buckets, 17)`` weight array (``buckets`` a power of two)."""

    def __init__(self, weights: npt.ArrayLike) -> None:
        w = np.asarray(weights, dtype=np.float32)
        buckets = w.shape[0] if w.ndim == 2 else 0
        if w.ndim != 2 or w.shape[1] != len(UPOS) or buckets < 2 or buckets & (buckets - 1):
            raise ValueError(
                f"tagger weights must be (buckets, {len(UPOS)}) with buckets a power of two, "
                f"got shape {w.shape}"
            )
        if not np.all(np.isfinite(w)):
            raise ValueError("tagger weights hold non-finite values")
        self.weights = w
        self.buckets = buckets
        self.dynamic = DynamicRows(buckets)

    def tag(self, forms: Sequence[str], given: Sequence[str | None] | None = None) -> list[str]:
        """Universal POS tags of ``forms``; where ``given`` holds a tag, that tag is kept
        (and the words after it are tagged knowing it)."""
        ids = static_ids(forms, self.buckets)
        static = self.weights[ids].sum(axis=1)  # (n, 17)
        prev2, prev = NO_TAG
        tags: list[str] = []
        for i, form in enumerate(forms):
            fixed = given[i] if given is not None else None
            if fixed is None:
                dyn = self.dynamic(prev2, prev, form.lower())
                scores = static[i] + self.weights[list(dyn)].sum(axis=0)
                fixed = UPOS[int(np.argmax(scores))]
            tags.append(fixed)
            prev2, prev = prev, fixed
        return tags


def load_tagger(bundle_dir: Path, spec: TaggerSpec) -> Tagger:
    """The tagger a manifest's ``item.tagger`` names (``BundleError`` if it cannot be read)."""
    path = bundle_file(bundle_dir, spec.file, "item.tagger")
    try:
        return Tagger(np.load(path, allow_pickle=False))
    except (OSError, ValueError) as exc:
        raise BundleError(f"item.tagger: cannot use {spec.file!r}: {exc}") from exc
