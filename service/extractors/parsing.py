"""Dependency-parsing feature templates (paper 004, Section 4) as extractor plugins.

Why the module stays whole (over 450 lines): the plugins, the templates they compute, the
length filter and the policies' inputs all read the same :class:`Sentence` and edge
quantities, and training imports them together.

A sentence (:class:`Sentence`: word forms and universal POS tags, token 0 being the
artificial root) is parsed by a first-order, arc-factored model: the score of the edge
head → dependent is ``w · ψ(head, dependent)``, with the template ψ chosen per *head word*
(every edge a word heads shares its template), as in the paper:

* ψ^POS (:func:`pos_features`): the POS tags of the head, the dependent and their
  neighbours, the direction and distance of the edge, and counts of verbs, punctuation and
  conjunctions between them (McDonald et al. 2005's first-order POS features, with counts
  in place of every in-between tag);
* ψ^Full = ψ^POS + ψ^Lex (:func:`lex_features`): the lower-cased word forms of the head,
  the dependent and their neighbours, alone and conjoined with the tags.

Features are hashed into a fixed number of buckets (``buckets``, a power of two;
``service.extractors.hashed``), so a model is one fixed-size weight array; a template
returns the bucket ids of every edge a head heads. Training (``training/parsing``) and the
service compute them with these same functions.

The plugins :class:`ParsePOS` and :class:`ParseLex` compute one template for one head word
(``params: {"word": i, ...}``): the bundle declares one extractor per (template, word
position), so the serving loop acquires — and charges the measured time of — exactly the
(word, template) pairs the policy chose, the paper's state S ∈ {0,1}^{K × |C|}.
Their vector holds, for dependent j = 0 … max_tokens, the ``features`` bucket ids of the
edge word → j as float32 (exact below 2^24), -1 for padding.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from service.extractors.base import FloatVector
from service.extractors.hashed import Templates

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

#: The 17 universal POS tags (UD v2); an item's ``upos`` must be one of them.
UPOS: tuple[str, ...] = (
    "ADJ",
    "ADP",
    "ADV",
    "AUX",
    "CCONJ",
    "DET",
    "INTJ",
    "NOUN",
    "NUM",
    "PART",
    "PRON",
    "PROPN",
    "PUNCT",
    "SCONJ",
    "SYM",
    "VERB",
    "X",
)
UPOS_ID = {tag: i for i, tag in enumerate(UPOS)}
ROOT_TAG = len(UPOS)  # the artificial root's tag
EDGE_TAG = len(UPOS) + 1  # before the first / after the last token
N_TAGS = len(UPOS) + 2

#: Hash buckets of a model (2^20 weights); ids stay exact as float32 (< 2^24).
DEFAULT_BUCKETS = 1 << 20
MAX_BUCKETS = 1 << 24

_VERBS = (UPOS_ID["VERB"], UPOS_ID["AUX"])
_PUNCT = (UPOS_ID["PUNCT"],)
_CONJ = (UPOS_ID["CCONJ"], UPOS_ID["SCONJ"])
_ROOT_FORM = 0x7F4A7C15
_EDGE_FORM = 0x2545F491


def form_id(form: str) -> int:
    """A stable 32-bit id of a word form (lower-cased; CRC-32, the same in every process)."""
    return zlib.crc32(form.lower().encode("utf-8"))


@dataclass
class Sentence:
    """A tokenised sentence: ``forms`` and ``upos`` of tokens 1 … n (token 0 is the root).

    Tag ids are computed at once; the form ids lazily, by the first lexical template that
    needs them (so their cost is charged to ψ^Lex, not to decoding)."""

    forms: Sequence[str]
    upos: Sequence[str]
    tags: IntArray = field(init=False, repr=False)
    _form_ids: IntArray | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.forms) != len(self.upos):
            raise ValueError(f"{len(self.forms)} forms but {len(self.upos)} tags")
        unknown = sorted({t for t in self.upos if t not in UPOS_ID})
        if unknown:
            raise ValueError(f"unknown UPOS tags {unknown}; expected one of {list(UPOS)}")
        # Padded: tags[0] = edge, tags[1] = root, tags[k + 1] = token k, tags[n + 2] = edge.
        self.tags = np.asarray(
            [EDGE_TAG, ROOT_TAG, *(UPOS_ID[t] for t in self.upos), EDGE_TAG], dtype=np.int64
        )

    def __len__(self) -> int:
        return len(self.forms)

    @property
    def form_ids(self) -> IntArray:
        """Form ids, padded like ``tags``."""
        if self._form_ids is None:
            self._form_ids = np.asarray(
                [_EDGE_FORM, _ROOT_FORM, *(form_id(f) for f in self.forms), _EDGE_FORM],
                dtype=np.int64,
            )
        return self._form_ids

    @property
    def nbytes(self) -> int:
        return int(self.tags.nbytes) + sum(len(f) for f in self.forms)


class _Edges:
    """Per-edge quantities for heads ``hh`` (column) × dependents ``dd`` (row): ``tags``,
    the templates' non-lexical parts by name (``hp``: the head's tag, ``dp``: the
    dependent's, ``_l`` / ``_r`` their neighbours'; ``right``: the edge's direction; ``db``:
    direction and distance bucket)."""

    def __init__(self, sentence: Sentence, heads: IntArray, deps: IntArray) -> None:
        self.hh = hh = heads.reshape(-1, 1)
        self.dd = dd = deps.reshape(1, -1)
        self.shape = (hh.shape[0], dd.shape[1])
        tags = sentence.tags
        dist = np.abs(dd - hh)
        bucket = np.where(dist <= 5, dist, np.where(dist <= 10, 6, 7))
        right = (dd > hh).astype(np.int64)
        self.tags: dict[str, IntArray] = {
            "hp_l": tags[hh], "hp": tags[hh + 1], "hp_r": tags[hh + 2],
            "dp_l": tags[dd], "dp": tags[dd + 1], "dp_r": tags[dd + 2],
            "right": right, "db": right * 8 + bucket,
        }  # fmt: skip


#: Which tags each in-between count counts (verbs, punctuation, conjunctions).
_BETWEEN = np.zeros((3, N_TAGS), dtype=np.int64)
for _row, _group in enumerate((_VERBS, _PUNCT, _CONJ)):
    _BETWEEN[_row, list(_group)] = 1


def _between_counts(sentence: Sentence, edges: _Edges) -> IntArray:
    """How many tokens strictly between head and dependent are verbs, punctuation and
    conjunctions, each capped at 3: shape (3, heads, dependents)."""
    hit = _BETWEEN[:, sentence.tags[1:-1]]  # tokens 0 … n
    cum = np.zeros((3, hit.shape[1] + 1), dtype=np.int64)
    np.cumsum(hit, axis=1, out=cum[:, 1:])  # cum[:, k] = hits among tokens < k
    lo = np.minimum(edges.hh, edges.dd)
    hi = np.maximum(edges.hh, edges.dd)
    count: IntArray = cum[:, hi] - cum[:, lo + 1]
    return np.clip(count, 0, 3)


#: ψ^POS: McDonald et al. 2005's first-order POS templates (codes 1-20; the parts are
#: :class:`_Edges`' fields and the in-between counts).
_POS = Templates(
    [
        (1, ["db"]),
        (2, ["hp", "db"]),
        (3, ["dp", "db"]),
        (4, ["hp", "dp"]),
        (5, ["hp", "dp", "db"]),
        (6, ["hp"]),
        (7, ["dp"]),
        (8, ["hp", "hp_r", "dp_l", "dp", "right"]),
        (9, ["hp_l", "hp", "dp_l", "dp", "right"]),
        (10, ["hp", "hp_r", "dp", "dp_r", "right"]),
        (11, ["hp_l", "hp", "dp", "dp_r", "right"]),
        (12, ["hp", "hp_r", "dp", "db"]),
        (13, ["hp_l", "hp", "dp", "db"]),
        (14, ["hp", "dp_l", "dp", "db"]),
        (15, ["hp", "dp", "dp_r", "db"]),
        (16, ["hp", "dp", "verbs", "right"]),
        (17, ["hp", "dp", "punct", "right"]),
        (18, ["hp", "dp", "conj", "right"]),
        (19, ["hp", "dp", "verbs", "punct", "db"]),
        (20, ["hp_l", "hp", "hp_r", "dp_l", "dp", "dp_r"]),
    ]
)
#: ψ^Lex: the word forms (``hw``: the head's, ``dw``: the dependent's, ``_l`` / ``_r`` their
#: neighbours'), alone and conjoined with the tags (codes 101-116).
_LEX = Templates(
    [
        (101, ["hw"]),
        (102, ["dw"]),
        (103, ["hw", "hp"]),
        (104, ["dw", "dp"]),
        (105, ["hw", "dw"]),
        (106, ["hw", "dp", "db"]),
        (107, ["hp", "dw", "db"]),
        (108, ["hw", "hp", "dp"]),
        (109, ["hp", "dw", "dp"]),
        (110, ["hw", "hp", "dw", "dp"]),
        (111, ["hw", "dw", "right"]),
        (112, ["hw_l", "hp", "dp", "right"]),
        (113, ["hw_r", "hp", "dp", "right"]),
        (114, ["dw_l", "hp", "dp", "right"]),
        (115, ["dw_r", "hp", "dp", "right"]),
        (116, ["hw", "dw_l", "dw_r", "dp"]),
    ]
)
POS_FEATURES = len(_POS.init)
LEX_FEATURES = len(_LEX.init)


def pos_features(
    sentence: Sentence, heads: IntArray, deps: IntArray, buckets: int = DEFAULT_BUCKETS
) -> IntArray:
    """ψ^POS bucket ids, shape (len(heads), len(deps), POS_FEATURES)."""
    e = _Edges(sentence, heads, deps)
    verbs, punct, conj = _between_counts(sentence, e)
    values = {**e.tags, "verbs": verbs, "punct": punct, "conj": conj}
    return _POS(values, e.shape, buckets - 1)


def lex_features(
    sentence: Sentence, heads: IntArray, deps: IntArray, buckets: int = DEFAULT_BUCKETS
) -> IntArray:
    """ψ^Lex bucket ids (ψ^Full = ψ^POS + ψ^Lex), shape (len(heads), len(deps), LEX_FEATURES)."""
    e = _Edges(sentence, heads, deps)
    forms = sentence.form_ids
    values = {
        **e.tags,
        "hw": forms[e.hh + 1],
        "hw_l": forms[e.hh],
        "hw_r": forms[e.hh + 2],
        "dw": forms[e.dd + 1],
        "dw_l": forms[e.dd],
        "dw_r": forms[e.dd + 2],
    }
    return _LEX(values, e.shape, buckets - 1)


@dataclass(frozen=True)
class LengthFilter:
    """The length dictionary of He et al. (2013) and Rush & Petrov (2012), the paper's
    references [7, 13]: ``table[h, d, right]`` is the longest arc training saw from a head
    of tag h to a dependent of tag d in that direction (``right``: the dependent follows
    its head); a longer arc is never scored, and a word that can head no arc of its
    sentence gets no template at all. The root's arcs are always kept, so every sentence
    keeps a tree of kept arcs (every token can hang from the root)."""

    table: IntArray  # (N_TAGS, N_TAGS, 2)

    SIZE: ClassVar[int] = N_TAGS * N_TAGS * 2

    @classmethod
    def of(cls, flat: Sequence[int]) -> LengthFilter:
        """From the flat list of a manifest's extractor params (row-major h, d, right)."""
        if len(flat) != cls.SIZE or any(not isinstance(v, int) or v < 0 for v in flat):
            raise ValueError(
                f"length_filter must be {cls.SIZE} non-negative ints (heads x dependents x "
                f"direction over {N_TAGS} tags), got {len(flat)} values"
            )
        return cls(np.asarray(flat, dtype=np.int64).reshape(N_TAGS, N_TAGS, 2))

    @classmethod
    def learn(cls, sentences: Sequence[Sentence], heads: Sequence[IntArray]) -> LengthFilter:
        """The longest gold arc of each (head tag, dependent tag, direction)."""
        table = np.zeros((N_TAGS, N_TAGS, 2), dtype=np.int64)
        for sentence, gold in zip(sentences, heads, strict=True):
            deps = np.arange(1, len(sentence) + 1)
            h = gold[1:]
            tags = sentence.tags
            np.maximum.at(
                table,
                (tags[h + 1], tags[deps + 1], (deps > h).astype(np.int64)),
                np.abs(deps - h),
            )
        return cls(table)

    def flat(self) -> list[int]:
        out: list[int] = self.table.reshape(-1).tolist()
        return out

    def kept(self, sentence: Sentence, head: int, deps: IntArray) -> BoolArray:
        """Which arcs head → deps the filter keeps (never a word's arc to itself)."""
        if head == 0:
            return np.ones(len(deps), dtype=bool)
        tags = sentence.tags
        distance = np.abs(deps - head)
        limit = self.table[tags[head + 1], tags[deps + 1], (deps > head).astype(np.int64)]
        out: BoolArray = (distance <= limit) & (distance > 0)
        return out

    def heads(self, sentence: Sentence) -> BoolArray:
        """Which of heads 0 … n keep at least one arc (the others need no template)."""
        n = len(sentence)
        deps = np.arange(1, n + 1)
        tags = sentence.tags
        h = np.arange(1, n + 1)[:, None]
        distance = np.abs(deps[None, :] - h)
        limit = self.table[tags[h + 1], tags[deps + 1][None, :], (deps[None, :] > h).astype(int)]
        out = np.ones(n + 1, dtype=bool)
        out[1:] = ((distance <= limit) & (distance > 0)).any(axis=1)
        return out


class _Template:
    """One template for one head word; see the module docstring. With ``length_filter``
    (a :class:`LengthFilter`'s flat table), the arcs it prunes are not computed: their
    rows stay -1, which the parser scores as an arc that does not exist."""

    name: ClassVar[str]
    version: ClassVar[str] = "1"
    item_kind: ClassVar[str] = "tokens"
    width: ClassVar[int]

    def __init__(
        self,
        *,
        word: int,
        max_tokens: int,
        buckets: int = DEFAULT_BUCKETS,
        length_filter: Sequence[int] | None = None,
    ) -> None:
        if not 0 < max_tokens <= 4096:
            raise ValueError(f"max_tokens must be in 1 … 4096, got {max_tokens}")
        if not 0 <= word <= max_tokens:
            raise ValueError(f"word must be in 0 … max_tokens ({max_tokens}), got {word}")
        if buckets < 2 or buckets > MAX_BUCKETS or buckets & (buckets - 1):
            raise ValueError(f"buckets must be a power of two in 2 … 2^24, got {buckets}")
        self.word = word
        self.max_tokens = max_tokens
        self.buckets = buckets
        self.filter = None if length_filter is None else LengthFilter.of(length_filter)

    @property
    def dims(self) -> int:
        return (self.max_tokens + 1) * self.width

    def ids(self, sentence: Sentence, deps: IntArray) -> IntArray:
        """Bucket ids (len(deps), width) of the arcs self.word → deps."""
        raise NotImplementedError

    def extract(self, item: Any) -> FloatVector:
        if not isinstance(item, Sentence):
            raise TypeError(f"a parsing template reads a Sentence, got {type(item).__name__}")
        n = len(item)
        if n > self.max_tokens:
            raise ValueError(
                f"the sentence has {n} tokens, more than max_tokens ({self.max_tokens})"
            )
        out = np.full((self.max_tokens + 1, self.width), -1.0, dtype=np.float32)
        if self.word <= n:
            deps = np.arange(1, n + 1)
            if self.filter is not None:
                deps = deps[self.filter.kept(item, self.word, deps)]
            if len(deps):
                out[deps] = self.ids(item, deps)
        return out.reshape(-1)


class ParsePOS(_Template):
    """ψ^POS of the edges one word heads."""

    name: ClassVar[str] = "parse_pos"
    width: ClassVar[int] = POS_FEATURES

    def ids(self, sentence: Sentence, deps: IntArray) -> IntArray:
        out: IntArray = pos_features(sentence, np.asarray([self.word]), deps, self.buckets)[0]
        return out


class ParseLex(_Template):
    """ψ^Lex of the edges one word heads (ψ^Full = ψ^POS + this)."""

    name: ClassVar[str] = "parse_lex"
    width: ClassVar[int] = LEX_FEATURES

    def ids(self, sentence: Sentence, deps: IntArray) -> IntArray:
        out: IntArray = lex_features(sentence, np.asarray([self.word]), deps, self.buckets)[0]
        return out


#: Per-word inputs of the template-assignment policies (see :func:`policy_features`).
POLICY_FEATURES = len(UPOS) + 2 * N_TAGS + 6


def policy_features(sentence: Sentence) -> npt.NDArray[np.float64]:
    """The cheap per-word features a policy decides from, shape (n, POLICY_FEATURES): the
    word's tag, its neighbours' tags (root / sentence edge included), its relative
    position, the sentence's length, and the share of verbs and the distance to the nearest
    verb — POS and positions only, nothing lexical."""
    n = len(sentence)
    tags = sentence.tags
    x = np.zeros((n, POLICY_FEATURES))
    rows = np.arange(n)
    x[rows, tags[2 : n + 2]] = 1.0
    x[rows, len(UPOS) + tags[1 : n + 1]] = 1.0
    x[rows, len(UPOS) + N_TAGS + tags[3 : n + 3]] = 1.0
    base = len(UPOS) + 2 * N_TAGS
    position = np.arange(1, n + 1)
    verbs = np.flatnonzero(np.isin(tags[2 : n + 2], _VERBS)) + 1
    if len(verbs):
        nearest = np.abs(position[:, None] - verbs[None, :]).min(axis=1)
    else:
        nearest = np.full(n, 10)
    x[:, base] = position / n
    x[:, base + 1] = min(n, 60) / 60.0
    x[:, base + 2] = 1.0 / n
    x[:, base + 3] = len(verbs) / n
    x[:, base + 4] = np.minimum(nearest, 10) / 10.0
    x[:, base + 5] = (nearest == 0).astype(np.float64)
    return x


class ParseWords:
    """The policies' per-word features of a whole sentence (:func:`policy_features`),
    padded to ``max_tokens`` rows."""

    name: ClassVar[str] = "parse_words"
    version: ClassVar[str] = "1"
    item_kind: ClassVar[str] = "tokens"

    def __init__(self, *, max_tokens: int) -> None:
        if not 0 < max_tokens <= 4096:
            raise ValueError(f"max_tokens must be in 1 … 4096, got {max_tokens}")
        self.max_tokens = max_tokens

    @property
    def dims(self) -> int:
        return self.max_tokens * POLICY_FEATURES

    def extract(self, item: Any) -> FloatVector:
        if not isinstance(item, Sentence):
            raise TypeError(f"a parsing template reads a Sentence, got {type(item).__name__}")
        n = len(item)
        if n > self.max_tokens:
            raise ValueError(
                f"the sentence has {n} tokens, more than max_tokens ({self.max_tokens})"
            )
        out = np.zeros((self.max_tokens, POLICY_FEATURES), dtype=np.float32)
        out[:n] = policy_features(item)
        return out.reshape(-1)
