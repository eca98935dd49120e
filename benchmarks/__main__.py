"""``make bench``: every benchmark, each writing its markdown file to docs/benchmarks/.

``python -m benchmarks`` runs them in this order; ``python -m benchmarks.<name>`` runs one. The
executor benchmark (``python -m benchmarks.executor``) is not part of the run: it compares
executors (and may need a Ray cluster), see docs/distributed-training.md.
"""

from __future__ import annotations

import time

from rich.console import Console

console = Console()


def main() -> None:
    from benchmarks import (
        anytime,
        batch,
        calibration,
        cstc,
        cstc_digits,
        cstc_side_by_side,
        dag,
        digits,
        extractors,
        fixed_server,
        gating,
        image_folder,
        libraries,
        ocr,
        parsing,
        polydom,
        service,
        tabular_gaps,
    )

    for name, run in (
        ("extractors", lambda: extractors.main()),
        ("polydom", lambda: polydom.main()),
        ("digits", digits.digits_report),
        ("strategies", digits.strategies_report),
        ("anytime (synthetic)", lambda: anytime.main()),
        ("calibration", lambda: calibration.main()),
        ("dag", lambda: dag.main()),
        ("dag served", lambda: dag.served_main()),
        ("gating", lambda: gating.main()),
        ("gating served", lambda: gating.served_main()),
        # the documented run (docs/benchmarks/ocr.md, README): every training word, the
        # paper's 90 % (about 20 min of training on the shared machine)
        ("ocr (structured)", lambda: ocr.main([])),
        ("cstc", lambda: cstc.main([])),
        ("cstc served", lambda: cstc.served_main()),
        ("tabular gaps (pima, 10 % blank)", lambda: tabular_gaps.main([])),
        ("cstc (digits)", lambda: cstc_digits.main([])),
        ("image folder (your own images)", lambda: image_folder.main([])),
        ("cstc side by side (MiniBooNE)", lambda: cstc_side_by_side.main([])),
        ("parsing", lambda: parsing.main([])),
        # "before": the request path before issue 24's lean one
        ("service", lambda: service.main(options=service.Options(before="eec268a"))),
        ("fixed server", lambda: fixed_server.main()),
        ("batch", lambda: batch.main()),
        ("libraries (feature cache LRU)", lambda: libraries.main()),
    ):
        t0 = time.perf_counter()
        run()
        console.print(f"[bold]{name}[/] done ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
