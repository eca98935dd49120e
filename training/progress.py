"""Progress of long CLI steps: M of N done, elapsed, ETA.

:class:`StageProgress` shows one rich bar per stage on a terminal; anywhere else (a pipe, a
file, CI logs) it writes plain lines instead, one when a stage starts, then at most one per
``every_s`` seconds and one at each tenth of the way, and one when it completes, each
``<stage>: M/N (P%), elapsed Xs, ETA Ys``. Progress goes to stderr, so that a command's
output (tables, JSON) can be piped cleanly.

Two ways in: :meth:`update` (``stage``, ``done``, ``total``: the absolute count, as the
bundle builders report it) and :meth:`executor_hook` (an ``Executor``'s ``progress``: per
``map`` call, counts that :class:`StageProgress` adds up across calls of a stage, so a sweep
that refines in rounds shows its total growing).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


@dataclass
class _Stage:
    label: str
    started: float
    total: int = 0
    done: int = 0
    offset: int = 0  # executor_hook: what earlier map calls of the stage completed
    printed_at: float = -1.0
    printed_tenth: int = -1
    printed_done: int = -1
    task: TaskID | None = None


def _seconds(value: float) -> str:
    value = max(value, 0.0)
    if value < 60:
        return f"{value:.0f}s"
    minutes, seconds = divmod(int(value), 60)
    return f"{minutes}m{seconds:02d}s"


@dataclass
class StageProgress:
    """See the module. ``labels`` turn stage keys (or mapped functions' names) into text."""

    console: Console = field(default_factory=lambda: Console(stderr=True))
    labels: Mapping[str, str] = field(default_factory=dict)
    every_s: float = 10.0
    live: bool | None = None  # default: whether ``console`` is a terminal
    stages: dict[str, _Stage] = field(default_factory=dict)
    bar: Any = None

    def __enter__(self) -> StageProgress:
        if self.live is None:
            self.live = self.console.is_terminal
        if self.live:
            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.bar.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def _stage(self, key: str) -> _Stage:
        stage = self.stages.get(key)
        if stage is None:
            label = self.labels.get(key, key.strip("_").replace("_", " "))
            stage = self.stages[key] = _Stage(label, time.monotonic())
        return stage

    def update(self, key: str, done: int, total: int) -> None:
        """``done`` of ``total`` of stage ``key`` are complete."""
        stage = self._stage(key)
        stage.done, stage.total = done, total
        self._show(stage)

    def executor_hook(self, key: str, done: int, total: int) -> None:
        """``done`` of the ``total`` items of one ``map`` call of ``key`` are complete."""
        stage = self._stage(key)
        if done == 0:  # a new call: its items join the stage
            stage.offset = stage.done
            stage.total = stage.offset + total
            stage.printed_tenth = -1
        stage.done = stage.offset + done
        self._show(stage)

    def _show(self, stage: _Stage) -> None:
        if self.bar is not None:
            if stage.task is None:
                stage.task = self.bar.add_task(stage.label, total=stage.total)
            self.bar.update(stage.task, completed=stage.done, total=stage.total)
            return
        now = time.monotonic()
        tenth = (10 * stage.done) // stage.total if stage.total else 10
        due = stage.done != stage.printed_done and (
            stage.printed_at < 0
            or tenth > stage.printed_tenth
            or now - stage.printed_at >= self.every_s
        )
        if not due:
            return
        stage.printed_at, stage.printed_tenth, stage.printed_done = now, tenth, stage.done
        elapsed = now - stage.started
        if stage.done >= stage.total:
            eta = "done"
        elif stage.done > 0:
            eta = f"ETA {_seconds(elapsed / stage.done * (stage.total - stage.done))}"
        else:
            eta = "ETA unknown"
        percent = 100.0 * stage.done / stage.total if stage.total else 100.0
        self.console.print(
            f"{stage.label}: {stage.done}/{stage.total} ({percent:.0f}%), "
            f"elapsed {_seconds(elapsed)}, {eta}",
            highlight=False,
            soft_wrap=True,
        )
