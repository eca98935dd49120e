"""What every benchmark report shares: where reports go, the "measured on" line, and the prose.

The prose of a report (its title, what was measured and how, how to read it) is Markdown in
``benchmarks/templates/<name>.md``, beside the code; ``${name}`` placeholders are the numbers and
settings the benchmark fills in (:class:`string.Template` syntax, ``$$`` for a dollar sign), and
``<!-- part: NAME -->`` lines separate the prose that goes between or after the tables. The
tables and plots stay in the benchmark's module, which puts them between the rendered parts.
"""

from __future__ import annotations

import math
import os
import platform
import re
import time
from pathlib import Path
from string import Template

ROOT = Path(__file__).resolve().parents[1]
#: Where every report is written (``docs/benchmarks/`` of the checkout).
OUT = ROOT / "docs" / "benchmarks"
TEMPLATES = Path(__file__).resolve().parent / "templates"


def measured_at() -> str:
    """Now, as the reports print it: ``2026-11-22 16:21 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def machine() -> str:
    """The platform and CPU count, as the reports print them."""
    return f"{platform.platform()} ({os.cpu_count()} CPUs)"


PART = re.compile(r"^<!-- part: ([\w-]+) -->\n", re.MULTILINE)


def prose(name: str, part: str = "intro", /, **values: object) -> list[str]:
    """One part of the template ``benchmarks/templates/<name>.md`` with ``values`` filled in, as
    lines (its final newline dropped, so that a report's tables can follow). A template's first
    part is ``intro``; a line ``<!-- part: NAME -->`` starts the next one (the prose that goes
    after a table). A placeholder without a value raises ``KeyError`` naming it."""
    text = (TEMPLATES / f"{name}.md").read_text(encoding="utf-8")
    pieces = PART.split(text)
    parts = {"intro": pieces[0], **dict(zip(pieces[1::2], pieces[2::2], strict=True))}
    if part not in parts:
        raise KeyError(f"template {name}.md has no part {part!r}; it has {sorted(parts)}")
    filled = Template(parts[part]).substitute({k: str(v) for k, v in values.items()})
    return filled.removesuffix("\n").split("\n")


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95 % by default)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))
