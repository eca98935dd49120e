"""Benchmark of dependency parsing under a time budget (paper 004, Fig. 4) on EWT test.

Every policy of the parser bundle (``budgetserve-train parser``) parses the EWT test
sentences through the serving loop (``service.execution.execute``, the code the HTTP API
runs; I/O — reading and decoding the request — excluded, calibration off), one operating
point at a time; the time of a sentence is the loop's measured spent time (policy,
templates, scoring, Chu–Liu–Edmonds), in ms of wall time: what the service charges. Two
bundles with the same parser weights run side by side, interleaved sentence by sentence:
without and with the length-dictionary filter. The anytime policy runs at per-sentence
budgets ``base(n) + f · n · c_lex(n)`` from the bundle's own cost curves, and every served
request's overrun is checked against the session's bound (the misprediction of its last
acquisition and of the decode). What a user would run instead: the parser with one fixed
template for every word (all ψ^POS, all ψ^Full) without the filter, in the same run. Rows
marked ``+tagger`` send the tokens without tags, as a user with raw text would: the bundle's
tagger tags them while decoding, and that time is counted; ``[parser on predicted tags]``
rows use the parser trained on predicted tags (``--predicted-bundle``, built first with
``--predicted-tags``).

``python -m benchmarks.parsing [--bundle models/ewt-parser] [--limit N]`` writes
``docs/benchmarks/parsing.md`` and ``docs/benchmarks/parsing.png`` (the whole EWT test set
by default).

The module stays whole (over 450 lines): building the two bundles, the interleaved timing of
every point and the report's goals are one experiment; the method lives in training/parsing/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import OUT, machine, prose
from service.bundle import ParserPoint, ParserStrategy
from service.errors import InvalidItem
from service.execution import execute
from service.extractors.parsing import Sentence
from service.registry import Bundle, CalibrationSettings, load_bundle
from service.strategies.base import StrategyRuntime, strategy_for

BUNDLE = Path("models/ewt-parser")
FILTERED = Path("models/ewt-parser-filtered")
PREDICTED = Path("models/ewt-parser-predicted")  # the parser trained on jackknifed tags
EWT = Path("../shared/datasets/ud-english-ewt")
ANYTIME_FRACTIONS = (0.25, 1.0, 1.5)
FILTER = " +filter"
TAGGED = " +tagger"  # predicted tags: tokens sent without upos, tagged by the bundle
RETRAINED = " [parser on predicted tags]"  # rows of the PREDICTED bundle
MAX_DEPTH = 7


@dataclass
class Run:
    policy: str
    point: str
    ms: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    right: int = 0
    words: int = 0
    full: int = 0
    over: int = 0
    beyond_bound: int = 0
    overrun_ms: list[float] = field(default_factory=list)
    tag_ms: list[float] = field(default_factory=list)  # TAGGED rows: tagging (in ``ms``)
    depth_full: list[int] = field(default_factory=list)
    depth_pos: list[int] = field(default_factory=list)
    dev_uas: float | None = None
    dev_share: float | None = None

    @property
    def uas(self) -> float:
        return self.right / max(self.words, 1)

    @property
    def mean_ms(self) -> float:
        return float(np.mean(self.ms)) if self.ms else 0.0

    @property
    def cpu_ms(self) -> float:
        return float(np.mean(self.cpu)) if self.cpu else 0.0

    @property
    def share(self) -> float:
        return self.full / max(self.words, 1)


def depths(heads: Sequence[int]) -> list[int]:
    """Depth of each token in a tree (the root's dependent: 0)."""
    out = []
    for d in range(1, len(heads) + 1):
        k, v = 0, heads[d - 1]
        while v != 0 and k < len(heads):
            v = heads[v - 1]
            k += 1
        out.append(k)
    return out


def items(
    test: Any, limit: int | None, bundle: Bundle
) -> tuple[list[tuple[dict[str, Any], np.ndarray]], list[str]]:
    """The test sentences as request items, and why the service refuses those it refuses
    (e.g. a token longer than the tokens item allows): those are left out of every row."""
    picked = range(len(test)) if limit is None else range(min(limit, len(test)))
    out = []
    refused = []
    for i in picked:
        s = test.sentences[i]
        tokens = [{"form": f, "upos": u} for f, u in zip(s.forms, s.upos, strict=True)]
        try:
            bundle.decoder.decode({"tokens": tokens})
        except InvalidItem as exc:
            refused.append(f"sentence {i + 1}: {exc}")
            continue
        out.append(({"tokens": tokens}, test.heads[i]))
    return out, refused


def parse_one(
    bundle: Bundle,
    runtime: StrategyRuntime,
    item: dict[str, Any],
    gold: np.ndarray,
    run: Run,
    budget: float = 10_000.0,
    *,
    tagged: bool = False,
) -> float:
    """Parse one sentence into ``run``'s tallies; returns the measured (wall) spent ms. An
    overrun (spent > budget) is checked against the session's bound: the misprediction of
    its last acquisition plus that of its decode (measured less predicted, each ≥ 0).
    ``tagged``: the item's tokens have no tags and decoding tags them (the bundle's tagger):
    that decode is timed and counted with the parse, in wall and CPU time."""
    c0, t0 = time.thread_time(), time.perf_counter()
    decoded = bundle.decoder.decode(item)  # not timed unless it tags: I/O
    tag_ms, tag_cpu = (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3
    if tagged:
        run.tag_ms.append(tag_ms)
    else:
        tag_ms = tag_cpu = 0.0
    c0 = time.thread_time()
    result = execute(bundle, decoded, budget, {}, time.perf_counter(), runtime=runtime)
    run.cpu.append((time.thread_time() - c0) * 1000.0 + tag_cpu)
    assert result.report is not None
    heads = result.report["heads"]
    run.ms.append(result.spent + tag_ms)
    if result.spent > budget:
        run.over += 1
        n = len(heads)
        predicted = bundle.costs.at(n)
        last = next(reversed(result.extraction_ms), None)
        slack = 0.0 if last is None else max(0.0, result.extraction_ms[last] - predicted[last])
        decode_pred = runtime.spec.decode_cost(n)  # type: ignore[attr-defined]
        slack += max(0.0, result.report["decode_ms"] - decode_pred)
        run.overrun_ms.append(result.spent - budget)
        run.beyond_bound += int(result.spent - budget > slack)
    run.right += int((np.asarray(heads) == gold[1:]).sum())
    run.words += len(heads)
    templates = [t["template"] for t in result.report["tokens"]]
    run.full += templates.count("full")
    for depth, template in zip(depths(list(gold[1:])), templates, strict=True):
        (run.depth_full if template == "full" else run.depth_pos).append(min(depth, MAX_DEPTH))
    return result.spent


def single(bundle: Bundle, spec: ParserStrategy, point: ParserPoint) -> StrategyRuntime:
    """A runtime serving only ``point`` of ``spec``."""
    one = spec.model_copy(update={"points": [point], "name": f"{spec.name}:{point.id}"})
    runtime: StrategyRuntime = strategy_for("parser")(
        bundle.manifest, one, {}, bundle.costs, bundle.path
    )
    return runtime


def _ensure(
    bundle: Path,
    data_dir: Path,
    *,
    weights: Path | None,
    length_filter: bool,
    tagger_weights: Path | None = None,
    predicted_tags: bool = False,
) -> bool:
    """Build ``bundle`` when missing (like the OCR and CSTC-digits benchmarks, so ``make
    bench`` runs on a fresh checkout); False without the treebank."""
    if (bundle / "manifest.json").is_file():
        return True
    if not data_dir.is_dir():
        print(f"parsing benchmark skipped: no EWT treebank at {data_dir}")
        return False
    from training.parsing.bundle import ParserBuildConfig, build_parser_bundle

    print(f"no parser bundle at {bundle}: building it (budgetserve-train parser)")
    config = ParserBuildConfig(
        name=bundle.name,
        data_dir=data_dir,
        weights=weights,
        length_filter=length_filter,
        tagger_weights=tagger_weights,
        predicted_tags=predicted_tags,
    )
    build_parser_bundle(bundle, config)
    return True


# The points measured (None: every point of the strategy); fewer than the bundle has, so the
# whole test set fits in one run.
KEEP: dict[str, set[str] | None] = {
    "oneshot": {"traj-cw8", "traj-cw16", "traj-cw64"},
    "oneshot-parsimonious": {"pars-cw16"},
    "myopic": {"myopic-q0.75"},
    "uniform-word": {"uniform-word-p0", "uniform-word-p1"},
}
# The parser trained on predicted tags, sent gold tags (the other way round).
KEEP_RETRAINED_GOLD: dict[str, set[str] | None] = {"uniform-word": {"uniform-word-p1"}}
KEEP_FILTERED: dict[str, set[str] | None] = {
    "oneshot": {"traj-cw16", "traj-cw64"},
    "uniform-word": {"uniform-word-p1"},
}
# With predicted tags (the bundle's tagger): the baselines and the points chosen on dev.
KEEP_TAGGED: dict[str, set[str] | None] = {
    "oneshot": {"traj-cw64"},
    "oneshot-parsimonious": {"pars-cw16"},
    "uniform-word": {"uniform-word-p0", "uniform-word-p1"},
}


def _fixed(
    bundle: Bundle, keep: dict[str, set[str] | None], tag: str
) -> list[tuple[Run, StrategyRuntime]]:
    specs = {s.name: s for s in bundle.manifest.strategies if isinstance(s, ParserStrategy)}
    out = []
    for name, wanted in keep.items():
        spec = specs[name]
        for point in spec.points:
            if wanted is None or point.id in wanted:
                # Dev numbers (gold tags, gold-trained parser) only where they are the row's.
                dev = (point.uas, point.full_fraction) if tag in ("", FILTER) else (None, None)
                run = Run(name + tag, point.id, dev_uas=dev[0], dev_share=dev[1])
                out.append((run, single(bundle, spec, point)))
    return out


def anytime_budget(t_pos: float, t_full: float, frac: float) -> float:
    """t_POS + f · (t_Full − t_POS): between this sentence's measured wall times with all
    ψ^POS and all ψ^Full (no filter) in this run, so every budget is one the service could
    meet at the machine's present load."""
    return t_pos + frac * max(t_full - t_pos, 0.0)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bundle", type=Path, default=BUNDLE)
    parser.add_argument("--filtered-bundle", type=Path, default=FILTERED)
    parser.add_argument(
        "--predicted-bundle",
        type=Path,
        default=PREDICTED,
        help="the parser trained on predicted tags: its rows when it exists",
    )
    parser.add_argument(
        "--predicted-tags",
        action="store_true",
        help="build --predicted-bundle when missing (the parser is trained again: 2.5 min here)",
    )
    parser.add_argument("--data-dir", type=Path, default=EWT)
    parser.add_argument("--limit", type=int, default=None, help="first N test sentences")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--calibration",
        dest="calibrate",
        action="store_true",
        help="serve the anytime rows with live calibration (default: the profiled curves)",
    )
    args = parser.parse_args(argv)
    from training.parsing.data import read_split

    if not _ensure(args.bundle, args.data_dir, weights=None, length_filter=False):
        return
    # The other bundles reuse the first's tagger (an older bundle without one: they train it).
    tagger = args.bundle / "tagger.npy" if (args.bundle / "tagger.npy").is_file() else None
    _ensure(
        args.filtered_bundle,
        args.data_dir,
        weights=args.bundle / "weights.npy",
        length_filter=True,
        tagger_weights=tagger,
    )
    if args.predicted_tags:
        _ensure(
            args.predicted_bundle,
            args.data_dir,
            weights=None,
            length_filter=False,
            tagger_weights=tagger,
            predicted_tags=True,
        )
    t_start = time.perf_counter()
    bundle = load_bundle(args.bundle, 1 << 22, CalibrationSettings(enabled=False))
    filtered = load_bundle(args.filtered_bundle, 1 << 22, CalibrationSettings(enabled=False))
    retrained = (
        load_bundle(args.predicted_bundle, 1 << 22, CalibrationSettings(enabled=False))
        if (args.predicted_bundle / "manifest.json").is_file()
        else None
    )
    manifest = bundle.manifest
    test = read_split("test", args.data_dir, max_tokens=manifest.item.max_tokens)
    data, refused = items(test, args.limit, bundle)
    fixed = [(r, rt, bundle) for r, rt in _fixed(bundle, KEEP, "")] + [
        (r, rt, filtered) for r, rt in _fixed(filtered, KEEP_FILTERED, FILTER)
    ]
    if bundle.manifest.item.tagger is not None:
        fixed += [(r, rt, bundle) for r, rt in _fixed(bundle, KEEP_TAGGED, TAGGED)]
    if retrained is not None:
        for keep, tag in ((KEEP_TAGGED, RETRAINED + TAGGED), (KEEP_RETRAINED_GOLD, RETRAINED)):
            fixed += [(r, rt, retrained) for r, rt in _fixed(retrained, keep, tag)]
    runs_fixed = [r for r, _, _ in fixed]
    # The anytime rows run on their own bundle instances (with --calibration, the service's
    # live calibration corrects their curves to this machine's wall times; off by default: a
    # trial on 80 sentences overran more often with it and lost UAS).
    anytime = [
        (Run("anytime" + tag, f"f={frac:g}"), b, b.runtimes["anytime"], frac)
        for tag, path in (("", args.bundle), (FILTER, args.filtered_bundle))
        for b in [load_bundle(path, 1 << 22, CalibrationSettings(enabled=args.calibrate))]
        for frac in ANYTIME_FRACTIONS
    ]
    # Warm-up (first-call costs, allocator growth): not measured.
    for item, gold in data[:20]:
        for run, runtime, b in fixed:
            raw = untagged(item) if run.policy.endswith(TAGGED) else item
            parse_one(b, runtime, raw, gold, Run("warm-up", "-"))
    # Interleaved: every sentence goes through every point (in a rotating order) before the
    # next, so the machine's changing load falls on all points alike.
    all_pos = _find(runs_fixed, "uniform-word", "uniform-word-p0")
    all_full = _find(runs_fixed, "uniform-word", "uniform-word-p1")
    for k, (item, gold) in enumerate(data):
        shift = k % len(fixed)
        raw = untagged(item)
        for run, runtime, b in fixed[shift:] + fixed[:shift]:
            if run.policy.endswith(TAGGED):
                parse_one(b, runtime, raw, gold, run, tagged=True)
            else:
                parse_one(b, runtime, item, gold, run)
        budgets = [anytime_budget(all_pos.ms[-1], all_full.ms[-1], a[3]) for a in anytime]
        shift = k % len(anytime)
        for j in list(range(len(anytime)))[shift:] + list(range(len(anytime)))[:shift]:
            run, b, runtime, _ = anytime[j]
            parse_one(b, runtime, item, gold, run, budgets[j])
        if (k + 1) % 100 == 0:
            print(f"{k + 1} sentences", flush=True)
    runs = runs_fixed + [a[0] for a in anytime]
    for r in runs:
        print(
            f"{r.policy:28s} {r.point:24s} UAS {r.uas:.4f} {r.cpu_ms:7.2f} ms cpu "
            f"{r.mean_ms:7.2f} ms wall ψ^Full {r.share:.3f} over {r.over} "
            f"beyond bound {r.beyond_bound}",
            flush=True,
        )
    elapsed = time.perf_counter() - t_start
    scope = (
        "**the whole EWT test set**"
        if args.limit is None or args.limit >= len(test)
        else f"the first {len(data)} EWT test sentences"
    )
    if refused:
        scope += (
            f" less {len(refused)} the service refuses with a 422 and so left out of every row"
            f" ({'; '.join(refused)})"
        )
    write_report(
        args,
        bundle,
        runs,
        (scope, len(data), sum(len(i["tokens"]) for i, _ in data), test.fingerprint),
        elapsed,
        tag_accuracy(bundle, data),
    )


def tag_accuracy(bundle: Bundle, data: list[tuple[dict[str, Any], np.ndarray]]) -> float:
    """The bundle's tagger's accuracy on the measured test words (nan without a tagger)."""
    from training.parsing.tagger import tag_accuracy as accuracy

    tagger = getattr(bundle.decoder, "tagger", None)
    if tagger is None:
        return float("nan")
    tokens = [item["tokens"] for item, _ in data]
    return accuracy(
        tagger, [Sentence([t["form"] for t in s], [t["upos"] for t in s]) for s in tokens]
    )


def untagged(item: dict[str, Any]) -> dict[str, Any]:
    """The item as a user with raw tokenised text sends it: forms only."""
    return {"tokens": [{"form": t["form"]} for t in item["tokens"]]}


def _find(runs: list[Run], policy: str, point: str) -> Run:
    return next(r for r in runs if r.policy == policy and r.point == point)


def write_report(
    args: Any,
    bundle: Bundle,
    runs: list[Run],
    measured: tuple[str, int, int, str],
    elapsed: float,
    test_tags: float,
) -> None:
    scope, sentences, words, fingerprint = measured
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evaluation = json.loads((args.bundle / "evaluation.json").read_text())
    evaluation_f = json.loads((args.filtered_bundle / "evaluation.json").read_text())
    all_pos = _find(runs, "uniform-word", "uniform-word-p0")
    all_full = _find(runs, "uniform-word", "uniform-word-p1")
    all_full_f = _find(runs, "uniform-word" + FILTER, "uniform-word-p1")
    dev_full = evaluation["uas_all_full_dev"]

    def chosen_on_dev(tag: str) -> Run | None:
        """Chosen on dev (never on test): the point with the smallest dev ψ^Full share among
        those within 1 UAS point of all-ψ^Full's dev UAS (without the filter)."""
        pts = [
            r
            for r in runs
            if r.dev_uas is not None
            and r.policy.endswith(tag)
            and (tag or not r.policy.endswith(FILTER))
            and not r.policy.startswith("uniform-word")
            and (r.dev_uas or 0.0) >= dev_full - 0.01
        ]
        return min(pts, key=lambda r: r.dev_share or 0.0) if pts else None

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for policy in dict.fromkeys(r.policy for r in runs):
        pts = sorted((r.mean_ms, r.uas) for r in runs if r.policy == policy)
        style = "--" if policy.endswith(FILTER) else ":" if policy.endswith(TAGGED) else "-"
        left.plot([p[0] for p in pts], [100 * p[1] for p in pts], style, marker="o", label=policy)
    left.set_xlabel("mean time per sentence (ms of wall time, what the service charges)")
    left.set_ylabel("UAS (%)")
    left.set_title(f"EWT test ({sentences} sentences): UAS vs time")
    left.legend(fontsize=7)
    anytime = [r for r in runs if r.policy == "anytime" and r.depth_full]
    width = 0.8 / max(len(anytime), 1)
    for k, r in enumerate(anytime):
        full = np.bincount(r.depth_full, minlength=MAX_DEPTH + 1)
        pos = np.bincount(r.depth_pos, minlength=MAX_DEPTH + 1)
        share = full / np.maximum(full + pos, 1)
        right.bar(np.arange(MAX_DEPTH + 1) + k * width, 100 * share, width, label=r.point)
    right.set_xlabel(
        f"depth in the gold tree (0: the root's dependent; {MAX_DEPTH}: ≥ {MAX_DEPTH})"
    )
    right.set_ylabel("words given ψ^Full (%)")
    right.set_title("anytime policy (no filter): share of words given ψ^Full by depth")
    right.legend(title="budget f", fontsize=8)
    args.out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.out / "parsing.png", dpi=110)
    plt.close(fig)

    costs = evaluation["costs_ms"]
    costs_f = evaluation_f["costs_ms"]
    stats = evaluation_f.get("length_filter") or {}
    lines = prose(
        "parsing",
        date=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine(),
        load=" / ".join(f"{x:.2f}" for x in os.getloadavg()),
        elapsed=f"{elapsed:.0f}",
        scope=scope,
        sentences=sentences,
        fingerprint=fingerprint,
        words=words,
        bundle=args.bundle,
        train=bundle.manifest.provenance.parameters.get("train_sentences"),
        epochs=bundle.manifest.provenance.parameters.get("epochs"),
        pos_ms=_poly(costs["pos"]),
        lex_ms=_poly(costs["lex"]),
        words_ms=_poly(costs["words"]),
        decode_ms=_poly(costs["decode"]),
        pos_ms_f=_poly(costs_f["pos"]),
        lex_ms_f=_poly(costs_f["lex"]),
        arcs_pruned=f"{stats.get('arcs_pruned', float('nan')):.3f}",
        gold_pruned=f"{stats.get('gold_arcs_pruned', float('nan')):.4f}",
        dev_pos=f"{100 * evaluation['uas_all_pos_dev']:.2f}",
        dev_full=f"{100 * dev_full:.2f}",
        steps=evaluation.get("anytime_steps", "?"),
    )
    lines += [
        "",
        "| policy | point | test UAS % | wall ms / sentence | × vs all-ψ^Full | CPU ms / sentence "
        "| ψ^Full share | dev UAS % | dev ψ^Full share | over budget | over the bound |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        dev = f"{100 * r.dev_uas:.2f}" if r.dev_uas is not None else "–"
        dshare = f"{r.dev_share:.3f}" if r.dev_share is not None else "–"
        lines.append(
            f"| {r.policy} | {r.point} | {100 * r.uas:.2f} | {r.mean_ms:.2f} "
            f"| {all_full.mean_ms / max(r.mean_ms, 1e-9):.2f} | {r.cpu_ms:.2f} | {r.share:.3f} "
            f"| {dev} | {dshare} | {r.over} | {r.beyond_bound} |"
        )
    chosen, chosen_f = chosen_on_dev(""), chosen_on_dev(FILTER)

    def verdict(r: Run | None) -> tuple[str, str, str, str, str]:
        if r is None:
            return ("none", "–", "–", "–", "not met")
        speed = all_full.mean_ms / r.mean_ms
        loss = all_full.uas - r.uas
        met = "met" if speed >= 2.5 and loss <= 0.01 else "not met"
        return (
            f"{r.policy} {r.point}",
            f"{100 * r.uas:.2f}",
            f"{100 * loss:.2f}",
            f"{speed:.2f}× (CPU {all_full.cpu_ms / r.cpu_ms:.2f}×)",
            met,
        )

    v, vf = verdict(chosen), verdict(chosen_f)
    any_runs = [r for r in runs if r.policy.startswith("anytime")]
    lines += prose(
        "parsing",
        "goals",
        **_uas_ms(all_pos=all_pos, all_full=all_full, all_full_f=all_full_f),
        ceiling=f"{all_full.mean_ms / all_pos.mean_ms:.2f}",
        chosen=v[0],
        chosen_uas=v[1],
        chosen_loss=v[2],
        speedup=v[3],
        verdict=v[4],
        chosen_f=vf[0],
        chosen_f_uas=vf[1],
        chosen_f_loss=vf[2],
        speedup_f=vf[3],
        verdict_f=vf[4],
        anytime_over=sum(r.over for r in any_runs),
        anytime_beyond=sum(r.beyond_bound for r in any_runs),
        anytime_requests=sum(len(r.ms) for r in any_runs),
        worst_overrun=f"{max((max(r.overrun_ms, default=0.0) for r in any_runs), default=0.0):.2f}",
        arcs_pruned=f"{stats.get('arcs_pruned', float('nan')):.3f}",
    )
    lines += _tagged_goal(bundle, runs, chosen, data_words=words, test_tags=test_tags)
    (args.out / "parsing.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.out / 'parsing.md'} ({elapsed:.0f} s)")


def _tagged_goal(
    bundle: Bundle, runs: list[Run], chosen: Run | None, *, data_words: int, test_tags: float
) -> list[str]:
    """The bullet on predicted tags (the bundle's tagger), or why there is none."""
    tagger = bundle.manifest.item.tagger
    tagged = {r.point: r for r in runs if r.policy.endswith(TAGGED) and RETRAINED not in r.policy}
    if tagger is None or not tagged:
        return ["* Predicted tags: this bundle has no tagger (built with --no-tagger)."]
    pos, full = tagged["uniform-word-p0"], tagged["uniform-word-p1"]
    gold_full = _find(runs, "uniform-word", "uniform-word-p1")
    point = tagged.get(chosen.point) if chosen is not None else None
    at = _point(point, full)
    lines = prose(
        "parsing",
        "tagged",
        tag_acc=f"{100 * test_tags:.2f}",
        words=data_words,
        tag_dev=f"{100 * (tagger.accuracy or float('nan')):.2f}",
        tag_ms=f"{float(np.mean(pos.tag_ms + full.tag_ms)):.2f}",
        **_uas_ms(pos=pos, full=full),
        chosen=at,
        loss=f"{100 * (gold_full.uas - full.uas):.2f}",
    )
    again = {r.point: r for r in runs if r.policy.endswith(RETRAINED + TAGGED)}
    gold_again = [r for r in runs if r.policy.endswith(RETRAINED)]
    if not again or not gold_again:
        return [*lines, "* The parser trained on predicted tags: not measured (no bundle)."]
    r_full = again["uniform-word-p1"]
    return lines + prose(
        "parsing",
        "retrained",
        **_uas_ms(pos=again["uniform-word-p0"], full=r_full),
        gain=f"{100 * (r_full.uas - full.uas):+.2f}",
        chosen=_point(again.get(chosen.point) if chosen is not None else None, r_full),
        gold_uas=f"{100 * gold_again[0].uas:.2f}",
        gold_loss=f"{100 * (gold_full.uas - gold_again[0].uas):.2f}",
    )


def _uas_ms(**runs: Run) -> dict[str, str]:
    """The report's ``{name}_uas`` (%) and ``{name}_ms`` fields of each run."""
    out = {}
    for name, run in runs.items():
        out[f"{name}_uas"] = f"{100 * run.uas:.2f}"
        out[f"{name}_ms"] = f"{run.mean_ms:.2f}"
    return out


def _point(point: Run | None, full: Run) -> str:
    """The point chosen on dev (gold tags), measured with predicted tags."""
    if point is None:
        return "the point chosen on dev was not measured with predicted tags"
    return (
        f"the point chosen on dev with gold tags ({point.policy} {point.point}): "
        f"{100 * point.uas:.2f} % at {point.mean_ms:.2f} ms, "
        f"{full.mean_ms / point.mean_ms:.2f}× against all ψ^Full with predicted tags "
        f"({100 * (full.uas - point.uas):.2f} points below it)"
    )


def _poly(coefficients: list[float]) -> str:
    terms = [
        f"{c:.4g}" + ("" if i == 0 else " n" if i == 1 else f" n^{i}")
        for i, c in enumerate(coefficients)
    ]
    return " + ".join(terms)


if __name__ == "__main__":
    main()
