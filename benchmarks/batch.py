"""Batches under one budget (``service/batch.py``): mean accuracy of held-out digits served in
batches under a total budget, planned across the items, vs the same budget split evenly
(``docs/benchmarks/batch.md``).

``python -m benchmarks.batch [--batches N] [--size B]`` writes the report; ``python -m
benchmarks`` runs it with the others. Both arms run in the same process, batch by batch and
item by item in turn, on the same rendered items, with real extraction, real timings and the
real strategy runtime (polydom-anytime of the embedded digits bundle).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import numpy as np

from benchmarks.report import OUT, machine, measured_at, prose, wilson

SIDES = (16, 32, 64, 128, 256)
PER_ITEM_BUDGETS = (0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0)
BATCH_SIZE = 8
RESERVE_MS = 0.5


@dataclass
class Arm:
    correct: int = 0
    items: int = 0
    spent: list[float] = field(default_factory=list)  # per batch
    over: int = 0  # batches whose total spent passed the total
    overrun_ms: list[float] = field(default_factory=list)  # per batch, when over

    def record(self, correct: int, n: int, spent: float, total: float) -> None:
        self.correct += correct
        self.items += n
        self.spent.append(spent)
        if spent > total:
            self.over += 1
            self.overrun_ms.append(spent - total)

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.items, 1)


def run(
    batches: int, size: int, budgets: Sequence[float]
) -> tuple[dict[float, dict[str, Arm]], dict[str, object]]:
    from service.batch import item_options, run_batch
    from service.execution import execute
    from service.items import DecodedItem
    from training.data.digits import render_digit
    from training.evaluate import held_out_digits, load

    bundle = load(Path(__file__).resolve().parents[1] / "models" / "digits")
    runtime = bundle.strategy("polydom-anytime")
    classes = bundle.manifest.classes
    params = bundle.manifest.provenance.parameters
    images8, labels = held_out_digits(
        batches * size, int(params.get("seed", 0)), params.get("limit")
    )
    rng = np.random.default_rng(18)
    sides = rng.choice(SIDES, size=len(labels))
    items = [
        DecodedItem(data=render_digit(img, int(s), rng), size=int(s) ** 2, key=f"batch:{i}")
        for i, (img, s) in enumerate(zip(images8, sides, strict=True))
    ]
    groups = [list(range(b * size, min((b + 1) * size, len(items)))) for b in range(batches)]
    groups = [g for g in groups if g]
    results: dict[float, dict[str, Arm]] = {b: {"planned": Arm(), "even": Arm()} for b in budgets}
    unlimited = Arm()

    def one(i: int, budget: float) -> tuple[int, float]:
        started = time.perf_counter()
        ex = execute(bundle, items[i], budget, {}, started, reserve_ms=RESERVE_MS, runtime=runtime)
        return int(classes[int(np.argmax(ex.probabilities))] == str(labels[i])), ex.spent

    for group in groups:
        options = [item_options(runtime, items[i].size, (), RESERVE_MS) for i in group]
        for per_item in budgets:
            total = per_item * len(group)
            # even split: every item gets total / len(group)
            even = [one(i, per_item) for i in group]
            results[per_item]["even"].record(
                sum(c for c, _ in even), len(group), sum(s for _, s in even), total
            )
            # planned: the batch planner over the same items
            outcome: dict[int, int] = {}

            async def run_item(
                k: int, budget: float, group: list[int] = group, outcome: dict[int, int] = outcome
            ) -> float:
                correct, spent = one(group[k], max(budget, 1e-6))
                outcome[k] = correct
                return spent

            plan = anyio.run(run_batch, lambda k, o=options: o[k], len(group), total, run_item)
            results[per_item]["planned"].record(
                sum(outcome.values()), len(group), plan.total_spent, total
            )
        full = [one(i, 1000.0) for i in group]
        unlimited.record(sum(c for c, _ in full), len(group), sum(s for _, s in full), 1e9)
    info: dict[str, object] = {
        "name": bundle.manifest.name,
        "version": bundle.manifest.version,
        "items": sum(len(g) for g in groups),
        "batches": len(groups),
        "unlimited": unlimited,
    }
    return results, info


def render(
    results: dict[float, dict[str, Arm]], info: dict[str, object], size: int, elapsed: float
) -> str:
    unlimited = info["unlimited"]
    assert isinstance(unlimited, Arm)
    lines = prose(
        "batch",
        name=info["name"],
        version=info["version"],
        measured_at=measured_at(),
        machine=machine(),
        items=info["items"],
        batches=info["batches"],
        size=size,
        sides=", ".join(str(s) for s in SIDES),
        reserve=RESERVE_MS,
        elapsed=f"{elapsed:.0f}",
    )
    lines += [
        "| budget per item (ms) | planned accuracy | even-split accuracy | Δ (points) | "
        "planned ms/item | even ms/item | batches over (planned / even) | "
        "largest batch overrun ms (planned / even) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    losses = []
    for per_item, arms in results.items():
        p, e = arms["planned"], arms["even"]
        lo_p, hi_p = wilson(p.correct, p.items)
        lo_e, hi_e = wilson(e.correct, e.items)
        delta = 100 * (p.accuracy - e.accuracy)
        if delta < 0:
            losses.append(f"{per_item:g} ms ({delta:+.1f} points)")
        lines.append(
            f"| {per_item:g} | {p.accuracy:.3f} [{lo_p:.3f}, {hi_p:.3f}] | "
            f"{e.accuracy:.3f} [{lo_e:.3f}, {hi_e:.3f}] | {delta:+.1f} | "
            f"{np.mean(p.spent) / size:.2f} | {np.mean(e.spent) / size:.2f} | "
            f"{p.over} / {e.over} of {len(p.spent)} | "
            f"{max(p.overrun_ms, default=0.0):.2f} / {max(e.overrun_ms, default=0.0):.2f} |"
        )
    lines += prose(
        "batch",
        "after",
        unlimited_accuracy=f"{unlimited.accuracy:.3f}",
        unlimited_ms=f"{np.mean(unlimited.spent) / size:.2f}",
        losses=("; ".join(losses) if losses else "none in this run"),
    )
    return "\n".join(lines) + "\n"


def main(batches: int = 45, size: int = BATCH_SIZE, out: Path = OUT) -> Path:
    t0 = time.perf_counter()
    results, info = run(batches, size, PER_ITEM_BUDGETS)
    path = out / "batch.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(results, info, size, time.perf_counter() - t0), encoding="utf-8")
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--batches", type=int, default=45, help="batches (45 x 8 = all 360 held-out digits)"
    )
    parser.add_argument("--size", type=int, default=BATCH_SIZE, help="items per batch")
    args = parser.parse_args()
    print(main(args.batches, args.size))
