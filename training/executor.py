"""Where embarrassingly parallel training work runs: in-process, joblib workers, or Ray.

The lattice expansion (one cross-validated model per feature set,
:mod:`training.bundles.digits`) and the DAG training (one classifier per state, one policy
set per cost scale, :mod:`training.dag`) are many independent tasks. They go through
:meth:`Executor.map`::

    with make_executor("ray", address="head:6379") as ex:
        results = ex.map(cv_accuracy, masks, shared=(job,))   # cv_accuracy(job, mask) each

* ``fn`` must be a module-level function (it is pickled by reference) and is called as
  ``fn(*shared, item)`` for every item; the results come back in the items' order.
* ``shared`` holds the large read-only inputs (the training matrix, a fitted classifier
  bank): the Ray executor puts each one in the object store once per executor (memoised by
  identity, so later ``map`` calls reuse it) and every task reads it from there; joblib
  memory-maps large arrays for its workers.
* Results do not depend on the executor or on the order tasks finish in: every task is a
  pure, seeded function of its inputs and is collected by position.

:func:`make_executor` picks one by name: ``local`` (joblib, ``n_jobs`` workers; 1 runs inline
in this process, the default everywhere) or ``ray`` (``address`` of a running cluster, or a
local instance with ``n_jobs`` CPUs when no address is given).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, TypeVar

R = TypeVar("R")
_Self = TypeVar("_Self", bound="Executor")
ProgressHook = Callable[[str, int, int], None]


class ExecutorKind(enum.StrEnum):
    """The executors :func:`make_executor` knows (the CLI's ``--executor`` choices)."""

    LOCAL = "local"
    RAY = "ray"


class Executor:
    """Order-preserving ``map`` of a module-level function over items; a context manager
    (leaving it releases workers and shuts down what the executor started)."""

    kind: str = "inline"
    #: Called as ``progress(fn.__name__, done, total)`` when a ``map`` call starts (done 0)
    #: and as its items complete (the CLI's progress display sets it).
    progress: ProgressHook | None = None

    def map(
        self, fn: Callable[..., R], items: Iterable[Any], *, shared: Sequence[Any] = ()
    ) -> list[R]:
        """``[fn(*shared, item) for item in items]``, computed wherever this executor runs."""
        todo = list(items)
        tick = self._ticker(fn, len(todo))
        out = []
        for item in todo:
            out.append(fn(*shared, item))
            tick()
        return out

    def _ticker(self, fn: Callable[..., Any], total: int) -> Callable[[], None]:
        """Report the start of a ``map`` of ``total`` items; the result reports one done."""
        hook = self.progress
        if hook is None:
            return lambda: None
        name = getattr(fn, "__name__", "tasks")
        hook(name, 0, total)
        done = 0

        def tick() -> None:
            nonlocal done
            done += 1
            hook(name, done, total)

        return tick

    def close(self) -> None:
        return None

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def describe(self) -> str:
        return self.kind


#: The executor used when none is given: every task inline, in order, in this process.
INLINE = Executor()


def thread_limits() -> dict[str, int]:
    """This process's thread counts per native thread pool (``blas``, ``openmp``)."""
    from threadpoolctl import threadpool_info

    limits: dict[str, int] = {}
    for pool in threadpool_info():
        api = str(pool["user_api"])
        limits[api] = max(limits.get(api, 1), int(pool["num_threads"]))
    return limits


def run_limited(limits: dict[str, int], fn: Callable[..., R], *args: Any) -> R:
    """``fn(*args)`` with the driver's native thread counts (``limits``), whatever the
    worker's defaults (joblib and Ray give each worker one thread): a BLAS call splits its
    work by thread count, so the same count makes the same floating-point result."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=limits):
        return fn(*args)


class LocalExecutor(Executor):
    """joblib on this machine: ``n_jobs`` worker processes (-1: one per core); ``n_jobs=1``
    runs every task inline in this process, exactly as without an executor."""

    kind = "local"

    def __init__(self, n_jobs: int = 1) -> None:
        if isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs == 0 or n_jobs < -1:
            raise ValueError(f"n_jobs={n_jobs!r}: a number of workers >= 1, or -1 for all cores")
        self.n_jobs = n_jobs
        self._parallel: Any = None
        self._limits: dict[str, int] = {}

    def map(
        self, fn: Callable[..., R], items: Iterable[Any], *, shared: Sequence[Any] = ()
    ) -> list[R]:
        todo = list(items)
        if self.n_jobs == 1 or len(todo) <= 1:
            return super().map(fn, todo, shared=shared)
        from joblib import Parallel, delayed

        if self._parallel is None:  # one worker pool for the executor's lifetime
            self._parallel = Parallel(n_jobs=self.n_jobs, return_as="generator")
            self._parallel.__enter__()
            self._limits = thread_limits()
        tick = self._ticker(fn, len(todo))
        out = []
        for result in self._parallel(
            delayed(run_limited)(self._limits, fn, *shared, item) for item in todo
        ):
            out.append(result)
            tick()
        return out

    def close(self) -> None:
        if self._parallel is not None:
            parallel, self._parallel = self._parallel, None
            parallel.__exit__(None, None, None)

    def describe(self) -> str:
        return f"local, n_jobs={self.n_jobs}" if self.n_jobs != 1 else "local, inline"


class RayExecutor(Executor):
    """Ray tasks: one ``ray.remote`` task per item, shared inputs put once with ``ray.put``.

    ``address`` connects to a running cluster (``HOST:6379``, or ``auto`` for the one
    ``ray start`` started on this machine); without it a local instance with ``n_jobs`` CPUs
    (None: all) is started on first use. If Ray is already initialised in this process it is
    used as it is. Ray is shut down on :meth:`close` only if this executor started it.
    """

    kind = "ray"

    def __init__(
        self,
        address: str | None = None,
        n_jobs: int | None = None,
        *,
        init_kwargs: dict[str, Any] | None = None,
    ) -> None:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "the ray executor needs Ray: pip install 'budgetserve[distributed]'"
            ) from None
        if n_jobs is not None and n_jobs < 1 and n_jobs != -1:
            raise ValueError(f"n_jobs={n_jobs!r}: a number of CPUs >= 1, or -1 for all cores")
        self.address = address
        self.n_jobs = None if n_jobs == -1 else n_jobs
        self.init_kwargs = dict(init_kwargs or {})
        self._owns = False
        self._started = False
        self._task: Any = None
        self._limits: dict[str, int] = {}
        self._refs: dict[int, tuple[Any, Any]] = {}

    def _start(self) -> None:
        import ray

        if self._started:
            return
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {
                "include_dashboard": False,
                "log_to_driver": False,
                "configure_logging": False,
            }
            if self.address is None:  # "local": a new instance, never a cluster found nearby
                kwargs["num_cpus"] = self.n_jobs or os.cpu_count() or 1
            kwargs.update(self.init_kwargs)
            ray.init(address=self.address or "local", **kwargs)
            self._owns = True
        self._started = True

    def _put(self, value: Any) -> Any:
        import ray

        key = id(value)
        if key not in self._refs:  # keep the value alive so its id is not reused
            self._refs[key] = (value, ray.put(value))
        return self._refs[key][1]

    def map(
        self, fn: Callable[..., R], items: Iterable[Any], *, shared: Sequence[Any] = ()
    ) -> list[R]:
        import ray

        todo = list(items)
        if not todo:
            return []
        self._start()
        if self._task is None:
            self._task = ray.remote(run_limited)
            self._limits = thread_limits()
        refs = [self._put(value) for value in shared]
        tasks = [self._task.remote(self._limits, fn, *refs, item) for item in todo]
        tick = self._ticker(fn, len(todo))
        pending = list(tasks)
        while pending:  # count completions as they come, then collect in order
            ready, pending = ray.wait(pending, num_returns=1)
            for _ in ready:
                tick()
        return list(ray.get(tasks))

    def close(self) -> None:
        import ray

        self._refs.clear()
        self._task = None
        if self._owns and ray.is_initialized():
            ray.shutdown()
        self._owns = False
        self._started = False

    def describe(self) -> str:
        where = self.address or f"local instance, {self.n_jobs or os.cpu_count()} CPUs"
        return f"ray ({where})"


def make_executor(
    kind: str = "local", *, address: str | None = None, n_jobs: int | None = None
) -> Executor:
    """The executor named ``kind``: ``local`` (joblib, ``n_jobs`` workers, default 1 = inline)
    or ``ray`` (cluster at ``address``, else a local instance with ``n_jobs`` CPUs)."""
    try:
        chosen = ExecutorKind(kind)
    except ValueError:
        choices = ", ".join(repr(k.value) for k in ExecutorKind)
        raise ValueError(f"unknown executor {kind!r}; choose one of {choices}") from None
    if chosen is ExecutorKind.RAY:
        return RayExecutor(address=address, n_jobs=n_jobs)
    if address is not None:
        raise ValueError(f"address={address!r} is only for the ray executor (--executor ray)")
    return LocalExecutor(1 if n_jobs is None else n_jobs)
