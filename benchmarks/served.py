"""Tabular bundles served over HTTP against the best fixed sensor subset (issue 25): what the
dag, gating and cstc benchmarks share for their ``--served`` reports.

A :class:`Task` is a data set with named sensors and costs. For each split seed the method's
real builder (:mod:`training.bundles`) builds a bundle on the training and validation rows of
``spec.split``; the bundle is served by the real app under uvicorn on a loopback port, the test
rows are written to a real Redis (one hash per row) and every request sends only the row's
id, so every sensor is acquired through the ``redis_hash`` source at its declared cost; the
feature cache holds nothing, so no request reuses another's sensors. At every budget of the
task each test row is asked once; the answer's correctness, spent cost and decision are kept.

The baseline is what a user would run instead: the best fixed sensor subset at that budget,
chosen on the validation rows among the subsets the builder fitted alone (every subset up to 6
sensors, else a greedy forward chain; LightGBM tuned on validation or logistic regression,
:mod:`training.fixed_subsets`), evaluated on the same test rows (the fitted model; the bundle
serves the same model as ONNX, checked against it). Differences are paired over the test
rows, with 95 % normal intervals; HistGradientBoosting and logistic regression on all
features, fitted on the same training rows, are the all-features references.

It stays whole (over 450 lines): the tasks, the real servers, the runs and the report are one
experiment that the three benchmarks share, each part reading the others' result types.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.types import FloatArray

BoolArray = npt.NDArray[np.bool_]


@dataclass
class Task:
    """A data set with sensors: ``x``'s columns are the sensors' columns in order."""

    key: str
    title: str
    x: FloatArray
    y: npt.NDArray[Any]
    columns: list[str]
    sensors: dict[str, list[str]]
    costs: dict[str, float]
    budgets: list[float]
    seeds: list[int] = field(default_factory=lambda: [0])
    setup: list[str] = field(default_factory=list)

    @property
    def full_cost(self) -> float:
        return float(sum(self.costs.values()))


@dataclass
class Served:
    """One method on one task, per budget pooled over the seeds' test rows."""

    method: str
    task: Task
    right: dict[float, BoolArray] = field(default_factory=dict)
    spent: dict[float, FloatArray] = field(default_factory=dict)
    kinds: dict[float, list[str]] = field(default_factory=dict)
    points: dict[float, Counter[str]] = field(default_factory=dict)
    routed: dict[float, BoolArray] = field(default_factory=dict)
    fixed_right: dict[float, BoolArray] = field(default_factory=dict)
    fixed_cost: dict[float, FloatArray] = field(default_factory=dict)
    fixed_subset: dict[float, Counter[str]] = field(default_factory=dict)
    f1_right: dict[float, BoolArray] = field(default_factory=dict)  # gating: f1 alone
    mean: bool = False  # the budget asked as a mean (budget_mode "mean")
    mix_right: dict[float, BoolArray] = field(default_factory=dict)  # mean: fixed mixture
    mix_cost: dict[float, FloatArray] = field(default_factory=dict)
    mix_subsets: dict[float, Counter[str]] = field(default_factory=dict)
    labels: npt.NDArray[Any] = field(default_factory=lambda: np.zeros(0))  # pooled test labels
    references: dict[str, BoolArray] = field(default_factory=dict)
    build_seconds: float = 0.0
    serve_seconds: float = 0.0
    requests: int = 0
    notes: list[str] = field(default_factory=list)

    def accuracy(self, budget: float) -> float:
        return float(np.mean(self.right[budget]))


def diff_interval(a: BoolArray, b: BoolArray) -> tuple[float, float, float]:
    """mean(a) - mean(b) over the same rows and its 95 % normal interval."""
    d = a.astype(np.float64) - b.astype(np.float64)
    half = 1.96 * float(d.std(ddof=1)) / math.sqrt(d.size) if d.size > 1 else math.nan
    return float(d.mean()), float(d.mean()) - half, float(d.mean()) + half


def wilson_text(right: BoolArray) -> str:
    from benchmarks.report import wilson

    lo, hi = wilson(int(right.sum()), int(right.size))
    return f"{100 * right.mean():.2f} % [{100 * lo:.1f}, {100 * hi:.1f}]"


#: The fixed-subset search for letter's 26 classes, where LightGBM is slow on the shared
#: machine: fewer, faster trees, one size (the dag, gating and cstc served benchmarks).
FIXED_26 = {"num_leaves": [31], "learning_rate": 0.2, "max_trees": 150, "patience": 30}


# --------------------------------------------------------------------------------------------
# real servers
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def redis_server() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port (its URL)."""
    import redis

    port = _free_port()
    folder = tempfile.mkdtemp(prefix="bench-redis-")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", folder],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port, socket_timeout=1)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def serving(models_dir: Path, name: str, redis_url: str, key: str) -> Iterator[int]:
    """The real app on uvicorn (a thread of this process) serving ``models_dir``, bundle
    ``name``'s sensors read from Redis hashes ``key`` (with ``{id}``), no feature cache."""
    import uvicorn

    from service.cache import InProcessCache
    from service.http import create_app
    from service.settings import Settings
    from service.sources import SensorSource

    source = SensorSource.model_validate({"plugin": "redis_hash", "url": redis_url, "key": key})
    settings = Settings(models_dir=models_dir, sensor_sources={name: {"*": source}})
    app = create_app(settings, cache=InProcessCache(1))
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(1200):
            if server.started:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("uvicorn did not start within 60 s")
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=60)


class Client:
    """One keep-alive HTTP connection to the service."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def predict(self, body: dict[str, Any]) -> dict[str, Any]:
        self.conn.request(
            "POST", "/predict", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = self.conn.getresponse()
        payload = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"/predict answered {response.status}: {payload}")
        out: dict[str, Any] = payload
        return out

    def close(self) -> None:
        self.conn.close()


# --------------------------------------------------------------------------------------------
# one method on one task
# --------------------------------------------------------------------------------------------

#: builder(out_dir, spec, x, y, columns) -> a build result with ``fixed`` (SubsetFit list)
Builder = Callable[..., Any]


def best_fixed(fixed: Sequence[Any], budget: float) -> Any:
    """The runtime's rule among the fixed subsets alone: the most accurate on validation whose
    cost fits the budget (ties: the cheaper)."""
    fits = [f for f in fixed if f.cost <= budget + 1e-9]
    return max(fits, key=lambda f: (f.val_accuracy, -f.cost))


@dataclass(frozen=True)
class Variant:
    """One way of serving a bundle: ``margin`` written into its manifest (None: as built),
    and whether the budget is asked as a mean (``budget_mode`` "mean")."""

    suffix: str
    margin: float | None = None
    mean: bool = False


#: The served variants of every bundle: as built (the budget a per-item cap), with ``margin``
#: 0 in its manifest (an adaptive point served whenever it is ahead on validation at all),
#: and as built with the budget asked as a mean (the papers' budget: an average cost).
VARIANTS: tuple[Variant, ...] = (
    Variant(""),
    Variant(" (margin 0)", 0.0),
    Variant(" (mean budget)", mean=True),
)


def run_method(
    task: Task,
    method: str,
    make_spec: Callable[[str, int], Any],
    build: Builder,
    redis_url: str,
    work: Path,
    *,
    strategy: str | None = None,
    tolerance: float | None = None,
    f1_alone: Callable[[Any, str, FloatArray], BoolArray | None] | None = None,
    adaptive_only: bool = False,
    variants: Sequence[Variant] = VARIANTS,
    notes: Callable[[Any, Task], list[str]] | None = None,
    log: Callable[[str], None] = print,
) -> list[Served]:
    """Build per seed, serve every test row at every budget once per variant (the bundle's
    margin as built, or set in its manifest), pool the seeds: one :class:`Served` per
    variant. ``notes``: lines about each seed's build result, in the first variant's
    section."""
    import redis

    outs = [Served(method + v.suffix, task, mean=v.mean) for v in variants]
    store = redis.Redis.from_url(redis_url)
    parts: list[dict[float, dict[str, list[Any]]]] = [
        {b: {} for b in task.budgets} for _ in variants
    ]
    references: dict[str, list[BoolArray]] = {}
    labels: list[npt.NDArray[Any]] = []
    for seed in task.seeds:
        name = re.sub(r"[^a-z0-9_.-]+", "-", f"{task.key}-{method}-{seed}".lower()).strip("-")
        spec = make_spec(name, seed)
        x_tr, _x_val, x_te, y_tr, _y_val, y_te = spec.split(task.x, task.y)
        folder = work / name
        folder.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        result = build(folder / name, spec, task.x, task.y, task.columns)
        for out in outs:
            out.build_seconds += time.perf_counter() - t0
        if notes is not None:  # per seed, in the first variant's section only
            seeded = [
                f"seed {seed}: {n}" if len(task.seeds) > 1 else n for n in notes(result, task)
            ]
            outs[0].notes += seeded
        if adaptive_only:  # to compare two methods' adaptive points (never in a bundle)
            _edit_strategies(folder / name, {"fixed": []})
        log(f"{name}: built in {time.perf_counter() - t0:.0f} s")
        prefix = f"{name}:"
        pipe = store.pipeline()
        for i, row in enumerate(x_te):
            values = dict(zip(task.columns, map(repr, row.tolist()), strict=True))
            pipe.hset(prefix + str(i), mapping=values)  # type: ignore[arg-type]
        pipe.execute()
        classes = np.unique(y_tr)
        labels.append(np.asarray([str(v) for v in y_te]))
        for ref, right in _references(x_tr, y_tr, x_te, y_te, seed).items():
            references.setdefault(ref, []).append(right)
        built_margin = margin = _margin(folder / name)
        for variant, out, acc in zip(variants, outs, parts, strict=True):
            wanted = built_margin if variant.margin is None else variant.margin
            if wanted != margin:
                _edit_strategies(folder / name, {"margin": wanted})
                margin = wanted
            t1 = time.perf_counter()
            with serving(folder, name, redis_url, prefix + "{id}") as port:
                client = Client(port)
                try:
                    for budget in task.budgets:
                        body: dict[str, Any] = {"model": name, "budget": budget}
                        if strategy is not None:
                            body["strategy"] = strategy
                        if tolerance is not None:
                            body["tolerance"] = tolerance
                        if variant.mean:
                            body["budget_mode"] = "mean"
                        rows = [
                            client.predict({**body, "item": {"id": str(i)}})
                            for i in range(len(x_te))
                        ]
                        out.requests += len(rows)
                        _collect(acc[budget], rows, y_te, result, budget, x_te, classes, f1_alone)
                        if variant.mean:
                            _collect_mixture(acc[budget], y_te, result, budget, x_te, classes)
                finally:
                    client.close()
            out.serve_seconds += time.perf_counter() - t1
            log(
                f"{name}{out.method[len(method) :]}: served {len(x_te)} rows x "
                f"{len(task.budgets)} budgets in {time.perf_counter() - t1:.0f} s"
            )
        shutil.rmtree(folder, ignore_errors=True)
    for out, acc in zip(outs, parts, strict=True):
        _pool(out, acc)
        out.references = {k: np.concatenate(v) for k, v in references.items()}
        out.labels = np.concatenate(labels)
    return outs


def _pool(out: Served, parts: dict[float, dict[str, list[Any]]]) -> None:
    """Each budget's answers of every seed, concatenated."""
    for budget, got in parts.items():
        out.right[budget] = np.concatenate(got["right"])
        out.spent[budget] = np.concatenate(got["spent"])
        out.kinds[budget] = [k for ks in got["kinds"] for k in ks]
        out.points[budget] = Counter(p for ps in got["points"] for p in ps)
        out.routed[budget] = np.concatenate(got["routed"])
        out.fixed_right[budget] = np.concatenate(got["fixed_right"])
        out.fixed_cost[budget] = np.concatenate(got["fixed_cost"])
        out.fixed_subset[budget] = Counter(got["fixed_subset"])
        if got.get("mix_right"):
            out.mix_right[budget] = np.concatenate(got["mix_right"])
            out.mix_cost[budget] = np.concatenate(got["mix_cost"])
            out.mix_subsets[budget] = Counter(got["mix_subsets"])
        f1 = got.get("f1_right") or []
        if f1 and all(r is not None for r in f1):  # the same routing point on every seed
            out.f1_right[budget] = np.concatenate(f1)


def balanced(right: BoolArray, labels: npt.NDArray[Any]) -> float:
    """Balanced accuracy: the mean over classes of the share of that class's rows right."""
    return float(np.mean([right[labels == c].mean() for c in np.unique(labels)]))


def _margin(bundle: Path) -> float:
    """The ``margin`` the builder wrote into the bundle's tabular strategies."""
    from service.bundle import AdaptiveWithFixed, read_manifest

    margins = {
        s.margin for s in read_manifest(bundle).strategies if isinstance(s, AdaptiveWithFixed)
    }
    if len(margins) != 1:
        raise ValueError(f"{bundle}: expected one margin, found {sorted(margins)}")
    return float(margins.pop())


def _edit_strategies(bundle: Path, update: dict[str, Any]) -> None:
    """Set fields of the bundle's tabular strategies in its manifest (a benchmark variant;
    no builder writes such a bundle)."""
    from service.bundle import AdaptiveWithFixed, read_manifest, write_manifest

    manifest = read_manifest(bundle)
    strategies = [
        s.model_copy(update=update) if isinstance(s, AdaptiveWithFixed) else s
        for s in manifest.strategies
    ]
    write_manifest(bundle, manifest.model_copy(update={"strategies": strategies}))


def _collect(
    acc: dict[str, list[Any]],
    rows: list[dict[str, Any]],
    y_te: npt.NDArray[Any],
    result: Any,
    budget: float,
    x_te: FloatArray,
    classes: npt.NDArray[Any],
    f1_alone: Callable[[Any, str, FloatArray], BoolArray | None] | None,
) -> None:
    truth = np.asarray([str(v) for v in y_te])
    acc.setdefault("right", []).append(
        np.asarray([r["prediction"] == t for r, t in zip(rows, truth, strict=True)])
    )
    acc.setdefault("spent", []).append(np.asarray([r["cost"]["spent"] for r in rows]))
    decisions = [r.get("decision") or {} for r in rows]
    acc.setdefault("kinds", []).append(
        [d.get("kind", r["strategy"]) for d, r in zip(decisions, rows, strict=True)]
    )
    points = [str(d.get("point", r["answered_by"])) for d, r in zip(decisions, rows, strict=True)]
    acc.setdefault("points", []).append(points)
    acc.setdefault("routed", []).append(
        np.asarray([bool(d.get("sent_to_high")) for d in decisions])
    )
    fit = best_fixed(result.fixed, budget)
    pred = classes[np.argmax(fit.predict_proba(x_te), axis=1)]
    acc.setdefault("fixed_right", []).append(np.asarray([str(p) for p in pred]) == truth)
    acc.setdefault("fixed_cost", []).append(np.full(len(rows), fit.cost))
    acc.setdefault("fixed_subset", []).append("{" + ",".join(fit.sensors) + "}")
    if f1_alone is not None:
        chosen = Counter(points).most_common(1)[0][0]
        right = f1_alone(result, chosen, x_te)
        acc.setdefault("f1_right", []).append(
            None if right is None else np.asarray([str(v) for v in right]) == truth
        )


def best_mixture(fixed: Sequence[Any], budget: float) -> tuple[Any, Any, float]:
    """The best fixed pipeline under a mean budget: two fixed subsets shared out to a
    share ``p`` and ``1 - p`` of the items, whose average cost fits the budget (the upper
    concave hull of the fixed subsets at the budget), the most accurate on validation. Returns
    (cheaper subset, dearer subset, p); one subset alone is (f, f, 1)."""
    best = best_fixed(fixed, budget)
    out, score = (best, best, 1.0), best.val_accuracy
    for lo in fixed:
        for hi in fixed:
            if not lo.cost <= budget < hi.cost:
                continue
            p = (hi.cost - budget) / (hi.cost - lo.cost)
            value = p * lo.val_accuracy + (1.0 - p) * hi.val_accuracy
            if value > score + 1e-12:
                out, score = (lo, hi, p), value
    return out


def _collect_mixture(
    acc: dict[str, list[Any]],
    y_te: npt.NDArray[Any],
    result: Any,
    budget: float,
    x_te: FloatArray,
    classes: npt.NDArray[Any],
) -> None:
    """The best fixed mixture at a mean budget on the test rows: a fixed share of the rows
    (every k-th, evenly spread) answered by the cheaper subset, the others by the dearer."""
    lo, hi, p = best_mixture(result.fixed, budget)
    truth = np.asarray([str(v) for v in y_te])
    rows = np.arange(len(truth))
    cheap = np.floor((rows + 1) * p) > np.floor(rows * p)  # a share p, evenly spread
    right = np.empty(len(truth), dtype=bool)
    cost = np.where(cheap, lo.cost, hi.cost).astype(np.float64)
    for fit, mask in ((lo, cheap), (hi, ~cheap)):
        if mask.any():
            pred = classes[np.argmax(fit.predict_proba(x_te[mask]), axis=1)]
            right[mask] = np.asarray([str(v) for v in pred]) == truth[mask]
    acc.setdefault("mix_right", []).append(right)
    acc.setdefault("mix_cost", []).append(cost)
    name = "{" + ",".join(lo.sensors) + "}"
    if hi is not lo:
        name += f" {100 * p:.0f} % / " + "{" + ",".join(hi.sensors) + "}"
    acc.setdefault("mix_subsets", []).append(name)


def _references(
    x_tr: FloatArray, y_tr: Any, x_te: FloatArray, y_te: Any, seed: int
) -> dict[str, BoolArray]:
    """What a user would run instead on every sensor: library defaults, the training rows."""
    import warnings

    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for name, model in (
            (GB, HistGradientBoostingClassifier(random_state=seed)),
            (LR, make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))),
        ):
            model.fit(x_tr, y_tr)
            out[name] = np.asarray(model.predict(x_te) == y_te)
    return out


GB = "HistGradientBoosting, all sensors"
LR = "logistic regression, all sensors"


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def table(res: Served, label: str) -> list[str]:
    """Per budget: the served method, the best fixed subset, the paired difference."""
    mean = res.mean and bool(res.mix_right)
    lines = [
        f"| budget | {label} (served) | spent{' mean (max)' if mean else ''} | answered by | "
        f"best fixed subset | its cost | difference [95 % CI] |"
        + (" best fixed mixture | its mean cost | difference [95 % CI] |" if mean else ""),
        "|---:|---:|---:|---|---:|---:|---:|" + ("---:|---:|---:|" if mean else ""),
    ]
    for b in res.task.budgets:
        d, lo, hi = diff_interval(res.right[b], res.fixed_right[b])
        kinds = Counter(res.kinds[b])
        adaptive = 1.0 - kinds.get("fixed", 0) / max(len(res.kinds[b]), 1)
        total = max(sum(res.points[b].values()), 1)
        top = [(q, n) for q, n in res.points[b].most_common(2) if n / total >= 0.05]
        routed = float(np.mean(res.routed[b]))
        who = (
            f"`{top[0][0]}`"
            if len(top) == 1
            else " / ".join(f"`{q}` {100 * n / total:.0f} %" for q, n in top)
        ) + (f", routes {100 * routed:.1f} %" if routed > 0 else "")
        if 0 < adaptive < 1:
            who += f" (adaptive on {100 * adaptive:.0f} % of rows)"
        fixed = res.fixed_subset[b].most_common(1)[0][0]
        spent = f"{res.spent[b].mean():.2f}" + (f" ({res.spent[b].max():g})" if mean else "")
        row = (
            f"| {b:g} | {wilson_text(res.right[b])} | {spent} | {who} | "
            f"{wilson_text(res.fixed_right[b])} {fixed} | {res.fixed_cost[b].mean():.2f} | "
            f"{100 * d:+.2f} [{100 * lo:+.2f}, {100 * hi:+.2f}] |"
        )
        if mean:
            md, mlo, mhi = diff_interval(res.right[b], res.mix_right[b])
            mix = res.mix_subsets[b].most_common(1)[0][0]
            row += (
                f" {wilson_text(res.mix_right[b])} {mix} | {res.mix_cost[b].mean():.2f} | "
                f"{100 * md:+.2f} [{100 * mlo:+.2f}, {100 * mhi:+.2f}] |"
            )
        lines.append(row)
    return lines


def verdict(res: Served, intermediate: Sequence[float]) -> dict[str, Any]:
    """Issue 25's goal for one method on one task: within 0.5 point of the best fixed subset
    at every budget, strictly better at >= 1 intermediate budget; and where adaptive points
    were served, how often they won and by how much."""
    diffs = {b: diff_interval(res.right[b], res.fixed_right[b]) for b in res.task.budgets}
    worst = min(diffs.items(), key=lambda kv: kv[1][0])
    within = all(d >= -0.005 for d, _, _ in diffs.values())
    better = [b for b in intermediate if diffs[b][0] > 0]
    clearly = [b for b in intermediate if diffs[b][1] > 0]
    adaptive = [
        b for b in res.task.budgets if Counter(res.kinds[b]).get("fixed", 0) < len(res.kinds[b])
    ]
    wins = [b for b in adaptive if diffs[b][0] > 0]
    losses = [b for b in res.task.budgets if diffs[b][0] < -0.005]
    return {
        "within": within,
        "worst": worst,
        "better": better,
        "clearly": clearly,
        "adaptive": adaptive,
        "wins": wins,
        "losses": losses,
        "diffs": diffs,
    }


def summary_line(res: Served, intermediate: Sequence[float]) -> str:
    v = verdict(res, intermediate)
    worst_b, (wd, wlo, whi) = v["worst"]
    parts = [
        f"within 0.5 point of the best fixed subset at every budget: "
        f"**{'met' if v['within'] else 'missed'}** (worst {100 * wd:+.2f} points at {worst_b:g}, "
        f"95 % CI [{100 * wlo:+.2f}, {100 * whi:+.2f}])",
        "strictly better at an intermediate budget"
        + (" (a mixture of fixed subsets counts)" if res.mean else "")
        + f": **{'yes' if v['better'] else 'no'}**"
        + (
            f" (at {', '.join(f'{b:g}' for b in v['better'])}; the interval above 0 at "
            f"{', '.join(f'{b:g}' for b in v['clearly']) or 'none'})"
            if v["better"]
            else ""
        ),
        f"adaptive points served at {len(v['adaptive'])} of {len(res.task.budgets)} budgets, "
        f"ahead of the best fixed subset at {len(v['wins'])} of them"
        + (
            " (by " + ", ".join(f"{100 * v['diffs'][b][0]:+.2f}" for b in v["wins"]) + " points)"
            if v["wins"]
            else ""
        ),
    ]
    if res.mean and res.mix_right:
        # Under an average budget the fixed pipelines' own best is a mixture of two: the
        # adaptive points are held to that (a win over one subset may be the mixture's).
        mix = {b: diff_interval(res.right[b], res.mix_right[b]) for b in res.task.budgets}
        # ahead where adaptive points answered (two fixed mixtures differ only by the rows
        # each assigns to which subset)
        ahead = [b for b in intermediate if mix[b][0] > 0 and b in v["adaptive"]]
        clearly = [b for b in ahead if mix[b][1] > 0]
        behind = [b for b in res.task.budgets if mix[b][0] < -0.005]
        parts.append(
            "against the best fixed mixture (two fixed subsets shared out to the budget's "
            "average, the fixed pipelines' best under a mean budget): "
            + (
                "more than 0.5 point behind at "
                + ", ".join(
                    f"{b:g} ({100 * mix[b][0]:+.2f} [{100 * mix[b][1]:+.2f}, "
                    f"{100 * mix[b][2]:+.2f}])"
                    for b in behind
                )
                if behind
                else "within 0.5 point at every budget"
            )
            + "; adaptive points strictly better at an intermediate budget: "
            + f"**{'yes' if ahead else 'no'}**"
            + (
                " (" + ", ".join(f"{b:g}: {100 * mix[b][0]:+.2f}" for b in ahead) + "; the "
                f"interval above 0 at {', '.join(f'{b:g}' for b in clearly) or 'none'})"
                if ahead
                else ""
            )
        )
        over = [b for b in res.task.budgets if res.spent[b].mean() > b + 1e-9]
        parts.append(
            "mean spent within the budget at "
            f"{len(res.task.budgets) - len(over)} of {len(res.task.budgets)} budgets"
            + (
                " (over at " + ", ".join(f"{b:g}: {res.spent[b].mean():.3f}" for b in over) + ")"
                if over
                else ""
            )
        )
    if v["losses"]:
        parts.append(
            "**where we lose** (more than 0.5 point below): "
            + ", ".join(
                f"{b:g} ({100 * v['diffs'][b][0]:+.2f} [{100 * v['diffs'][b][1]:+.2f}, "
                f"{100 * v['diffs'][b][2]:+.2f}])"
                for b in v["losses"]
            )
        )
    return "; ".join(parts) + "."


def references_line(res: Served) -> str:
    full = max(res.task.budgets)
    parts = [
        f"{name}: {wilson_text(right)} at cost {res.task.full_cost:g}"
        for name, right in res.references.items()
    ]
    return (
        f"All-features references (same training rows): {'; '.join(parts)}; the served "
        f"{res.method} at budget {full:g}: {wilson_text(res.right[full])} at "
        f"{res.spent[full].mean():.2f}."
    )


def timing_line(res: Served) -> str:
    return (
        f"Build {res.build_seconds:.0f} s, serving {res.serve_seconds:.0f} s for "
        f"{res.requests} requests ({1000 * res.serve_seconds / max(res.requests, 1):.1f} ms "
        "per request through HTTP, Redis and the runtime, client in the same process)."
    )


def save(results: Sequence[Served], path: Path) -> None:
    import pickle

    path.write_bytes(pickle.dumps(list(results)))


def load(paths: Sequence[Path]) -> list[Served]:
    import pickle

    out: list[Served] = []
    for p in paths:
        out += pickle.loads(p.read_bytes())
    return out


# --------------------------------------------------------------------------------------------
# the data sets
# --------------------------------------------------------------------------------------------

UNIT = "unit cost per sensor, so a budget is a number of sensors"


def _subsample(x: FloatArray, y: Any, rows: int, seed: int = 0) -> tuple[FloatArray, Any]:
    from sklearn.model_selection import train_test_split

    if rows >= len(y):
        return x, y
    keep, _ = train_test_split(np.arange(len(y)), train_size=rows, stratify=y, random_state=seed)
    keep = np.sort(keep)
    return x[keep], y[keep]


def tasks(keys: Sequence[str], letter_rows: int = 10000) -> tuple[list[Task], list[str]]:
    """The tasks named by ``keys`` (letter, letter-16, letter-binary, letter-binary-16,
    letter-a, miniboone, pima) whose
    data are in ../shared/datasets, and a line per task left out."""
    from training.data.uci import (
        DATA,
        LETTER_NAMES,
        LETTER_SENSORS,
        PIMA_NAMES,
        PIMA_SENSORS,
        _read_letter,
        load_miniboone,
    )

    found: list[Task] = []
    skipped: list[str] = []
    letter = _read_letter(DATA)
    for key in keys:
        if key.startswith("letter"):
            if letter is None:
                skipped.append(f"{key}: ../shared/datasets/letter is missing")
                continue
            x, y = letter
            if key.startswith("letter-binary"):
                y = np.where(y >= "N", "N-Z", "A-M")
            elif key == "letter-a":
                y = np.where(y == "A", "A", "other")
            x, y = _subsample(x, y, letter_rows)
            order = [c for cols in LETTER_SENSORS.values() for c in cols]
            columns = [LETTER_NAMES[c] for c in order]
            sensors = {k: [LETTER_NAMES[c] for c in cols] for k, cols in LETTER_SENSORS.items()}
            budgets = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]
            grouping = (
                "the 16 attributes in 4 groups of 4 (box, ink, moments, edges, as the DAG "
                "benchmark)"
            )
            if key.endswith("-16"):  # the papers' setting: one sensor per attribute
                sensors = {c: [c] for c in columns}
                budgets = [1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0]
                grouping = "the 16 attributes, one each (papers 001's and 003's setting)"
            title = {
                "letter": "letter (26 classes)",
                "letter-binary": "letter binary (A–M vs N–Z)",
                "letter-binary-16": "letter binary (A–M vs N–Z), 16 single-attribute sensors",
                "letter-16": "letter (26 classes), 16 single-attribute sensors",
                "letter-a": "letter 'A' vs the rest",
            }[key]
            found.append(
                Task(
                    key,
                    title,
                    x[:, order],
                    y,
                    columns,
                    sensors,
                    dict.fromkeys(sensors, 1.0),
                    budgets,
                    setup=[
                        f"{len(y)} of the 20,000 rows (stratified sample, seed 0), split "
                        "60 / 20 / 20 % (train / validation / test, stratified, seed 0).",
                        f"Sensors: {grouping}, {UNIT}.",
                    ],
                )
            )
        elif key == "miniboone":
            mbne = load_miniboone(DATA)
            if mbne is None:
                skipped.append("miniboone: ../shared/datasets/miniboone-sample is missing")
                continue
            split = mbne[0][0]
            x = np.vstack([split.X_train, split.X_val, split.X_test])
            y = np.concatenate([split.y_train, split.y_val, split.y_test]).astype(str)
            columns = [f"f{i + 1}" for i in range(50)]
            sensors = {c: [c] for c in columns}
            found.append(
                Task(
                    key,
                    "MiniBooNE sample (50 single-feature sensors)",
                    x,
                    y,
                    columns,
                    sensors,
                    dict.fromkeys(sensors, 1.0),
                    [1.0, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0, 30.0, 50.0],
                    setup=[
                        f"mbne_tiny tr + tv + te pooled ({len(y)} rows without the -999 "
                        "sentinel), split 60 / 20 / 20 % (stratified, seed 0).",
                        f"Sensors: the 50 features, one each, {UNIT}.",
                    ],
                )
            )
        elif key == "pima":
            path = DATA / "pima" / "pima-indians-diabetes.csv"
            if not path.is_file():
                skipped.append(f"pima: {path} is missing")
                continue
            raw = np.loadtxt(path, delimiter=",")
            order = [c for cols in PIMA_SENSORS.values() for c in cols]
            columns = [PIMA_NAMES[c] for c in order]
            sensors = {k: [PIMA_NAMES[c] for c in cols] for k, cols in PIMA_SENSORS.items()}
            found.append(
                Task(
                    key,
                    "pima (binary)",
                    raw[:, order],
                    raw[:, 8].astype(int).astype(str),
                    columns,
                    sensors,
                    dict.fromkeys(sensors, 1.0),
                    [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0],
                    seeds=[0, 1, 2, 3, 4],
                    setup=[
                        "768 rows, split 60 / 20 / 20 % (stratified) with seeds 0–4; the "
                        "five test parts (154 rows each, overlapping) are pooled: 770 answers "
                        "per budget, not 770 independent rows.",
                        "Sensors: history (pregnancies, pedigree, age), exam (pressure, skin "
                        f"fold, BMI), glucose, insulin, as the DAG benchmark, {UNIT}.",
                    ],
                )
            )
        else:
            raise ValueError(f"unknown task {key!r}")
    return found, skipped


def render(
    name: str,
    title: str,
    intro: Sequence[str],
    results: Sequence[Served],
    skipped: Sequence[str],
    elapsed: float,
    label: str,
    extra: Callable[[Served], list[str]] | None = None,
) -> str:
    """The markdown report of one benchmark's served runs."""
    import os

    from benchmarks.report import machine, measured_at

    load = os.getloadavg()
    lines = [
        f"# {title}",
        "",
        f"Generated by `benchmarks/{name}.py --served` on {measured_at()}, {machine()}; "
        f"total {elapsed:.0f} s; load average at the end {load[0]:.1f} / {load[1]:.1f} / "
        f"{load[2]:.1f} (1 / 5 / 15 min; the machine is shared with other jobs).",
        "",
        *intro,
        "",
    ]
    if skipped:
        lines += ["Left out: " + "; ".join(skipped) + ".", ""]
    for res in results:
        task = res.task
        lines += [f"## {task.title}: {res.method}", ""]
        lines += [f"* {s}" for s in task.setup]
        lines += [f"* {n}" for n in res.notes]
        lines += [f"* {timing_line(res)}", ""]
        lines += table(res, label)
        intermediate = [b for b in task.budgets if 0 < b < task.full_cost]
        lines += ["", summary_line(res, intermediate), "", references_line(res), ""]
        if extra is not None:
            lines += extra(res)
    return "\n".join(lines) + "\n"


@dataclass
class Run:
    """One method on one task: the spec per (bundle name, seed), the builder, and options of
    :func:`run_method`."""

    task: Task
    method: str
    make_spec: Callable[[str, int], Any]
    build: Builder
    options: dict[str, Any] = field(default_factory=dict)


def write_report(
    name: str,
    title: str,
    label: str,
    runs: Sequence[Run],
    skipped: Sequence[str],
    out_dir: Path,
    extra: Callable[[Served], list[str]] | None = None,
) -> Path:
    """Run every :class:`Run` (one Redis, one temporary models folder, one thread per
    library) and write ``<name>_served.md`` into ``out_dir`` (the prose from
    ``benchmarks/templates/<name>_served.md``); the results are also pickled, after each run,
    to ``budgetserve-<name>_served.pickle`` in the system's temporary folder (to render
    again; never into the repository)."""
    from threadpoolctl import threadpool_limits

    from benchmarks.report import prose

    t0 = time.perf_counter()
    results = []
    with threadpool_limits(1), redis_server() as url, tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            results += run_method(
                run.task, run.method, run.make_spec, run.build, url, Path(tmp), **run.options
            )
            save(results, Path(tempfile.gettempdir()) / f"budgetserve-{name}_served.pickle")
    path = out_dir / f"{name}_served.md"
    text = render(
        name,
        title,
        prose(f"{name}_served"),
        results,
        skipped,
        time.perf_counter() - t0,
        label,
        extra,
    )
    path.write_text(text, encoding="utf-8")
    return path
