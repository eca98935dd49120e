"""The pieces of serving that are uvicorn's business, adjusted: the listening socket, the
worker supervisor's shutdown, and each connection's clock (receipts and a time-out on
request heads).

- :func:`listening_socket`: a TCP socket (``IPPROTO_TCP``) with ``TCP_NODELAY``, which
  accepted connections inherit. uvicorn's own socket for several workers has neither, and
  asyncio then leaves Nagle's algorithm on, so every response on a reused connection waits
  for the client's delayed ACK (~40 ms).
- :class:`DrainingMultiprocess`: with several workers the parent closes its copy of the
  socket as soon as it is told to stop, before it signals the workers (each closes its own as
  its graceful shutdown begins): new connections are refused at once instead of waiting in
  the accept queue of a socket nobody accepts from, while requests in flight complete.
- :class:`DrainingServer` (every worker, and the one process of a single worker): before it
  closes its listening socket at shutdown, it takes in the connections already waiting in
  the socket's accept queue and serves their one request each (``Connection: close``).
  Closing a listening socket resets the connections still queued on it: under overload
  their clients saw a read error after sending, and the server never logged them.
- :class:`ClockedProtocol`: uvicorn's httptools protocol (its C parser), wrapped, not
  subclassed: it forwards every ``asyncio.Protocol`` call to uvicorn's own protocol, and
  around them keeps the connection's :class:`ConnectionClock`. The clock knows when the
  bytes of the next request began to arrive (the receipt a deadline budget counts from, so
  parsing and the wait for the app's task are charged too), and closes a connection whose
  request head has not arrived in full ``BUDGETSERVE_HEADER_TIMEOUT_S`` after the connection
  opened or the previous response completed (uvicorn's keep-alive timer stops at the first
  byte, so a client that sends half a head would otherwise be held open for ever; slow
  bodies are the app's: ``service.http.middleware.BodyLimit``).
- :class:`CoalescingTransport`: the transport the wrapped protocol writes to, sending a
  response's head and body in one write (uvicorn writes them apart: two system calls, two
  segments, and a client woken twice per answer).

How the app reads the clock: the wrapper sets :data:`CONNECTION` (a context variable) just
before it hands bytes to uvicorn's protocol, and asyncio copies the context into the task
that uvicorn creates for a request whose head those bytes completed; the app's outermost
layer (``service.http.app.BudgetServeApp``) takes the receipt from it and tells the clock
when a request begins and when its response is done. Served by another protocol (a test's
ASGI transport, ``uvicorn service.__main__:worker_app``), a request has no clock: its
receipt is the app's first sight of it and heads are not timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import socket
import time
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.supervisors import multiprocess
from uvicorn.supervisors.multiprocess import Multiprocess, Process

from service.loop_lag import LOOP_LAG
from service.settings import Settings


def usable_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may use: its affinity, capped by the container's CPU quota
    (cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), rounded down (a quota of 1.5 CPUs is
    one: more busy threads than the quota get throttled for whole periods), at least one."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = _cpu_quota(cgroup)
    if quota is not None:
        count = min(count or 1, math.floor(quota))
    return max(1, count or 1)


def _cpu_quota(cgroup: Path) -> float | None:
    try:
        limit, period = (cgroup / "cpu.max").read_text().split()[:2]  # cgroup v2
        return None if limit == "max" else int(limit) / int(period)
    except (OSError, ValueError):
        pass
    try:
        limit = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()  # cgroup v1
        period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
        return None if int(limit) <= 0 else int(limit) / int(period)
    except (OSError, ValueError):
        return None


def worker_count(workers: int) -> int:
    """``BUDGETSERVE_WORKERS``: as set, or one per usable CPU when 0."""
    return workers or usable_cpus()


def extraction_threads(threads: int, workers: int) -> int:
    """``BUDGETSERVE_EXTRACTION_THREADS``: as set, or the usable CPUs divided among the
    workers when 0 (at least one)."""
    return threads or max(1, usable_cpus() // worker_count(workers))


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn (it calls ``listen``), with ``TCP_NODELAY`` set."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class DrainingMultiprocess(Multiprocess):
    """uvicorn's worker supervisor, closing the parent's listening socket before it asks the
    workers to stop."""

    def terminate_all(self) -> None:
        for sock in self.sockets:
            sock.close()
        super().terminate_all()

    def run(self) -> None:
        # Every worker process uvicorn starts (at start-up, on a restart, in place of one
        # that died) is made inside ``run``: let them be DrainingProcess ones. (uvicorn's
        # supervisor takes no server class; its module's ``Process`` is the one hook.)
        with _worker_process_class(DrainingProcess):
            super().run()


#: Most connections one process takes in from its accept queue at shutdown (uvicorn's
#: default backlog is 2048).
MAX_ADOPTED = 4096


class DrainingServer(uvicorn.Server):
    """uvicorn's server, taking in the connections waiting in its listening sockets' accept
    queue as it closes them at shutdown (see the module). Each is served like any other
    connection: its request gets an answer (a prediction, or the 503 of an overloaded
    process) and is logged; then the connection closes."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Take the queue and close the listeners in one step, with no await between them:
        # a connection completing its handshake meanwhile would be queued again, and reset.
        queued = _accept_queued(sockets or [])
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        loop = asyncio.get_running_loop()
        config = self.config

        def protocol() -> asyncio.Protocol:
            made: asyncio.Protocol = config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state
            )
            return made

        for conn in queued:
            try:
                await loop.connect_accepted_socket(protocol, conn)
            except OSError:  # the client gave up meanwhile
                conn.close()
        await super().shutdown(sockets=sockets)  # closing again is a no-op


def _accept_queued(sockets: list[socket.socket]) -> list[socket.socket]:
    """The connections waiting in the accept queues of ``sockets`` (non-blocking: asyncio
    made them so), at most :data:`MAX_ADOPTED`."""
    accepted: list[socket.socket] = []
    for listener in sockets:
        while len(accepted) < MAX_ADOPTED:
            try:
                conn, _ = listener.accept()
            except OSError:  # BlockingIOError: the queue is empty (or the socket is closed)
                break
            conn.setblocking(False)
            accepted.append(conn)
    return accepted


class DrainingProcess(Process):
    """uvicorn's worker process, serving with a :class:`DrainingServer`."""

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            self._server = DrainingServer(config=self.config)
        return self._server


@contextlib.contextmanager
def _worker_process_class(cls: type[Process]) -> Iterator[None]:
    original = multiprocess.Process
    multiprocess.Process = cls  # type: ignore[misc]
    try:
        yield
    finally:
        multiprocess.Process = original  # type: ignore[misc]


log = logging.getLogger("budgetserve.serve")

#: At shutdown, how long a connection that has not sent a request head yet may take to send it.
SHUTDOWN_HEAD_TIMEOUT_S = 1.0


@functools.cache
def header_timeout_s() -> float:
    """From the environment, once per process (workers are separate processes)."""
    return Settings().header_timeout_s


class ConnectionClock:
    """One connection's receipts and head timer (see the module).

    ``first_byte_at``: the ``perf_counter()`` at which the first bytes of the request not
    yet begun arrived (None before any). ``busy``: a request is being served (its head
    arrived; its response is not done). ``answered_at``: when the last response was handed
    to the transport (at first, when the connection was made): a client that waits for its
    answer sends nothing of the next request before it, so no receipt is dated back past it."""

    __slots__ = (
        "_loop",
        "_timer",
        "_transport",
        "answered_at",
        "busy",
        "first_byte_at",
        "last_request",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        transport: asyncio.BaseTransport | CoalescingTransport,
    ) -> None:
        self._loop = loop
        self._transport = transport
        self._timer: asyncio.TimerHandle | None = None
        self.first_byte_at: float | None = None
        self.answered_at = time.perf_counter()
        self.busy = False
        self.last_request = False  # shutting down: serve the request on its way, then close

    def bytes_arrived(self) -> None:
        if self.first_byte_at is None and not self.busy:
            # Dated back by how far behind the loop runs (the bytes waited unseen that long),
            # but not past the previous answer: a loop late for another reason (the process
            # descheduled while idle, or reading in the pass that ran a long request) was
            # late before these bytes were sent. (One client at 512 px: 1-2 % of receipts
            # were 1-1.5 ms before the client sent, and their budget spent before it began.)
            read = time.perf_counter()
            self.first_byte_at = max(read - LOOP_LAG.overdue_ms() / 1000.0, self.answered_at)

    def request_began(self) -> float:
        """A request's head is in and the app has it: its receipt (now, if no bytes were
        seen: a request pipelined behind the previous one)."""
        received = self.first_byte_at or time.perf_counter()
        self.first_byte_at = None
        self.busy = True
        self._cancel()
        return received

    def response_starts(self) -> None:
        """The response's head is about to be handed to the transport: held, to go out
        with the first body bytes in one write (see :class:`CoalescingTransport`)."""
        if isinstance(self._transport, CoalescingTransport):
            self._transport.hold_next = True

    def response_sent(self) -> None:
        """The response's last bytes are handed to the transport."""
        self.answered_at = time.perf_counter()

    def response_done(self) -> None:
        """The response is written: the next head must arrive within the time-out."""
        if isinstance(self._transport, CoalescingTransport):
            self._transport.flush()  # a head sent with no body after it
        self.busy = False
        self.arm()

    def arm(self, timeout_s: float | None = None) -> None:
        self._cancel()
        if not self._transport.is_closing():
            wait = header_timeout_s() if timeout_s is None else timeout_s
            self._timer = self._loop.call_later(wait, self._timed_out)

    def close(self) -> None:
        self._cancel()

    def closing(self) -> bool:
        return self._transport.is_closing()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if not self.busy and not self._transport.is_closing():
            if self.last_request:
                log.info(
                    "shutting down: closed a connection from %s that sent no request within %g s",
                    self._transport.get_extra_info("peername"),
                    min(header_timeout_s(), SHUTDOWN_HEAD_TIMEOUT_S),
                )
            self._transport.close()


class CoalescingTransport:
    """A connection's transport that sends a response's head with its body in one write.

    uvicorn writes the status line and headers as soon as the app sends
    ``http.response.start``, then the body in a second write: with ``TCP_NODELAY`` (see
    :func:`listening_socket`) that is two system calls and two segments, and a client
    reading the answer wakes for the head, then again for the body. The app's outermost
    layer calls :meth:`ConnectionClock.response_starts` before it sends the head: the next
    write is held and joined to the one after it (the body's first bytes), or flushed when
    the response is done. Everything else is the transport's own."""

    __slots__ = ("_transport", "hold_next", "pending")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.hold_next = False
        self.pending = b""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.hold_next:
            self.hold_next = False
            self.pending = bytes(data)
            return
        if self.pending:
            data, self.pending = self.pending + data, b""
        self._transport.write(data)

    def flush(self) -> None:
        self.hold_next = False
        if self.pending:
            data, self.pending = self.pending, b""
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


#: The clock of the connection whose bytes made the current request's task (see the module).
CONNECTION: ContextVar[ConnectionClock | None] = ContextVar("budgetserve_connection", default=None)


class ClockedProtocol(asyncio.Protocol):
    """uvicorn's httptools protocol with a :class:`ConnectionClock` (see the module). Give
    the class to ``uvicorn.Config(http=...)``: uvicorn builds it with the keyword arguments it
    builds its own protocols with, which are passed on unchanged."""

    def __init__(self, **kwargs: Any) -> None:
        self._inner = HttpToolsProtocol(**kwargs)
        self._clock: ConnectionClock | None = None
        # uvicorn's set of open connections, which it shuts down one by one: the wrapper
        # stands in it for uvicorn's protocol, so that shutting down is decided here.
        self._connections: set[Any] = kwargs["server_state"].connections

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        coalescing = CoalescingTransport(transport)  # type: ignore[arg-type]
        self._clock = ConnectionClock(asyncio.get_running_loop(), coalescing)
        self._inner.connection_made(coalescing)  # type: ignore[arg-type]
        self._connections.discard(self._inner)
        self._connections.add(self)
        self._clock.arm()

    def shutdown(self) -> None:
        """The server is stopping. A connection serving a request finishes it and closes
        (uvicorn's own rule). One with no request yet is closed at once by uvicorn, but one
        just accepted (from the accept queue, at shutdown: :class:`DrainingServer`) usually
        has its request on the way, unread: closing it would reset it. So it is served one
        request (``Connection: close``) if its head arrives within a second, else closed."""
        clock = self._clock
        if clock is None or clock.busy or clock.closing():
            self._inner.shutdown()
            return
        clock.last_request = True
        clock.arm(min(header_timeout_s(), SHUTDOWN_HEAD_TIMEOUT_S))

    def data_received(self, data: bytes) -> None:
        clock = self._clock
        if clock is not None:
            clock.bytes_arrived()
            CONNECTION.set(clock)
        self._inner.data_received(data)

    def eof_received(self) -> None:
        self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._clock is not None:
            self._clock.close()
        self._inner.connection_lost(exc)
        self._connections.discard(self)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


def uvicorn_options() -> dict[str, Any]:
    """What every budgetserve uvicorn runs with: the clocked httptools protocol, uvloop, and
    no access line (the request's own line replaces it: ``service.http.requestlog``)."""
    return {"http": ClockedProtocol, "loop": "uvloop", "access_log": False}
