"""Tables of the CLI in four formats: a rich table (``table``), ``csv``, ``json`` and
``markdown``. JSON keeps the raw values; the others format them per column.

A ``table`` written anywhere but a terminal (a pipe, a file) is never cut to the terminal's
width: it is as wide as its content.
"""

from __future__ import annotations

import csv
import enum
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table


class TableFormat(enum.StrEnum):
    TABLE = "table"
    CSV = "csv"
    JSON = "json"
    MARKDOWN = "markdown"


@dataclass(frozen=True)
class Column:
    header: str
    key: str
    text: Callable[[Any], str] = str


def render(
    columns: Sequence[Column],
    rows: Sequence[dict[str, Any]],
    fmt: TableFormat,
    title: str = "",
) -> str:
    """``rows`` (dicts holding every column's ``key``) as text in ``fmt``."""
    if fmt is TableFormat.JSON:
        return json.dumps([{c.key: row[c.key] for c in columns} for row in rows], indent=2)
    cells = [[c.text(row[c.key]) for c in columns] for row in rows]
    if fmt is TableFormat.CSV:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([c.header for c in columns])
        writer.writerows(cells)
        return out.getvalue().rstrip("\n")
    if fmt is TableFormat.MARKDOWN:
        lines = [f"**{title}**", ""] if title else []
        lines.append("| " + " | ".join(c.header for c in columns) + " |")
        lines.append("|" + "|".join("---" for _ in columns) + "|")
        lines.extend("| " + " | ".join(r) + " |" for r in cells)
        return "\n".join(lines)
    table = Table(*(c.header for c in columns), title=title or None)
    for r in cells:
        table.add_row(*r)
    # Rendered at a width no table reaches, then trimmed: never cut, never wrapped.
    console = Console(width=10_000, file=io.StringIO(), color_system=None, highlight=False)
    console.print(table)
    text: str = console.file.getvalue()  # type: ignore[attr-defined]
    return "\n".join(line.rstrip() for line in text.splitlines())


def emit(
    console: Console,
    columns: Sequence[Column],
    rows: Sequence[dict[str, Any]],
    fmt: TableFormat,
    title: str = "",
) -> None:
    """Print the table: a rich table to a terminal as rich draws it, anything else as
    :func:`render` writes it."""
    if fmt is TableFormat.TABLE and console.is_terminal:
        table = Table(*(c.header for c in columns), title=title or None)
        for row in rows:
            table.add_row(*(c.text(row[c.key]) for c in columns))
        console.print(table)
        return
    console.print(render(columns, rows, fmt, title), markup=False, highlight=False, soft_wrap=True)
