"""The OCR task of paper 004: handwritten words as chains of 16x8 letters.

Templates: raw pixels (``pixels``, base: every initial state has them) and HOG with 3x3
pixel cells (``hog``), computed by the same functions as the service's extractor plugins
(``service.extractors.letters``).

The predictor F(X, S) is a linear-chain model. Its emissions come from one multinomial
logistic regression over the masked templates ``[x_pixels·s_pixels, x_hog·s_hog, s_pixels,
s_hog]`` trained on letters paired with random states (the paper's "random edge features",
so that it scores any state well), which makes every template's contribution additive:
``emission = base + Σ_k S_k (W_k x_k + u_k)``; transitions are the training words' label
bigrams (log-probabilities) with the emission's label prior divided out, weighted by α
chosen on a validation split of the training words (piecewise training of the chain).

:func:`cross_fit` builds the :class:`ChainProblem` the policies are trained on: every
training word's contributions come from a chain fitted without its fold (Appendix B).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression

from service.extractors.letters import hog_batch, pixels_batch
from service.strategies.chain import policy_inputs_v1
from training.structured.chain import ChainParams, emissions, pad, viterbi
from training.structured.problem import ChainProblem
from training.structured.state import Template, TemplateSet

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

DEFAULT_DATA = Path("../shared/datasets/ocr-letters/ocr-letters.npz")
LETTERS = [chr(ord("a") + i) for i in range(26)]
TEMPLATE_NAMES = ("pixels", "hog")
ALPHAS = (0.0, 0.5, 1.0, 1.5)


@dataclass
class OcrData:
    """Letters (n, 16, 8), labels (n,), ``offsets`` (words + 1) and each word's fold."""

    letters: npt.NDArray[np.uint8]
    labels: I64
    offsets: I64
    folds: I64

    @property
    def n_words(self) -> int:
        return len(self.offsets) - 1

    def word(self, w: int) -> slice:
        return slice(int(self.offsets[w]), int(self.offsets[w + 1]))

    def lengths(self) -> I64:
        out: I64 = np.diff(self.offsets)
        return out


def load_ocr(path: Path = DEFAULT_DATA) -> OcrData:
    """The OCR words: the shared data set's ``.npz`` (Taskar et al.'s letters), or a folder
    of word images in the layout of :func:`load_ocr_folder`."""
    if path.is_dir():
        return load_ocr_folder(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"OCR data not found at {path}; it is ocr-letters/ocr-letters.npz of the shared "
            "datasets (../shared/datasets from the repository root), or a folder of word "
            "images with labels.tsv: pass its path with --data"
        )
    raw = np.load(path)
    return OcrData(
        letters=raw["pixels"].reshape(-1, 16, 8).astype(np.uint8),
        labels=raw["labels"].astype(np.int64),
        offsets=raw["word_offsets"].astype(np.int64),
        folds=raw["folds"].astype(np.int64),
    )


LABELS_FILE = "labels.tsv"
FOLDS = 10


def load_ocr_folder(folder: Path) -> OcrData:
    """Words from a folder: ``labels.tsv`` lists one word per line, ``FILE<TAB>WORD`` or
    ``FILE<TAB>WORD<TAB>FOLD`` (``#`` starts a comment); ``FILE`` (relative to the folder) is
    a PNG 16 pixels high and 8 per letter wide, the word's letters side by side, ink white
    (gray ≥ 128 reads as 1) on black, as the service's ``letters`` items take letters;
    ``WORD`` is its lower-case letters a–z, one per 8 pixels. Without a fold column every
    word gets fold = CRC-32 of its file name mod 10; fold 0 is the held-out test fold."""
    import zlib

    from PIL import Image

    listing = folder / LABELS_FILE
    if not listing.is_file():
        raise FileNotFoundError(
            f"{listing} not found: a word-image folder needs {LABELS_FILE} (FILE<TAB>WORD "
            "[<TAB>FOLD] per line) beside its PNGs"
        )
    letters: list[npt.NDArray[np.uint8]] = []
    labels: list[int] = []
    offsets = [0]
    folds: list[int] = []
    for number, line in enumerate(listing.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = line.rstrip("\n").split("\t")
        where = f"{listing}:{number}"
        if len(fields) not in (2, 3):
            raise ValueError(f"{where}: expected FILE<TAB>WORD[<TAB>FOLD], got {line!r}")
        name, word = fields[0], fields[1]
        if not word or any(c not in LETTERS for c in word):
            raise ValueError(f"{where}: the word {word!r} must be lower-case letters a-z")
        try:
            with Image.open(folder / name) as image:
                pixels = np.asarray(image.convert("L"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{where}: cannot read the image {name!r}: {exc}") from None
        if pixels.shape != (16, 8 * len(word)):
            raise ValueError(
                f"{where}: {name!r} is {pixels.shape[1]}x{pixels.shape[0]} pixels; a word of "
                f"{len(word)} letters must be {8 * len(word)} wide and 16 high"
            )
        ink = (pixels >= 128).astype(np.uint8)
        letters.extend(ink[:, 8 * i : 8 * i + 8] for i in range(len(word)))
        labels.extend(ord(c) - ord("a") for c in word)
        offsets.append(len(labels))
        fold = fields[2] if len(fields) == 3 else str(zlib.crc32(name.encode()) % FOLDS)
        if not fold.isdigit():
            raise ValueError(f"{where}: the fold {fold!r} must be a whole number")
        folds.append(int(fold))
    if not labels:
        raise ValueError(f"{listing} lists no word")
    return OcrData(
        letters=np.stack(letters),
        labels=np.asarray(labels, dtype=np.int64),
        offsets=np.asarray(offsets, dtype=np.int64),
        folds=np.asarray(folds, dtype=np.int64),
    )


def write_ocr_folder(data: OcrData, folder: Path, words: Sequence[int] | None = None) -> None:
    """Write ``words`` (default: all) of ``data`` in the layout :func:`load_ocr_folder`
    reads (one PNG per word, ``labels.tsv`` with each word's fold)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for w in range(data.n_words) if words is None else words:
        sl = data.word(w)
        image = np.concatenate(list(data.letters[sl]), axis=1) * 255
        name = f"{w:05d}.png"
        Image.fromarray(image.astype(np.uint8)).save(folder / name)
        word = "".join(LETTERS[y] for y in data.labels[sl])
        lines.append(f"{name}\t{word}\t{int(data.folds[w])}")
    (folder / LABELS_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")


def template_features(data: OcrData) -> list[F32]:
    """Per-letter features of every template, in ``TEMPLATE_NAMES`` order."""
    return [pixels_batch(data.letters), hog_batch(data.letters)]


@dataclass
class ChainModel:
    """The fitted predictor: per-template linear contributions, base scores and the chain."""

    weights: list[F64]  # per template (dims_k, 26)
    offsets_k: list[F64]  # per template (26,): u_k, what having the template adds
    base: F64  # (26,)
    chain: ChainParams
    alpha: float

    def contributions(self, features: Sequence[F32], rows: slice | npt.NDArray[np.int64]) -> F64:
        """(n, K, 26) contributions of letters ``rows``."""
        return np.stack(
            [
                f[rows].astype(np.float64) @ w + u
                for f, w, u in zip(features, self.weights, self.offsets_k, strict=True)
            ],
            axis=1,
        )


def _random_states(n: int, k: int, rng: np.random.Generator) -> npt.NDArray[np.bool_]:
    """Uniform over the 2^k template subsets."""
    return rng.random((n, k)) < 0.5


def fit_emissions(
    features: Sequence[F32],
    labels: I64,
    rng: np.random.Generator,
    *,
    replicas: int = 2,
    c: float = 1.0,
    max_iter: int = 200,
) -> tuple[list[F64], list[F64], F64]:
    """The emission model over random states: (W_k, u_k) per template and the base."""
    k = len(features)
    n = len(labels)
    blocks, masks, ys = [], [], []
    for _ in range(replicas):
        s = _random_states(n, k, rng)
        blocks.append(np.concatenate([f * s[:, [j]] for j, f in enumerate(features)], axis=1))
        masks.append(s.astype(np.float32))
        ys.append(labels)
    x = np.concatenate(blocks)
    m = np.concatenate(masks)
    mean = x.mean(axis=0)
    scale = x.std(axis=0)
    scale = np.where(scale > 1e-8, scale, 1.0)
    z = np.concatenate([(x - mean) / scale, m], axis=1)
    model = LogisticRegression(C=c, max_iter=max_iter)
    with warnings.catch_warnings():
        # a capped number of iterations is a deliberate time budget, not a failure
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(z, np.concatenate(ys))
    coef = np.zeros((26, z.shape[1]))
    coef[model.classes_] = model.coef_
    intercept = np.full(26, -30.0)
    intercept[model.classes_] = model.intercept_
    dims = [f.shape[1] for f in features]
    w_all = coef[:, : sum(dims)].T / scale[:, None]  # (sum dims, 26)
    base = intercept - mean / scale @ coef[:, : sum(dims)].T
    weights, offs = [], []
    at = 0
    for j, d in enumerate(dims):
        weights.append(w_all[at : at + d])
        offs.append(coef[:, sum(dims) + j].copy())
        at += d
    return weights, offs, base


def _bigrams(data: OcrData, words: Sequence[int]) -> tuple[F64, F64, F64, F64]:
    """Log P(b | a), log P(first), log P(last) and log P(label) with add-one smoothing."""
    trans = np.ones((26, 26))
    first = np.ones(26)
    last = np.ones(26)
    prior = np.ones(26)
    for w in words:
        y = data.labels[data.word(w)]
        np.add.at(trans, (y[:-1], y[1:]), 1)
        first[y[0]] += 1
        last[y[-1]] += 1
        np.add.at(prior, y, 1)
    trans = np.log(trans / trans.sum(axis=1, keepdims=True))
    return (
        trans,
        np.log(first / first.sum()),
        np.log(last / last.sum()),
        np.log(prior / prior.sum()),
    )


def _rows(data: OcrData, words: Sequence[int]) -> npt.NDArray[np.int64]:
    return np.concatenate([np.arange(data.offsets[w], data.offsets[w + 1]) for w in words])


def fit_chain(
    data: OcrData,
    features: Sequence[F32],
    words: Sequence[int],
    rng: np.random.Generator,
    *,
    replicas: int = 2,
    max_iter: int = 200,
) -> ChainModel:
    """Fit the predictor on ``words``: emissions on 85 %, α on the other 15 % (letter
    errors in random states); transitions from all of ``words``."""
    arr = np.asarray(words)
    order = rng.permutation(len(arr))
    cut = int(0.85 * len(arr))
    fit_w, val_w = arr[order[:cut]], arr[order[cut:]]
    trans, first, last, log_prior = _bigrams(data, list(arr))
    rows = _rows(data, list(fit_w))
    weights, offs, base = fit_emissions(
        [f[rows] for f in features], data.labels[rows], rng, replicas=replicas, max_iter=max_iter
    )
    probe = ChainModel(weights, offs, base, ChainParams(trans, first, last), 1.0)
    best_alpha, best_err = 1.0, np.inf
    val_states = [
        _random_states(int(data.offsets[w + 1] - data.offsets[w]), len(features), rng)
        for w in val_w
    ]
    for alpha in ALPHAS:
        model = _with_alpha(probe, trans, first, last, log_prior, alpha)
        err = word_errors(model, data, features, list(val_w), val_states)
        if err < best_err:
            best_alpha, best_err = alpha, err
    return _with_alpha(probe, trans, first, last, log_prior, best_alpha)


def _with_alpha(
    model: ChainModel, trans: F64, first: F64, last: F64, log_prior: F64, alpha: float
) -> ChainModel:
    """Chain scores α·(log P(b|a) − log P(b)) etc.: the emission's logits estimate
    log P(y | x), so dividing the prior out turns them into likelihood ratios (HMM-style)."""
    chain = ChainParams(
        transition=alpha * (trans - log_prior[None, :]),
        start=alpha * (first - log_prior),
        end=alpha * (last - log_prior),
    )
    return ChainModel(model.weights, model.offsets_k, model.base, chain, alpha)


def word_problem(
    model: ChainModel,
    data: OcrData,
    features: Sequence[F32],
    words: Sequence[int],
    templates: TemplateSet,
) -> ChainProblem:
    """The policies' view of ``words`` under ``model``."""
    contributions, labels, inputs = [], [], []
    for w in words:
        sl = data.word(w)
        contrib = model.contributions(features, sl)
        contributions.append(contrib)
        labels.append(data.labels[sl])
        inputs.append(policy_inputs(features[0][sl], model.base, contrib[:, 0, :], model.chain))
    return ChainProblem(templates, model.chain, model.base, contributions, labels, inputs)


def policy_inputs(pixels: F32, base: F64, pixel_contribution: F64, chain: ChainParams) -> F32:
    """Per-letter policy inputs from S0 (pixels only): the service's recipe
    ``letters-v1`` (:func:`service.strategies.chain.policy_inputs_v1`), the same code."""
    return policy_inputs_v1(pixels, base[None, :] + pixel_contribution, chain)


def word_errors(
    model: ChainModel,
    data: OcrData,
    features: Sequence[F32],
    words: Sequence[int],
    states: Sequence[npt.NDArray[np.bool_]],
) -> float:
    """Letter error rate of the chain on ``words`` in ``states``."""
    contrib, mask = pad([model.contributions(features, data.word(w)) for w in words])
    st, _ = pad([s.astype(np.float64) for s in states], width=contrib.shape[1])
    pred = viterbi(emissions(model.base, contrib, st > 0.5), mask, model.chain)
    truth, _ = pad([data.labels[data.word(w)].astype(np.float64) for w in words])
    wrong = ((pred != truth.astype(np.int64)) & mask).sum()
    return float(wrong / mask.sum())


def cross_fit(
    data: OcrData,
    features: Sequence[F32],
    words: Sequence[int],
    templates: TemplateSet,
    rng: np.random.Generator,
    *,
    folds: int = 3,
    replicas: int = 2,
    max_iter: int = 200,
) -> ChainProblem:
    """The policies' training problem: each word scored by a chain fitted on the other
    ``folds - 1`` folds of ``words``."""
    arr = np.asarray(words)
    assignment = rng.permutation(len(arr)) % folds
    parts: list[ChainProblem] = []
    order: list[int] = []
    for f in range(folds):
        held = arr[assignment == f]
        model = fit_chain(
            data, features, list(arr[assignment != f]), rng, replicas=replicas, max_iter=max_iter
        )
        parts.append(word_problem(model, data, features, list(held), templates))
        order.extend(int(w) for w in held)
    # one problem whose chain parameters differ per fold: keep per-example chains by merging
    # folds into one problem only when they share the chain; otherwise losses use each
    # fold's own chain (FoldedProblem)
    return FoldedProblem.of(parts, order)


class FoldedProblem(ChainProblem):
    """Several :class:`ChainProblem` (one per cross-fitting fold, each with its own chain)
    seen as one: examples are numbered fold after fold; ``words`` maps them to word ids."""

    folds: list[ChainProblem]
    fold_of: npt.NDArray[np.int64]
    local: npt.NDArray[np.int64]
    words: list[int]

    @classmethod
    def of(cls, parts: list[ChainProblem], words: list[int]) -> FoldedProblem:
        first = parts[0]
        obj = cls(
            first.template_set,
            first.chain,
            first.base,
            [c for p in parts for c in p.contributions],
            [y for p in parts for y in p.labels],
            [x for p in parts for x in p.inputs],
        )
        obj.folds = parts
        obj.fold_of = np.concatenate([np.full(p.n_examples, j) for j, p in enumerate(parts)])
        obj.local = np.concatenate([np.arange(p.n_examples) for p in parts])
        obj.words = words
        return obj

    def _split(self, indices: Sequence[int]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for pos, i in enumerate(indices):
            groups.setdefault(int(self.fold_of[i]), []).append(pos)
        return groups

    def losses(
        self, indices: Sequence[int], states: Sequence[npt.NDArray[np.bool_]], *, soft: bool = True
    ) -> F64:
        out = np.zeros(len(indices))
        for f, positions in self._split(indices).items():
            local = [int(self.local[indices[p]]) for p in positions]
            out[positions] = self.folds[f].losses(local, [states[p] for p in positions], soft=soft)
        return out

    def confidence(self, indices: Sequence[int], states: Sequence[npt.NDArray[np.bool_]]) -> F64:
        out = np.zeros(len(indices))
        for f, positions in self._split(indices).items():
            local = [int(self.local[indices[p]]) for p in positions]
            out[positions] = self.folds[f].confidence(local, [states[p] for p in positions])
        return out


def ocr_templates(pixels_cost: float, hog_cost: float) -> TemplateSet:
    return TemplateSet.of(
        [Template("pixels", pixels_cost, base=True), Template("hog", hog_cost, base=False)]
    )
