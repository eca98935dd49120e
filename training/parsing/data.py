"""The Universal Dependencies English Web Treebank, read with ``conllu``.

Only basic tokens are kept (multi-word token ranges such as ``1-2`` and empty nodes such as
``8.1`` are dropped); ``upos`` are the treebank's gold tags, the parser's input, as in the
paper (which parses gold-tagged PTB)."""

from __future__ import annotations

import gzip
import hashlib
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


def read_split(
    split: str,
    data_dir: Path = DEFAULT_DIR,
    max_tokens: int | None = None,
    limit: int | None = None,
) -> Treebank:
    """One split (``train``, ``dev`` or ``test``); sentences longer than ``max_tokens`` are
    dropped when it is given (the count dropped is in the fingerprint); with ``limit``,
    only the first ``limit`` sentences kept are read."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = data_dir / f"en_ewt-ud-{split}.conllu.gz"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: pass --data-dir pointing at the ud-english-ewt folder"
        )
    raw = path.read_bytes()
    sentences: list[Sentence] = []
    heads: list[npt.NDArray[np.int64]] = []
    dropped = 0
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for tokenlist in conllu.parse_incr(handle):
            if limit is not None and len(sentences) >= limit:
                break
            tokens = [t for t in tokenlist if isinstance(t["id"], int)]
            if not tokens:
                continue
            if max_tokens is not None and len(tokens) > max_tokens:
                dropped += 1
                continue
            sentences.append(Sentence([t["form"] for t in tokens], [t["upos"] for t in tokens]))
            heads.append(np.asarray([-1, *(int(t["head"]) for t in tokens)], dtype=np.int64))
    digest = hashlib.sha256(raw).hexdigest()[:16]
    limited = "" if limit is None else f":first={len(sentences)}"
    return Treebank(sentences, heads, f"ewt-{split}:{digest}:dropped={dropped}{limited}")


def uas(predicted: list[npt.NDArray[np.int64]], gold: list[npt.NDArray[np.int64]]) -> float:
    """Unlabelled attachment score over every token (punctuation included)."""
    right = sum(int((p[1:] == g[1:]).sum()) for p, g in zip(predicted, gold, strict=True))
    total = sum(len(g) - 1 for g in gold)
    return right / total if total else 0.0
