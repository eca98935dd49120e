"""The parser builder on a second data layout: any CoNLL-U files, plain text under names of
the user's choosing (here EWT sentences written out that way), not only the
``en_ewt-ud-*.conllu.gz`` names of the shared folder."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from training.parsing.data import read_conllu, read_split

EWT = Path(__file__).resolve().parents[3].parent / "shared" / "datasets" / "ud-english-ewt"

pytestmark = pytest.mark.skipif(
    not EWT.is_dir(),
    reason="the shared EWT treebank is not beside this checkout "
    "(../shared/datasets/ud-english-ewt)",
)


def _first_sentences(split: str, count: int) -> str:
    text = gzip.decompress((EWT / f"en_ewt-ud-{split}.conllu.gz").read_bytes()).decode()
    blocks = [b for b in text.split("\n\n") if b.strip()]
    return "\n\n".join(blocks[:count]) + "\n\n"


def test_any_conllu_file_reads_like_the_ewt_split(tmp_path: Path) -> None:
    plain = tmp_path / "my treebank.txt"
    plain.write_text(_first_sentences("dev", 50))
    mine = read_conllu(plain)
    ewt = read_split("dev", EWT, limit=len(mine))
    assert len(mine) == 50
    assert [s.forms for s in mine.sentences] == [s.forms for s in ewt.sentences]
    assert all(np.array_equal(a, b) for a, b in zip(mine.heads, ewt.heads, strict=True))


def test_a_tag_outside_upos_names_the_file_and_sentence(tmp_path: Path) -> None:
    bad = tmp_path / "ptb-tags.conllu"
    bad.write_text(
        "1\tDogs\tdog\tNNS\t_\t_\t2\tnsubj\t_\t_\n2\tbark\tbark\tVBP\t_\t_\t0\troot\t_\t_\n\n"
    )
    with pytest.raises(ValueError, match=r"ptb-tags\.conllu: sentence 1: unknown UPOS tags"):
        read_conllu(bad)


@pytest.mark.slow
def test_the_parser_builder_runs_on_plain_conllu_files(tmp_path: Path) -> None:
    from service.execution import execute
    from service.registry import load_bundle
    from training.parsing.bundle import ParserBuildConfig, build_parser_bundle

    train, dev = tmp_path / "train-part.conllu", tmp_path / "held-out.conllu"
    train.write_text(_first_sentences("train", 300))
    dev.write_text(_first_sentences("dev", 120))
    out = tmp_path / "models" / "my-parser"
    config = ParserBuildConfig(
        name="my-parser",
        data_dir=tmp_path / "nowhere",  # never read: the files are given
        train_file=train,
        dev_file=dev,
        epochs=1,
        max_tokens=40,
        buckets=1 << 16,
        policy_sentences=60,
        anytime_steps=2,
        length_filter=True,
    )
    evaluation = build_parser_bundle(out, config, log=lambda _: None)
    assert evaluation["dev_policy_sentences"] == 60
    bundle = load_bundle(out, 1 << 20)
    assert "train-part.conllu" in bundle.manifest.provenance.data_fingerprint
    sentence = read_conllu(dev, max_tokens=40).sentences[-1]
    tokens = [{"form": f, "upos": u} for f, u in zip(sentence.forms, sentence.upos, strict=True)]
    result = execute(bundle, bundle.decoder.decode({"tokens": tokens}), 1e6, {}, 0.0)
    assert result.report is not None and len(result.report["heads"]) == len(sentence)
