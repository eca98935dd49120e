"""Benchmarks: one module per benchmark, each writing its report to ``docs/benchmarks/``.

Outside the wheel (``pyproject.toml`` packages only ``service`` and ``training``); run from a
checkout: ``python -m benchmarks`` (``make bench``) runs them all, ``python -m benchmarks.<name>``
one of them. The prose of each report lives in ``benchmarks/templates/<name>.md``, next to the
code that fills in its numbers (:mod:`benchmarks.report`).
"""
