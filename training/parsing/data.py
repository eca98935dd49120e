"""The Universal Dependencies English Web Treebank, read with ``conllu``.

Only basic tokens are kept (multi-word token ranges such as ``1-2`` and empty nodes such as
``8.1`` are dropped); ``upos`` are the treebank's gold tags, the parser's input, as in the
paper (which parses gold-tagged PTB)."""

from __future__ import annotations

import gzip
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import conllu
import numpy as np
import numpy.typing as npt

from service.extractors.parsing import Sentence

DEFAULT_DIR = Path("../shared/datasets/ud-english-ewt")
SPLITS = ("train", "dev", "test")


@dataclass
class Treebank:
    """Sentences and their gold heads (``heads[i][0] = -1``; token k's head at ``[k]``)."""

    sentences: list[Sentence]
    heads: list[npt.NDArray[np.int64]]
    fingerprint: str

    def __len__(self) -> int:
        return len(self.sentences)

    def subset(self, indices: list[int] | npt.NDArray[np.int64]) -> Treebank:
        return Treebank(
            [self.sentences[i] for i in indices],
            [self.heads[i] for i in indices],
            f"{self.fingerprint}[{len(indices)}]",
        )


def split_path(split: str, data_dir: Path = DEFAULT_DIR) -> Path:
    """The EWT file of ``split`` in ``data_dir`` (``en_ewt-ud-{split}.conllu.gz``)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return data_dir / f"en_ewt-ud-{split}.conllu.gz"


def read_split(
    split: str,
    data_dir: Path = DEFAULT_DIR,
    *,
    max_tokens: int | None = None,
    limit: int | None = None,
) -> Treebank:
    """One EWT split (``en_ewt-ud-{split}.conllu.gz`` in ``data_dir``); see :func:`read_conllu`."""
    return read_conllu(split_path(split, data_dir), max_tokens=max_tokens, limit=limit)


def read_conllu(path: Path, *, max_tokens: int | None = None, limit: int | None = None) -> Treebank:
    """Any CoNLL-U treebank file, plain or gzip-compressed (by its first bytes, whatever its
    name). Sentences longer than ``max_tokens`` are dropped (the count dropped is in the
    fingerprint); with ``limit``, only the first ``limit`` sentences kept are read. Every
    basic token needs a universal POS tag (UPOS, column 4) and a head (column 7)."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: pass a CoNLL-U file (plain or .gz), or --data-dir pointing at "
            "the ud-english-ewt folder"
        )
    raw = path.read_bytes()
    text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    sentences: list[Sentence] = []
    heads: list[npt.NDArray[np.int64]] = []
    dropped = 0
    for number, tokenlist in enumerate(conllu.parse_incr(io.StringIO(text.decode("utf-8")))):
        if limit is not None and len(sentences) >= limit:
            break
        tokens = [t for t in tokenlist if isinstance(t["id"], int)]
        if not tokens:
            continue
        if max_tokens is not None and len(tokens) > max_tokens:
            dropped += 1
            continue
        missing = [t["id"] for t in tokens if t["upos"] in (None, "_") or t["head"] is None]
        if missing:
            raise ValueError(
                f"{path}: sentence {number + 1} has tokens {missing[:5]} without a UPOS tag "
                "or a head; every basic token needs both (columns 4 and 7 of CoNLL-U)"
            )
        try:
            sentence = Sentence([t["form"] for t in tokens], [t["upos"] for t in tokens])
        except ValueError as exc:
            raise ValueError(f"{path}: sentence {number + 1}: {exc}") from None
        sentences.append(sentence)
        heads.append(np.asarray([-1, *(int(t["head"]) for t in tokens)], dtype=np.int64))
    digest = hashlib.sha256(raw).hexdigest()[:16]
    limited = "" if limit is None else f":first={len(sentences)}"
    return Treebank(sentences, heads, f"{path.name}:{digest}:dropped={dropped}{limited}")


def uas(predicted: list[npt.NDArray[np.int64]], gold: list[npt.NDArray[np.int64]]) -> float:
    """Unlabelled attachment score over every token (punctuation included)."""
    right = sum(int((p[1:] == g[1:]).sum()) for p, g in zip(predicted, gold, strict=True))
    total = sum(len(g) - 1 for g in gold)
    return right / total if total else 0.0
