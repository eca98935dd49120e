"""``budgetserve-train``: profile extractor costs, build a bundle, evaluate it.

The module stays whole (over 450 lines): it is the one Typer app, each command a thin layer
(options, errors as usage errors, the result table) over its ``training`` package.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from service.bundle import CostPolynomial
from training.executor import Executor, ExecutorKind
from training.progress import StageProgress
from training.tables import Column, TableFormat, emit

if TYPE_CHECKING:
    from training.data.tabular import TabularSpec

S = TypeVar("S", bound="TabularSpec")
R = TypeVar("R")

app = typer.Typer(add_completion=False, help="Train and inspect budget-aware bundles.")
# Result tables are never cut to a terminal's width when written to a pipe or a file (rich
# would cut them to 80 columns there); on a terminal they fit it as usual.
console = Console(width=None if sys.stdout.isatty() else 10_000)
err_console = Console(stderr=True)
FormatOption = Annotated[
    TableFormat,
    typer.Option(
        "--format", help="table (never cut when piped), csv, json (raw numbers) or markdown"
    ),
]

# What the progress display calls each stage: the builders' stage keys, and the functions
# the sweeps map over an executor (training.progress).
STAGES = {
    "scan": "reading image headers",
    "extract": "extracting features",
    "expand": "expanding lattice",
    "profile": "profiling extractors",
    "evaluate": "evaluating",
    "_score_point": "sweeping cost trade-offs",
    "_fit_bank_member": "fitting the classifier bank",
    "_fit_task": "fitting gating configurations",
    "_fit_digits": "fitting cost-sensitive trees",
    "_fit_fixed_subset": "fitting fixed sensor subsets",
}

# Where a command's parallel training tasks run (docs/distributed-training.md): declare
# `executor: ExecutorOption = ExecutorKind.LOCAL, address: AddressOption = None,
# n_jobs: NJobsOption = None` and run the work inside `with open_executor(...) as ex:`.
ExecutorOption = Annotated[
    ExecutorKind,
    typer.Option(
        "--executor", help="where lattice expansions and sweeps run: local (joblib) or ray"
    ),
]
AddressOption = Annotated[
    str | None,
    typer.Option(
        "--address", help="Ray cluster to join (HEAD:6379); default: start a local Ray instance"
    ),
]
NJobsOption = Annotated[
    int | None,
    typer.Option(
        "--n-jobs",
        help="local: joblib workers (default 1: in this process; -1: every core); "
        "ray without --address: CPUs of the local instance",
    ),
]


def open_executor(executor: ExecutorKind, address: str | None, n_jobs: int | None) -> Executor:
    """The executor the options name (a context manager); bad combinations are usage errors."""
    from training.executor import make_executor

    try:
        return make_executor(executor, address=address, n_jobs=n_jobs)
    except (ValueError, RuntimeError) as exc:
        raise typer.BadParameter(str(exc)) from None


def _sides(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 8:
        raise typer.BadParameter(f"sides must be integers >= 8, got {text!r}")
    return values


def _cost_rows(
    costs: dict[str, CostPolynomial],
    quantile: float,
    before: dict[str, CostPolynomial] | None = None,
    title: str = "cost model",
) -> tuple[list[Column], list[dict[str, Any]], str]:
    """Each curve's coefficients with their units (power basis in n = pixels), its value at
    a few sides, and (``before``) the value at 128 px of the curve it replaces."""
    degree = max((len(c.coefficients) for c in costs.values()), default=1)
    units = ["ms", "ms/px", "ms/px²", "ms/px³"]
    terms = ["c0", "c1·n", *(f"c{i}·n^{i}" for i in range(2, degree))]
    number = "{:.3g}".format
    columns = [
        Column("extractor", "extractor"),
        *(
            Column(f"c{i} ({units[i] if i < len(units) else f'ms/px^{i}'})", f"c{i}", number)
            for i in range(degree)
        ),
        *(Column(f"c({s}²) ms", f"ms_at_{s}px", number) for s in (32, 128, 256)),
        *([Column("c(128²) before, ms", "ms_at_128px_before", number)] if before else []),
        Column("fit error", "fit_error", lambda v: "-" if v is None else f"{v:.3f}"),
    ]
    rows = []
    for name, cost in costs.items():
        coefficients = [*cost.coefficients, *([0.0] * (degree - len(cost.coefficients)))]
        row: dict[str, Any] = {"extractor": name, "fit_error": cost.fit_error}
        row.update({f"c{i}": c for i, c in enumerate(coefficients)})
        row.update({f"ms_at_{s}px": cost(s * s) for s in (32, 128, 256)})
        if before:
            row["ms_at_128px_before"] = before[name](128 * 128)
        rows.append(row)
    title = (
        f"{title}: c(n) = {' + '.join(terms[:degree])}, n = image pixels (side²), "
        f"{quantile:.0%} quantile of the measured times"
    )
    return columns, rows, title


@app.command()
def profile(
    sides: Annotated[
        str | None,
        typer.Option(
            help="image sides to time (default 16,32,64,128,256; with --into: the sides the "
            "bundle was profiled at)"
        ),
    ] = None,
    repeats: Annotated[int, typer.Option(min=3)] = 31,
    quantile: Annotated[float, typer.Option(min=0.5, max=1.0)] = 0.95,
    into: Annotated[
        Path | None,
        typer.Option(
            "--into",
            help="bundle folder: profile its extractors here and rewrite its cost curves "
            "(atomically; the bundle is loaded afterwards to check it)",
            exists=True,
            file_okay=False,
        ),
    ] = None,
    fmt: FormatOption = TableFormat.TABLE,
) -> None:
    """Time the extractors on this machine and print the fitted cost curves, with their
    basis and units; ``--into BUNDLE`` also writes them into a bundle (re-profiling on
    the serving machine)."""
    from training.bundles.digits import make_extractors, profile_costs

    labels = {"profile": "profiling extractors"}
    if into is None:
        with StageProgress(labels=labels) as bar:
            costs = profile_costs(
                make_extractors(),
                _sides(sides or "16,32,64,128,256"),
                repeats,
                quantile,
                progress=bar.update,
            )
        columns, rows, title = _cost_rows(costs, quantile)
        emit(console, columns, rows, fmt, title)
        return
    from training.reprofile import reprofile_bundle

    try:
        with StageProgress(labels=labels) as bar:
            done = reprofile_bundle(
                into, _sides(sides) if sides else None, repeats, quantile, progress=bar.update
            )
    except (ValueError, LookupError, OSError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--into") from None
    columns, rows, title = _cost_rows(
        done.after, quantile, before=done.before, title=f"{done.manifest.name} cost model"
    )
    emit(console, columns, rows, fmt, title)
    err_console.print(
        f"[bold]{done.manifest.name}[/] {done.manifest.version}: cost curves of "
        f"{len(done.after)} extractors rewritten in {into / 'manifest.json'} "
        f"(sides {','.join(map(str, done.sides))}), Poly-Dom candidates and index chosen "
        "again under them; the bundle loads"
    )


@app.command()
def build(
    out: Annotated[Path, typer.Option(help="bundle folder to write")] = Path("models/digits"),
    force: Annotated[bool, typer.Option(help="rebuild even if the bundle exists")] = False,
    epsilon: Annotated[float, typer.Option(min=0.0, max=1.0, help="accuracy slack")] = 0.02,
    delta: Annotated[float, typer.Option(min=0.0, max=1.0, help="monotonicity slack")] = 0.01,
    train_sides: Annotated[str, typer.Option()] = "16,24,32,48,64",
    profile_sides: Annotated[str, typer.Option()] = "16,32,64,96,128,192,256",
    repeats: Annotated[int, typer.Option(min=3)] = 31,
    seed: Annotated[int, typer.Option()] = 0,
    executor: ExecutorOption = ExecutorKind.LOCAL,
    address: AddressOption = None,
    n_jobs: NJobsOption = None,
) -> None:
    """Build the embedded digits bundle (Poly-Dom) from scikit-learn's digits."""
    from training.bundles.digits import BuildConfig, build_bundle

    if (out / "manifest.json").exists() and not force:
        console.print(f"{out} exists; pass --force to rebuild")
        raise typer.Exit(0)
    workers = open_executor(executor, address, n_jobs)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = BuildConfig(
        name=out.name,
        epsilon=epsilon,
        delta=delta,
        train_sides=_sides(train_sides),
        profile_sides=_sides(profile_sides),
        profile_repeats=repeats,
        seed=seed,
    )
    with workers, StageProgress(labels=STAGES) as bar:
        result = build_bundle(
            out, config, progress=bar.update, profile_progress=bar.update, executor=workers
        )
    stats = result.manifest.polydom().stats
    console.print(
        f"[bold]{result.manifest.name}[/] {result.manifest.version} written to {out}: "
        f"{int(stats.get('expansions', 0))} expansions of {2 ** len(config.extractors)} sets, "
        f"{len(result.manifest.polydom().candidates)} candidates, "
        f"max ONNX deviation {max(result.export_errors.values(), default=0.0):.2e}"
    )


@app.command()
def images(
    data: Annotated[
        Path,
        typer.Option(
            "--data",
            help="labelled image folder: one sub-folder per class (DIR/<class>/<image>), "
            "PNG, JPEG or WebP of any size",
        ),
    ],
    out: Annotated[Path, typer.Option(help="bundle folder to write (its name: the model's)")],
    test: Annotated[
        Path | None,
        typer.Option(
            "--test", help="held-out folder, same layout (default: hold out 20 % of --data)"
        ),
    ] = None,
    spec: Annotated[
        Path | None,
        typer.Option(
            "--spec",
            help="YAML or JSON: extractors (names, or name -> {plugin, params}), epsilon, "
            "delta, folds, C, budgets, ... (flags given override it)",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
    extractors: Annotated[
        str | None,
        typer.Option(
            help="comma-separated extractor plugins (default: every installed image extractor)"
        ),
    ] = None,
    budgets: Annotated[
        str | None, typer.Option(help="budgets (ms) of the held-out report (default: a grid)")
    ] = None,
    max_pixels: Annotated[
        int | None,
        typer.Option(help="largest image (width x height), here and when served; default 4096²"),
    ] = None,
    min_side: Annotated[int | None, typer.Option(help="smallest side accepted (default 8)")] = None,
    force: Annotated[bool, typer.Option(help="replace the bundle if it exists")] = False,
    fmt: FormatOption = TableFormat.TABLE,
    executor: ExecutorOption = ExecutorKind.LOCAL,
    address: AddressOption = None,
    n_jobs: NJobsOption = None,
) -> None:
    """Build a Poly-Dom bundle (with Greedy strategies) from your own labelled image folder:
    cost curves profiled on your images on this machine, every feature extracted once, a(F)
    cross-validated, and a report on held-out images through the serving loop: accuracy
    and cost per (size range, budget) next to the best fixed extractor set."""
    from training.bundles.folder import (
        FolderConfig,
        build_folder_bundle,
        parse_extractors,
        read_spec,
    )
    from training.data.image_folder import ImageFolderError

    if (out / "manifest.json").exists() and not force:
        err_console.print(f"{out} holds a bundle; pass --force to replace it")
        raise typer.Exit(1)
    try:
        settings = read_spec(spec) if spec is not None else {}
        settings["name"] = out.name
        if extractors is not None:
            settings["extractors"] = parse_extractors(extractors)
        if budgets is not None:
            settings["budgets"] = tuple(_budgets(budgets))
        if max_pixels is not None:
            settings["max_pixels"] = max_pixels
        if min_side is not None:
            settings["min_side"] = min_side
        config = FolderConfig(data=data, test=test, **settings)
        config.check()
        config.choices()
    except (ValueError, TypeError, LookupError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from None
    workers = open_executor(executor, address, n_jobs)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        with workers, StageProgress(labels=STAGES) as bar:
            result = build_folder_bundle(out, config, progress=bar.update, executor=workers)
    except (ImageFolderError, LookupError) as exc:  # LookupError: an extractor not installed
        err_console.print(
            f"[red]cannot build from this folder:[/] {exc}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(2) from None
    _images_report(result, out, fmt, time.perf_counter() - started)


def _images_report(result: Any, out: Path, fmt: TableFormat, seconds: float) -> None:
    from training.bundles.folder_report import describe_range

    data, manifest = result.data, result.build.manifest
    counts = data.train_folder.counts()
    err_console.print(
        f"{len(data.train)} training and {len(data.test)} held-out images, "
        f"{len(counts)} classes ({', '.join(f'{c}: {n}' for c, n in counts.items())}), "
        f"sizes {int(data.sizes.min())}–{int(data.sizes.max())} px; extractors "
        f"{', '.join(f.name for f in result.features)} ({result.channels})",
        highlight=False,
    )
    if data.duplicates:
        err_console.print(
            f"[yellow]note:[/] {data.duplicates} held-out images are byte-identical to training "
            "images (their accuracy is not held-out accuracy)",
            highlight=False,
        )
    rows = [
        {
            "sizes": describe_range(*r.sizes),
            "budget_ms": r.budget,
            "items": r.items,
            "accuracy": r.accuracy,
            "expected": r.expected,
            "mean_spent_ms": r.mean_spent,
            "p95_spent_ms": r.p95_spent,
            "overrun_rate": r.overrun_rate,
            "fixed_set": r.fixed_set,
            "fixed_accuracy": r.fixed_accuracy,
            "fixed_cost_ms": r.fixed_cost,
        }
        for r in result.evaluation
    ]
    columns = [
        Column("size", "sizes"),
        Column("budget ms", "budget_ms", lambda v: f"{v:g}"),
        Column("items", "items"),
        Column("accuracy", "accuracy", lambda v: f"{v:.3f}"),
        Column("a(F)", "expected", lambda v: f"{v:.3f}"),
        Column("mean spent", "mean_spent_ms", lambda v: f"{v:.2f}"),
        Column("p95 spent", "p95_spent_ms", lambda v: f"{v:.2f}"),
        Column("over budget", "overrun_rate", lambda v: f"{v:.1%}"),
        Column("best fixed set", "fixed_set"),
        Column("its accuracy", "fixed_accuracy", lambda v: f"{v:.3f}"),
        Column("its cost ms", "fixed_cost_ms", lambda v: f"{v:.2f}"),
    ]
    emit(
        console,
        columns,
        rows,
        fmt,
        f"{manifest.name}: {manifest.strategies[0].name} on {len(data.test)} held-out images "
        "(served loop, measured times; best fixed set: highest a(F) whose cost at the range's "
        "largest size fits)",
    )
    stats = manifest.polydom().stats
    err_console.print(
        f"[bold]{manifest.name}[/] {manifest.version} written to {out} in {seconds:.0f} s "
        f"({', '.join(f'{k} {v:.0f} s' for k, v in result.seconds.items())}): "
        f"{int(stats.get('expansions', 0))} of {2 ** len(result.features)} sets expanded, "
        f"{len(manifest.polydom().candidates)} candidates, {len(manifest.models)} models",
        highlight=False,
    )


def _budgets(text: str) -> list[float]:
    try:
        values = [float(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise typer.BadParameter(f"budgets must be numbers > 0, got {text!r}")
    return values


def _strategies(text: str, available: list[str]) -> list[str]:
    if text == "all":
        return available
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in available]
    if unknown or not names:
        raise typer.BadParameter(f"unknown strategies {unknown}; available: {available}")
    return names


def _evaluate(bundle: Path, sides: str, budgets: str, strategies: str, count: int) -> list[Any]:
    from training.evaluate import evaluate_bundle, load

    loaded = load(bundle)
    names = _strategies(strategies, [s.name for s in loaded.manifest.strategies])
    side_values, budget_values = _sides(sides), _budgets(budgets)
    points = []
    total = len(side_values) * len(budget_values) * len(names)
    with StageProgress(labels=STAGES) as bar:
        bar.update("evaluate", 0, total)
        for p in evaluate_bundle(loaded, side_values, budget_values, strategies=names, count=count):
            points.append(p)
            bar.update("evaluate", len(points), total)
    return points


EVALUATE_COLUMNS = (
    Column("side", "side"),
    Column("budget ms", "budget_ms", lambda v: f"{v:g}"),
    Column("strategy", "strategy"),
    Column("accuracy", "accuracy", lambda v: f"{v:.3f}"),
    Column("expected", "expected_accuracy", lambda v: f"{v:.3f}"),
    Column("mean spent", "mean_spent_ms", lambda v: f"{v:.2f}"),
    Column("p95 spent", "p95_spent_ms", lambda v: f"{v:.2f}"),
    Column("over budget", "overrun_rate", lambda v: f"{v:.1%}"),
    Column("items", "n"),
)


@app.command()
def evaluate(
    bundle: Annotated[Path, typer.Option(help="bundle folder")] = Path("models/digits"),
    sides: Annotated[str, typer.Option()] = "16,64,128,256",
    budgets: Annotated[str, typer.Option(help="budgets in ms")] = "0.6,1,2,5,20",
    strategies: Annotated[str, typer.Option(help="comma-separated, or 'all'")] = "all",
    count: Annotated[int, typer.Option(min=10)] = 200,
    fmt: FormatOption = TableFormat.TABLE,
) -> None:
    """Accuracy, spent cost and overrun rate at (size, budget) points, on held-out digits,
    through the serving code path (live calibration off: the bundle's own cost model)."""
    points = _evaluate(bundle, sides, budgets, strategies, count)
    rows = [
        {
            "side": p.side,
            "budget_ms": p.budget,
            "strategy": p.strategy,
            "accuracy": p.accuracy,
            "expected_accuracy": p.expected_accuracy,
            "mean_spent_ms": p.mean_spent,
            "p95_spent_ms": p.p95_spent,
            "overrun_rate": p.overrun_rate,
            "n": p.n,
        }
        for p in points
    ]
    emit(console, EVALUATE_COLUMNS, rows, fmt, f"{bundle.name} on {count} held-out digits")


@app.command()
def plot(
    bundle: Annotated[Path, typer.Option(help="bundle folder")] = Path("models/digits"),
    out: Annotated[Path, typer.Option(help="folder for the PNG and markdown")] = Path(
        "docs/benchmarks"
    ),
    sides: Annotated[str, typer.Option()] = "32,128,256",
    budgets: Annotated[str, typer.Option()] = "0.6,0.8,1,1.5,2,3,5,8,12,20",
    strategies: Annotated[str, typer.Option(help="comma-separated, or 'all'")] = "all",
    count: Annotated[int, typer.Option(min=10)] = 200,
) -> None:
    """Accuracy vs budget at several sizes, per strategy: a PNG plot and a markdown table."""
    from training.plots import write_strategy_report

    points = _evaluate(bundle, sides, budgets, strategies, count)
    png, md = write_strategy_report(points, out, bundle.name, count)
    console.print(f"wrote {png} and {md}")


CsvOption = Annotated[
    Path, typer.Option("--csv", help="data, one row per item", exists=True, dir_okay=False)
]
SpecOption = Annotated[
    Path,
    typer.Option(
        "--spec",
        help="the spec: label, sensors, costs, ... (JSON or YAML)",
        exists=True,
        dir_okay=False,
    ),
]
OutOption = Annotated[Path | None, typer.Option(help="bundle folder (default models/<name>)")]
DelimiterOption = Annotated[
    str | None,
    typer.Option(
        help="the CSV's delimiter: one character (',', ';', '\\t' for tab) or 'whitespace'; "
        "default: the spec's `delimiter`, else detected",
    ),
]


def _build_tabular(
    load: Callable[[Path], S],
    csv_path: Path,
    spec_path: Path,
    out: Path | None,
    workers: Executor,
    status: Callable[[S, int], str],
    build: Callable[..., R],
    delimiter: str | None = None,
) -> tuple[S, R, Path]:
    """Read a spec and its CSV, build the bundle into ``out`` (default models/<name>) on the
    executor; bad specs, data or export checks end the command with what was wrong."""
    from training.bundles.cstc import CstcExportMismatch
    from training.data.tabular import read_csv
    from training.export.dag import DagExportMismatch
    from training.export.gating import GatingExportMismatch

    try:
        spec = load(spec_path)
        if delimiter is not None:
            spec.delimiter = delimiter
            spec.check()
        x, y, columns = read_csv(csv_path, spec)
    except (ValueError, TypeError) as exc:
        raise typer.BadParameter(str(exc)) from None
    target = out or Path("models") / spec.name
    target.parent.mkdir(parents=True, exist_ok=True)
    console.print(f"{status(spec, len(y))} ({workers.describe()})", highlight=False)
    with workers, StageProgress(labels=STAGES) as bar:
        workers.progress = bar.executor_hook
        try:
            result = build(target, spec, x, y, columns, executor=workers)
        except ValueError as exc:  # e.g. too few rows of a class to split or cross-validate
            raise typer.BadParameter(f"cannot build the bundle: {exc}") from None
        except (DagExportMismatch, GatingExportMismatch, CstcExportMismatch) as exc:
            console.print(f"[red]export check failed, nothing written:[/] {exc}")
            raise typer.Exit(1) from None
    return spec, result, target


def _print_fixed(manifest: Any, unit: str) -> None:
    """The best fixed sensor subsets a tabular bundle carries beside its adaptive points."""
    strategy = manifest.strategy()
    fixed = getattr(strategy, "fixed", [])
    if not fixed:
        return
    cost = {e.name: e.cost(1) for e in manifest.extractors}
    table = Table(
        "fixed subset",
        "cost",
        "val accuracy",
        "model",
        title=f"{manifest.name}: best fixed sensor subsets (costs in {unit}; chosen between "
        "with the points above by validation accuracy)",
    )
    for point in fixed:
        features = manifest.model(point.model).features
        table.add_row(
            "+".join(features) or "(none: the prior)",
            f"{sum(cost[f] for f in features):g}",
            f"{point.accuracy:.3f}",
            point.learner,
        )
    console.print(table)


@app.command()
def dag(
    csv_path: CsvOption,
    spec_path: SpecOption,
    out: OutOption = None,
    delimiter: DelimiterOption = None,
    executor: ExecutorOption = ExecutorKind.LOCAL,
    address: AddressOption = None,
    n_jobs: NJobsOption = None,
) -> None:
    """Build a DAG bundle (adaptive sensor acquisition, paper 000) from a CSV and a spec.

    The spec names the label column, the sensors (name -> columns), their costs in `unit`,
    the cost trade-offs to sweep (`cost_scales`) and, for many sensors, `n_subsets` (Alg. 2)
    or `groups: chain` (the best fixed subsets' greedy chain, in steps).
    """
    from training.bundles.dag import DagSpec, build_dag_bundle

    spec, result, target = _build_tabular(
        DagSpec.load,
        csv_path,
        spec_path,
        out,
        open_executor(executor, address, n_jobs),
        lambda spec, rows: (
            f"training {len(spec.cost_scales)} operating points"
            + (
                f" and up to {spec.refine_scales} more where costs jump"
                if spec.refine_scales
                else ""
            )
            + f" on {rows} rows"
        ),
        build_dag_bundle,
        delimiter,
    )
    table = Table(
        "cost scale",
        "val cost",
        "val error",
        "test cost",
        "test error",
        title=f"{spec.name}: DAG operating points ({spec.unit})",
    )
    for p in result.points:
        table.add_row(
            f"{p['cost_scale']:g}",
            f"{p['validation_cost']:.2f}",
            f"{p['validation_error']:.3f}",
            f"{p['test_cost']:.2f}",
            f"{p['test_error']:.3f}",
        )
    console.print(table)
    _print_fixed(result.manifest, spec.unit)
    console.print(f"[bold]{spec.name}[/] {result.manifest.version} written to {target}")


@app.command()
def ocr(
    data: Annotated[
        Path,
        typer.Option(
            "--data",
            help="ocr-letters.npz of the shared datasets, or a folder of word PNGs with "
            "labels.tsv (FILE<TAB>WORD[<TAB>FOLD]; 16 px high, 8 px per letter, white ink)",
        ),
    ] = Path("../shared/datasets/ocr-letters/ocr-letters.npz"),
    out: Annotated[Path, typer.Option("--out", help="bundle folder")] = Path("models/ocr"),
    chain_words: Annotated[
        int | None,
        typer.Option("--chain-words", help="training words the chain is fitted on (all: omit)"),
    ] = None,
    policy_words: Annotated[
        int | None,
        typer.Option("--policy-words", help="training words the policies learn on (all: omit)"),
    ] = None,
    max_iter: Annotated[
        int, typer.Option("--max-iter", help="iterations of the emission regressions")
    ] = 150,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Build the OCR bundle (budgeted structured prediction, paper 004): measured template
    costs, a linear chain over letters, one-shot and anytime policies (cross-fitted)."""
    from training.bundles.ocr import build_ocr_bundle

    try:
        report = build_ocr_bundle(
            out,
            data,
            chain_words=chain_words,
            policy_words=policy_words,
            max_iter=max_iter,
            seed=seed,
            log=console.print,
        )
    except FileNotFoundError as exc:
        raise typer.BadParameter(str(exc), param_hint="--data") from None
    console.print(f"parity (max relative error): {report.parity}")
    console.print(f"[bold]ocr[/] written to {report.out}: {report.summary}")


@app.command()
def gating(
    csv_path: CsvOption,
    spec_path: SpecOption,
    out: OutOption = None,
    delimiter: DelimiterOption = None,
    executor: ExecutorOption = ExecutorKind.LOCAL,
    address: AddressOption = None,
    n_jobs: NJobsOption = None,
) -> None:
    """Build a gating bundle (ADAPT-GBRT, ADAPT-LIN, L1 baseline, GreedyMiser; paper 001).

    The spec names the label column, the features (`sensors`: a list of columns, or sensors
    of one or more columns, each paid once), their costs in `unit`, and optionally `methods`,
    `f0` (lightgbm | lightgbm-tuned | random-forest | rbf-svm), an explicit `grid` of
    {method, p_full, regularisation}, `confidence` (f1's confidence as a gate), `fixed` (the
    fixed-subset search, or false) and the serving `tolerance`.
    """
    from training.bundles.gating import GatingSpec, build_gating_bundle

    spec, result, target = _build_tabular(
        GatingSpec.load,
        csv_path,
        spec_path,
        out,
        open_executor(executor, address, n_jobs),
        lambda spec, rows: f"sweeping {len(spec.configs())} configurations on {rows} rows",
        build_gating_bundle,
        delimiter,
    )
    strategy = result.manifest.strategy("gating")
    table = Table(
        "operating point",
        "accuracy",
        "average cost",
        "sent on",
        "to",
        title=f"{spec.name}: gating points (chosen and measured on validation rows, in "
        f"{spec.unit}; test rows: the provenance's sweep)",
    )
    for point in getattr(strategy, "points", []):
        table.add_row(
            point.id,
            f"{point.accuracy:.3f}",
            f"{point.mean_cost:.2f}",
            f"{point.fraction_full:.0%}",
            point.high_model if point.gate_file else "",
        )
    console.print(table)
    _print_fixed(result.manifest, spec.unit)
    console.print(f"[bold]{spec.name}[/] {result.manifest.version} written to {target}")


@app.command()
def cstc(
    csv_path: CsvOption,
    spec_path: SpecOption,
    out: OutOption = None,
    cascade: Annotated[
        bool, typer.Option("--cascade", help="train cascades (CSCC and Cronus) instead of trees")
    ] = False,
    delimiter: DelimiterOption = None,
    executor: ExecutorOption = ExecutorKind.LOCAL,
    address: AddressOption = None,
    n_jobs: NJobsOption = None,
) -> None:
    """Build a cost-sensitive tree (CSTC) or cascade (CSCC, Cronus) bundle (paper 003).

    The spec names the label column, the sensors (name -> columns; each is read at its cost
    in `unit`), and optionally `methods` (cstc, cscc, cronus, root-only), `lambdas`, `depth`,
    `sharpness`, `rho`, `class_weight` and the serving `tolerance`.
    """
    from training.bundles.cstc import CstcSpec, build_cstc_bundle

    def load(path: Path) -> CstcSpec:
        spec = CstcSpec.load(path)
        if cascade:
            spec.cascade = True
            if spec.methods is None or spec.methods == ["cstc", "root-only"]:
                spec.methods = None
            spec.check()
        return spec

    spec, result, target = _build_tabular(
        load,
        csv_path,
        spec_path,
        out,
        open_executor(executor, address, n_jobs),
        lambda spec, rows: (
            f"training {len(spec.chosen_methods()) * len(spec.lambdas)} trees on {rows} rows"
        ),
        build_cstc_bundle,
        delimiter,
    )
    table = Table(
        "operating point",
        "nodes",
        "val accuracy",
        "val cost",
        "test accuracy",
        "test cost",
        "kept",
        title=f"{spec.name}: cost-sensitive trees (costs in {spec.unit}; kept: validation "
        "Pareto set)",
    )
    kept = {p.id for p in getattr(result.manifest.strategy("cstc"), "points", [])}
    for p in result.points:
        table.add_row(
            p["id"],
            str(p["nodes"]),
            f"{p['validation_accuracy']:.3f}",
            f"{p['validation_cost']:.2f}",
            f"{p['test_accuracy']:.3f}",
            f"{p['test_cost']:.2f}",
            "yes" if p["id"] in kept else "",
        )
    console.print(table)
    _print_fixed(result.manifest, spec.unit)
    console.print(f"[bold]{spec.name}[/] {result.manifest.version} written to {target}")


# The trees' options of cstc-digits and cstc-images.
MethodsOption = Annotated[str, typer.Option(help="cstc, cscc, cronus, root-only")]
LambdasOption = Annotated[str, typer.Option(help="cost trade-offs λ (costs normalised to mean 1)")]
DepthOption = Annotated[int, typer.Option(min=1, max=8)]
RoundsOption = Annotated[int, typer.Option(min=0, help="coordinate-descent rounds")]


@app.command("cstc-digits")
def cstc_digits(
    out: Annotated[Path, typer.Option(help="bundle folder to write")] = Path("models/digits-cstc"),
    costs_from: Annotated[
        Path,
        typer.Option(
            "--costs-from",
            help="bundle whose measured cost curves the sensors use (the Poly-Dom digits "
            "bundle, so both charge the same)",
        ),
    ] = Path("models/digits"),
    sides: Annotated[str, typer.Option(help="every digit is rendered at each side")] = (
        "16,32,64,128"
    ),
    methods: MethodsOption = "cstc,cscc,root-only",
    lambdas: LambdasOption = "0.3,1,1.5,2,3,10",
    depth: DepthOption = 3,
    n_rounds: RoundsOption = 1,
    limit: Annotated[int | None, typer.Option(help="source digits used (default: all)")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    executor: ExecutorOption = ExecutorKind.LOCAL,
    address: AddressOption = None,
    n_jobs: NJobsOption = None,
) -> None:
    """Build a CSTC / CSCC bundle (paper 003) for the digits on the image extractors: the
    feature groups of the digits bundle as sensors at their measured cost c_f(n), digits
    rendered at every side, held out by identity (the digits bundle's split)."""
    from training.bundles.cstc_digits import (
        CstcDigitsConfig,
        build_cstc_digits_bundle,
        costs_from_bundle,
    )

    try:
        config = CstcDigitsConfig(
            name=out.name,
            sides=_sides(sides),
            methods=tuple(m.strip() for m in methods.split(",") if m.strip()),
            lambdas=tuple(float(v) for v in lambdas.split(",") if v.strip()),
            depth=depth,
            n_rounds=n_rounds,
            limit=limit,
            seed=seed,
        )
        config.check()
        costs = costs_from_bundle(costs_from, config.extractors)
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from None
    workers = open_executor(executor, address, n_jobs)
    out.parent.mkdir(parents=True, exist_ok=True)
    console.print(
        f"training {len(config.methods) * len(config.lambdas)} trees on digits at sides "
        f"{sides} ({workers.describe()})",
        highlight=False,
    )
    with workers, StageProgress(labels=STAGES) as bar:
        workers.progress = bar.executor_hook
        result = build_cstc_digits_bundle(out, config, costs, executor=workers, progress=bar.update)
    _cstc_image_table(
        result,
        f"{config.name}: cost-sensitive trees on the image extractors "
        "(test: held-out digits; kept: validation Pareto set)",
    )
    console.print(f"[bold]{config.name}[/] {result.manifest.version} written to {out}")


def _cstc_image_table(result: Any, title: str) -> None:
    table = Table(
        "operating point",
        "nodes",
        "val accuracy",
        "val cost ms",
        "test accuracy",
        "test cost ms",
        "kept",
        title=title,
    )
    kept = set(result.estimators)
    for p in result.points:
        table.add_row(
            p["id"],
            str(p["nodes"]),
            f"{p['validation_accuracy']:.3f}",
            f"{p['validation_cost']:.3f}",
            f"{p['test_accuracy']:.3f}",
            f"{p['test_cost']:.3f}",
            "yes" if p["id"] in kept else "",
        )
    console.print(table)


@app.command("cstc-images")
def cstc_images(
    data: Annotated[
        Path,
        typer.Option("--data", help="labelled image folder (DIR/<class>/<image>), as for images"),
    ],
    out: Annotated[Path, typer.Option(help="bundle folder to write (its name: the model's)")],
    test: Annotated[
        Path | None, typer.Option("--test", help="held-out folder (default: 20 % of --data)")
    ] = None,
    costs_from: Annotated[
        Path | None,
        typer.Option(
            "--costs-from",
            help="bundle whose cost curves the sensors use (e.g. the Poly-Dom bundle of the "
            "same folder, so both charge the same); default: profile on the folder's images",
        ),
    ] = None,
    extractors: Annotated[
        str | None,
        typer.Option(help="comma-separated extractor plugins (default: every installed one)"),
    ] = None,
    methods: MethodsOption = "cstc,cscc,root-only",
    lambdas: LambdasOption = "0.3,1,1.5,2,3,10",
    depth: DepthOption = 3,
    n_rounds: RoundsOption = 1,
    max_pixels: Annotated[int | None, typer.Option(help="largest image (default 4096²)")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    executor: ExecutorOption = ExecutorKind.LOCAL,
    address: AddressOption = None,
    n_jobs: NJobsOption = None,
) -> None:
    """Build a CSTC / CSCC bundle (paper 003) from your own labelled image folder: the
    image extractors as sensors at their cost curves c_f(n), every image once at its own
    size, held out as `images` holds it out."""
    from training.bundles.cstc_digits import CstcImageConfig
    from training.bundles.cstc_folder import build_cstc_folder_bundle
    from training.bundles.folder import FolderConfig, parse_extractors
    from training.data.image_folder import ImageFolderError

    try:
        folder = FolderConfig(
            data=data,
            test=test,
            name=out.name,
            seed=seed,
            extractors=parse_extractors(extractors) if extractors else None,
        )
        if max_pixels:
            folder.max_pixels = max_pixels
        folder.check()
        trees = CstcImageConfig(
            methods=tuple(m.strip() for m in methods.split(",") if m.strip()),
            lambdas=tuple(float(v) for v in lambdas.split(",") if v.strip()),
            depth=depth,
            n_rounds=n_rounds,
        )
        trees.check()
    except (ValueError, LookupError) as exc:
        raise typer.BadParameter(str(exc)) from None
    workers = open_executor(executor, address, n_jobs)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with workers, StageProgress(labels=STAGES) as bar:
            workers.progress = bar.executor_hook
            result = build_cstc_folder_bundle(
                out, folder, trees, costs_from=costs_from, progress=bar.update, executor=workers
            )
    except (ImageFolderError, LookupError) as exc:
        err_console.print(
            f"[red]cannot build from this folder:[/] {exc}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(2) from None
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from None
    _cstc_image_table(
        result,
        f"{out.name}: cost-sensitive trees on the image extractors (test: held-out images; "
        "kept: validation Pareto set)",
    )
    console.print(f"[bold]{out.name}[/] {result.manifest.version} written to {out}")


@app.command()
def parser(
    out: Annotated[Path, typer.Option(help="bundle folder to (re)write")] = Path(
        "models/ewt-parser"
    ),
    data_dir: Annotated[
        Path, typer.Option(help="folder of en_ewt-ud-{train,dev,test}.conllu.gz")
    ] = Path("../shared/datasets/ud-english-ewt"),
    epochs: Annotated[int, typer.Option(min=1, help="perceptron epochs")] = 5,
    train_limit: Annotated[
        int | None, typer.Option(min=1, help="train on the first N sentences only")
    ] = None,
    max_tokens: Annotated[int, typer.Option(min=2, max=400, help="longest sentence")] = 120,
    buckets: Annotated[int, typer.Option(min=2, help="hashed weights (a power of two)")] = 1 << 20,
    policy_sentences: Annotated[
        int, typer.Option(min=1, help="dev sentences the policies learn from (the rest measure)")
    ] = 1500,
    seed: Annotated[int, typer.Option()] = 0,
    weights: Annotated[
        Path | None,
        typer.Option(
            help="reuse trained edge weights (an earlier build's weights.npy) instead of "
            "training; the policies are still learned"
        ),
    ] = None,
    train: Annotated[
        Path | None,
        typer.Option(
            "--train", help="any CoNLL-U training file, plain or .gz (default: EWT's, --data-dir)"
        ),
    ] = None,
    dev: Annotated[
        Path | None,
        typer.Option("--dev", help="any CoNLL-U development file (policies and points)"),
    ] = None,
    length_filter: Annotated[
        bool,
        typer.Option(
            "--length-filter/--no-length-filter",
            help="never score arcs longer than training saw for their head tag, dependent "
            "tag and direction (the length dictionary of the paper's [7, 13])",
        ),
    ] = False,
    anytime_steps: Annotated[
        int, typer.Option(min=1, help="anytime per-step policies (Alg. 1)")
    ] = 20,
    tagger: Annotated[
        bool,
        typer.Option(
            "--tagger/--no-tagger",
            help="carry a POS tagger trained on the training sentences, so a request may send "
            "tokens without 'upos' (tagged while decoding, its time charged)",
        ),
    ] = True,
    predicted_tags: Annotated[
        bool,
        typer.Option(
            "--predicted-tags/--gold-tags",
            help="train the parser on tags the tagger predicts (jackknifed over 4 folds of the "
            "training sentences), for clients that send raw tokens, instead of the gold tags",
        ),
    ] = False,
) -> None:
    """Build the dependency-parser bundle (paper 004, parsing) from a UD treebank (EWT by
    default, or any CoNLL-U files with --train/--dev): the arc-factored parser over random
    template states, one-shot, anytime, myopic and uniform policies choosing ψ^POS or
    ψ^Full per word."""
    from training.parsing.bundle import ParserBuildConfig, build_parser_bundle

    if buckets & (buckets - 1):
        raise typer.BadParameter(f"--buckets must be a power of two, got {buckets}")
    config = ParserBuildConfig(
        name=out.name,
        data_dir=data_dir,
        epochs=epochs,
        train_limit=train_limit,
        max_tokens=max_tokens,
        buckets=buckets,
        policy_sentences=policy_sentences,
        seed=seed,
        weights=weights,
        train_file=train,
        dev_file=dev,
        length_filter=length_filter,
        anytime_steps=anytime_steps,
        tagger=tagger,
        predicted_tags=predicted_tags,
    )
    try:
        evaluation = build_parser_bundle(out, config, log=console.print)
    except (FileNotFoundError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    table = Table("strategy", "point", "dev UAS", "ψ^Full share")
    for name, points in evaluation["points"].items():
        for point in points:
            table.add_row(name, point["id"], f"{point['uas']:.4f}", f"{point['full_fraction']:.3f}")
    console.print(table)
    console.print(f"[bold]{out.name}[/] written to {out}")


@app.command()
def sample(
    side: Annotated[int, typer.Option(min=8, max=2048, help="image side in pixels")] = 64,
    index: Annotated[int, typer.Option(min=0, max=1796, help="which scikit-learn digit")] = 0,
    budget: Annotated[float, typer.Option(min=0.001, help="budget in ms (> 0)")] = 5.0,
    model: Annotated[str, typer.Option()] = "digits",
    item_id: Annotated[
        str | None,
        typer.Option("--id", help="item id: folded into the content cache key (keeps items apart)"),
    ] = None,
) -> None:
    """Print a POST /predict body for one rendered digit (for curl and the README tour)."""
    import base64
    import json

    from training.data.digits import digits_source, render_digit, to_png

    images, labels = digits_source()
    png = to_png(render_digit(images[index], side))
    item: dict[str, str] = {"png_base64": base64.b64encode(png).decode()}
    if item_id is not None:
        item["id"] = item_id
    typer.echo(json.dumps({"model": model, "item": item, "budget": budget}))
    typer.echo(f"digit {index} is a {labels[index]}, rendered at {side}x{side}", err=True)


if __name__ == "__main__":
    app()
