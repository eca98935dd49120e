"""Metric 4 on the synthetic workload: static vs anytime Poly-Dom vs the Greedy variants
when extraction costs vary around their median (paper 002, "Real-Time Accuracy").

Every strategy plans with p95 cost curves (median × exp(1.645 σ)), as a bundle profiled at
the 95th percentile does; each simulated extraction takes median(n) × LogNormal(0, σ)
(``training.simulate``). For m = 10 features, γ ∈ {0, 1} and σ ∈ {0, 0.5} it sweeps 25
log-spaced budgets at a fixed item size (n = 500, as the paper fixes one size), plus three
sizes at one budget, and reports the mean estimated accuracy of the answers and the overrun
rate (spent > budget).

``python -m benchmarks.anytime`` writes ``docs/benchmarks/anytime_synthetic.md`` and
``docs/benchmarks/anytime_synthetic_gamma{0,1}.png``.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.report import prose
from training.simulate import STRATEGIES, Z95, Cell, SimBundle, sweep, synthetic_bundle

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
M = 10
#: The workload of bench_polydom's m = 10 rows (its seed is 2024 + m).
SEED = 2034
GAMMAS = (0.0, 1.0)
SIGMAS = (0.0, 0.5)
SIZE = 500
SIZES = (100, 500, 1000)
N_BUDGETS = 25
#: Grid positions of the low / mid / high budgets reported in the tables.
PICKS = (6, 12, 18)
REQUESTS = 300
EPSILON = 0.01
#: Budgets are nudged up by this relative amount so none sits exactly on a set's cost, where
#: float rounding of the sums (not the strategies) would decide
#: (see tests/training/test_simulate.py).
NUDGE = 1e-9

LABELS = {
    "polydom-anytime": "Poly-Dom anytime",
    "polydom": "Poly-Dom static",
    "greedy": "Greedy",
    "greedy-acc": "Greedy-Acc",
    "greedy-cost": "Greedy-Cost",
}
STYLE = {
    "polydom-anytime": {"color": "tab:red", "linestyle": "-", "marker": "o", "linewidth": 2.2},
    "polydom": {"color": "black", "linestyle": "--", "marker": "s", "linewidth": 1.6},
    "greedy": {"color": "tab:blue", "linestyle": "-", "marker": "^", "linewidth": 1.3},
    "greedy-acc": {"color": "tab:green", "linestyle": "-.", "marker": "v", "linewidth": 1.3},
    "greedy-cost": {"color": "tab:orange", "linestyle": ":", "marker": "D", "linewidth": 1.6},
}


@dataclass
class Config:
    gamma: float
    sigma: float
    bundle: SimBundle
    budgets: list[float]
    cells: list[Cell]
    size_cells: list[Cell]
    optimum: list[float]

    def cell(self, strategy: str, budget: float, n: int = SIZE) -> Cell:
        pool = self.cells if n == SIZE and budget in self.budgets else self.size_cells
        for c in pool:
            if c.strategy == strategy and c.n == n and c.budget == budget:
                return c
        raise KeyError((strategy, n, budget))

    def curve(self, strategy: str, attr: str) -> list[float]:
        return [float(getattr(self.cell(strategy, b), attr)) for b in self.budgets]

    @property
    def label(self) -> str:
        return f"γ = {self.gamma:g}, σ = {self.sigma:g}"


def budget_grid(bundle: SimBundle, n: int = SIZE, count: int = N_BUDGETS) -> list[float]:
    """Log-spaced from the cheapest single feature's to the full set's p95 cost at ``n``."""
    per = bundle.p95_at(n)
    lo, hi = min(per.values()), sum(per.values())
    return [float(b) * (1.0 + NUDGE) for b in np.geomspace(lo, hi, count)]


def run_config(gamma: float, sigma: float, requests: int = REQUESTS) -> Config:
    bundle = synthetic_bundle(M, gamma, SEED, sigma, EPSILON)
    budgets = budget_grid(bundle)
    cells = sweep(bundle, [SIZE], budgets, requests, seed=SEED)
    mid = budgets[PICKS[1]]
    size_cells = sweep(bundle, [n for n in SIZES if n != SIZE], [mid], requests, seed=SEED)
    optimum = [bundle.optimum(SIZE, b) for b in budgets]
    return Config(gamma, sigma, bundle, budgets, cells, size_cells, optimum)


def plot(configs: Sequence[Config], gamma: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [c for c in configs if c.gamma == gamma]
    top_overrun = 1.0 + 100 * max(
        max(c.curve(name, "overrun_rate")) for c in mine for name in STRATEGIES
    )
    fig, axes = plt.subplots(
        2,
        len(mine),
        figsize=(6.2 * len(mine), 8.0),
        sharex=True,
        gridspec_kw={"height_ratios": [2.2, 1.0]},
        squeeze=False,
    )
    for col, cfg in enumerate(mine):
        top, bottom = axes[0][col], axes[1][col]
        top.plot(
            cfg.budgets,
            cfg.optimum,
            color="0.6",
            linewidth=5,
            alpha=0.35,
            label="optimum at p95 costs (brute force)",
        )
        for name in STRATEGIES:
            st = STYLE[name]
            kw = {
                "color": st["color"],
                "linestyle": st["linestyle"],
                "marker": st["marker"],
                "linewidth": st["linewidth"],
                "markersize": 4,
            }
            top.plot(cfg.budgets, cfg.curve(name, "accuracy"), label=LABELS[name], **kw)
            bottom.plot(
                cfg.budgets,
                [100 * v for v in cfg.curve(name, "overrun_rate")],
                label=LABELS[name],
                **kw,
            )
        for pick in PICKS:
            for ax in (top, bottom):
                ax.axvline(cfg.budgets[pick], color="0.85", linewidth=0.8, zorder=0)
        spread = (
            "no noise (costs = median)"
            if cfg.sigma == 0
            else (
                f"log-normal spread σ = {cfg.sigma:g} (plans at p95 = "
                f"{np.exp(Z95 * cfg.sigma):.2f}× median)"
            )
        )
        top.set_title(f"γ = {cfg.gamma:g}, {spread}", fontsize=10)
        top.set_ylabel("mean estimated accuracy of the answer")
        top.set_xscale("log")
        top.grid(True, which="both", alpha=0.3)
        bottom.set_xscale("log")
        bottom.set_ylabel("overrun rate (% spent > budget)")
        bottom.set_xlabel(f"budget (cost units), item size n = {SIZE}")
        bottom.grid(True, which="both", alpha=0.3)
        bottom.set_ylim(-0.5, top_overrun)
    axes[0][0].legend(loc="lower right", fontsize=8.5, framealpha=0.9)
    fig.suptitle(
        f"Metric 4 on the synthetic workload: m = {M}, γ = {gamma:g}, seed {SEED}, "
        f"{REQUESTS} requests per point (1 when σ = 0: deterministic)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(c: Cell) -> str:
    return f"{c.accuracy:.3f} ({100 * c.overrun_rate:.1f}%)"


def _mean(cfg: Config, name: str) -> float:
    return float(np.mean(cfg.curve(name, "accuracy")))


def _conclusions(configs: Sequence[Config]) -> list[str]:
    out: list[str] = []
    tol = 1e-9
    always_ge = True
    for cfg in configs:
        a = np.array(cfg.curve("polydom-anytime", "accuracy"))
        s = np.array(cfg.curve("polydom", "accuracy"))
        diff = a - s
        always_ge &= bool(np.all(diff >= -tol))
        means = {name: _mean(cfg, name) for name in STRATEGIES}
        ranking = ", ".join(
            f"{LABELS[k]} {v:.3f}" for k, v in sorted(means.items(), key=lambda kv: -kv[1])
        )
        greedy_best = np.max(np.array([cfg.curve(g, "accuracy") for g in STRATEGIES[2:]]), axis=0)
        vs_greedy = a - greedy_best
        static_vs_greedy = s - greedy_best
        out.append(
            f"* **{cfg.label}**: anytime ≥ static Poly-Dom at "
            f"{int(np.sum(diff >= -tol))}/{len(a)} budgets, equal at "
            f"{int(np.sum(np.abs(diff) <= tol))} (largest gain {diff.max():+.3f}, largest "
            f"loss {min(diff.min(), 0.0):+.3f}). Mean accuracy over the {len(a)} budgets: "
            f"{ranking}. Against the best Greedy variant *at each budget*, anytime Poly-Dom "
            f"is ahead by > 0.001 at {int(np.sum(vs_greedy > 0.001))} budgets (by up to "
            f"{max(vs_greedy.max(), 0):+.3f}), within ±0.001 at "
            f"{int(np.sum(np.abs(vs_greedy) <= 0.001))}, behind at "
            f"{int(np.sum(vs_greedy < -0.001))} (by up to {min(vs_greedy.min(), 0):+.3f}); "
            f"static Poly-Dom is ahead at {int(np.sum(static_vs_greedy > 0.001))} and behind "
            f"at {int(np.sum(static_vs_greedy < -0.001))} (by up to "
            f"{min(static_vs_greedy.min(), 0):+.3f})."
        )
    out.append("")
    exact_equal = all(
        cfg.curve("polydom-anytime", "accuracy") == cfg.curve("polydom", "accuracy")
        for cfg in configs
        if cfg.sigma == 0
    )
    if always_ge:
        out.append(
            "* Anytime Poly-Dom is at least as accurate as static Poly-Dom at every budget of "
            "every configuration."
            + (
                " With σ = 0 they are identical: both start from the same index answer and, "
                "with costs exactly as planned, re-planning finds no slack."
                if exact_equal
                else ""
            )
        )
    else:
        out.append("* Anytime Poly-Dom is **not** ≥ static Poly-Dom everywhere (see above).")
    for cfg in configs:
        if cfg.sigma == 0:
            continue
        means = {name: _mean(cfg, name) for name in STRATEGIES}
        best_greedy = max(STRATEGIES[2:], key=lambda k: means[k])
        gain = means["polydom-anytime"] - means["polydom"]
        static_behind = means["polydom"] < means[best_greedy]
        out.append(
            f"* {cfg.label}: provisioning for p95 costs, static Poly-Dom averages "
            f"{means['polydom']:.3f}, {'below' if static_behind else 'above'} the best "
            f"Greedy variant ({LABELS[best_greedy]}, {means[best_greedy]:.3f})"
            + (
                " — the paper's real-data observation that anytime Greedy beats the "
                "worst-case-provisioned Poly-Dom when costs vary"
                if static_behind
                else ""
            )
            + f"; anytime Poly-Dom averages {means['polydom-anytime']:.3f} "
            f"({gain:+.3f} over static)."
            + (
                " With γ = 0 the answer is a single feature (a(F) is the best member's "
                "accuracy), so once the planned feature is in hand nothing can be added to "
                "it: the slack of a fast extraction cannot buy an upgrade, and anytime "
                "equals static."
                if cfg.gamma == 0 and abs(gain) < 1e-9
                else ""
            )
        )
    for cfg in configs:
        if cfg.sigma != 0:
            continue
        a = np.array(cfg.curve("polydom", "accuracy"))
        best = np.max(np.array([cfg.curve(g, "accuracy") for g in STRATEGIES[2:]]), axis=0)
        level = int(np.sum(a >= best - 0.001))
        deficit = max(float((best - a).max()), 0.0)
        out.append(
            f"* {cfg.label} (the paper's synthetic setting): Poly-Dom is ahead of or level "
            f"with every Greedy variant at {level}/{len(a)} budgets"
            + (
                "."
                if deficit == 0
                else f"; where one is ahead it is by at most {deficit:.3f}"
                + (
                    f", within ε = {EPSILON:g} (Poly-Dom guarantees the optimum within ε)."
                    if deficit <= EPSILON
                    else "."
                )
            )
        )
    any_overrun = any(c.overrun_rate > 0 for cfg in configs if cfg.sigma == 0 for c in cfg.cells)
    exact = "some strategy overruns" if any_overrun else "no strategy ever overruns"
    parts = []
    for cfg in configs:
        if cfg.sigma == 0:
            continue
        mean = {n: 100 * float(np.mean(cfg.curve(n, "overrun_rate"))) for n in STRATEGIES}
        lowest, highest = min(mean, key=mean.__getitem__), max(mean, key=mean.__getitem__)
        delta = mean["polydom-anytime"] - mean["polydom"]
        parts.append(
            f"{cfg.label}: from {mean[lowest]:.1f}% ({LABELS[lowest]}) to {mean[highest]:.1f}% "
            f"({LABELS[highest]}); anytime Poly-Dom {mean['polydom-anytime']:.1f}% vs static "
            f"{mean['polydom']:.1f}%"
            + (
                " — the anytime variant spends the slack it finds, so it overruns more often"
                if delta > 0.05
                else ""
            )
        )
    out.append(
        f"* Overruns: with σ = 0 {exact}. With σ = 0.5 and p95 provisioning every strategy "
        "overruns in a few percent of requests (an extraction beyond its p95 cost). Mean "
        f"overrun rate over all budgets — {'; '.join(parts)}."
    )
    out += [
        "",
        "Overrun rate per strategy, mean / max over the budgets (%):",
        "",
        "| strategy | " + " | ".join(c.label for c in configs) + " |",
        "|---|" + "---:|" * len(configs),
    ]
    for name in STRATEGIES:
        cells = []
        for cfg in configs:
            rates = 100 * np.array(cfg.curve(name, "overrun_rate"))
            cells.append(f"{rates.mean():.1f} / {rates.max():.1f}")
        out.append(f"| {LABELS[name]} | " + " | ".join(cells) + " |")
    return out


def render(configs: Sequence[Config], elapsed_s: float, images: Sequence[Path]) -> str:
    max_se = max(c.accuracy_se for cfg in configs for c in [*cfg.cells, *cfg.size_cells])
    p95_factor = np.exp(Z95 * 0.5)
    lines = prose(
        "anytime",
        date=dt.date.today().isoformat(),
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        cpus=os.cpu_count(),
        python=platform.python_version(),
        elapsed=f"{elapsed_s:.1f}",
        m=M,
        seed=SEED,
        p95_factor=f"{p95_factor:.3f}",
        p95_factor_2=f"{p95_factor:.2f}",
        size=SIZE,
        n_budgets=N_BUDGETS,
        nudge=f"{NUDGE:g}",
        requests=REQUESTS,
        max_se=f"{max_se:.4f}",
        overrun_se=f"{100 * np.sqrt(0.25 / REQUESTS):.1f}",
        pick_low=PICKS[0] + 1,
        pick_mid=PICKS[1] + 1,
        pick_high=PICKS[2] + 1,
        plots=", ".join(f"[`{p.name}`]({p.name})" for p in images),
    )
    for cfg in configs:
        b = [cfg.budgets[p] for p in PICKS]
        lines += [
            f"## {cfg.label}",
            "",
            f"Poly-Dom candidates: {len(cfg.bundle.polydom.candidates_)}; models in the "
            f"manifest: {len(cfg.bundle.manifest.models)}. Optimum at p95 costs (brute force "
            "over all 2^10 sets): " + " / ".join(f"{cfg.optimum[p]:.3f}" for p in PICKS) + ".",
            "",
            "| strategy | low budget " + f"{b[0]:.0f} | mid budget {b[1]:.0f} | "
            f"high budget {b[2]:.0f} | mean over {N_BUDGETS} budgets |",
            "|---|---:|---:|---:|---:|",
        ]
        for name in STRATEGIES:
            row = " | ".join(_fmt(cfg.cell(name, x)) for x in b)
            lines.append(f"| {LABELS[name]} | {row} | {_mean(cfg, name):.3f} |")
        lines += [
            "",
            f"At the mid budget {b[1]:.0f}, by item size:",
            "",
            "| strategy | " + " | ".join(f"n = {n}" for n in SIZES) + " |",
            "|---|" + "---:|" * len(SIZES),
        ]
        for name in STRATEGIES:
            row = " | ".join(_fmt(cfg.cell(name, b[1], n)) for n in SIZES)
            lines.append(f"| {LABELS[name]} | {row} |")
        lines.append("")
    lines += ["## Conclusions from these numbers", ""]
    lines += _conclusions(configs)
    lines.append("")
    return "\n".join(lines)


def main(out_dir: Path | str = DEFAULT_OUT, requests: int = REQUESTS) -> list[Path]:
    """Run the benchmark; write the markdown report and one PNG per γ to ``out_dir``."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    configs = [run_config(g, s, requests) for g in GAMMAS for s in SIGMAS]
    images = [plot(configs, g, out / f"anytime_synthetic_gamma{g:g}.png") for g in GAMMAS]
    md = out / "anytime_synthetic.md"
    md.write_text(render(configs, time.perf_counter() - t0, images), encoding="utf-8")
    return [md, *images]


if __name__ == "__main__":
    for path in main():
        print(path)
