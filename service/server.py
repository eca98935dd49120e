"""The pieces of serving that are uvicorn's business, adjusted: the listening socket, the
worker supervisor's shutdown, and a time-out on request heads.

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
- :class:`HeadTimeoutH11Protocol`: uvicorn's h11 protocol, closing a connection whose request
  head (request line and headers) has not arrived in full ``BUDGETSERVE_HEADER_TIMEOUT_S``
  after the connection opened or the previous response completed. uvicorn's own keep-alive
  timer stops at the first byte, so a client that sends half a head is otherwise held open
  for ever. (Slow bodies are the app's: ``service.http.middleware.BodyLimit``.) It also
  stamps each request's scope with the ``perf_counter()`` at which its first bytes were
  handed to the protocol (``RECEIVED_KEY``): the receipt a deadline budget counts from, so
  uvicorn's parsing and the wait for the app's task are charged too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections.abc import Iterator

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.supervisors import multiprocess
from uvicorn.supervisors.multiprocess import Multiprocess, Process

from service.http.middleware import RECEIVED_KEY
from service.settings import Settings


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
        # that died) is made inside ``run``: let them be DrainingProcess ones.
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


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a time-out on each request head (see the module)."""

    _head_timer: asyncio.TimerHandle | None = None
    _first_byte_at: float | None = None
    _stamped: object = None
    _last_request = False  # shutting down: serve the request on its way, then close

    def data_received(self, data: bytes) -> None:
        if self._first_byte_at is None and self.conn.their_state is h11.IDLE:
            self._first_byte_at = time.perf_counter()
        super().data_received(data)
        scope = getattr(self, "scope", None)
        if scope is not None and scope is not self._stamped:  # a new request's head parsed
            scope[RECEIVED_KEY] = self._first_byte_at or time.perf_counter()
            self._stamped = scope
            self._first_byte_at = None
            if self._last_request and self.cycle is not None:
                self.cycle.keep_alive = False

    def shutdown(self) -> None:
        """uvicorn closes a connection that has not sent a request yet at once; but one
        just accepted (from the accept queue, at shutdown) usually has its request on the
        way, unread: closing it would reset it. Such a connection is served one request
        (``Connection: close``) if its head arrives within a second, else closed."""
        if self.cycle is None and not self.transport.is_closing():
            self._last_request = True
            self._arm_head_timer(min(header_timeout_s(), SHUTDOWN_HEAD_TIMEOUT_S))
            return
        super().shutdown()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _arm_head_timer(self, timeout_s: float | None = None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if not self.transport.is_closing():
            self._head_timer = self.loop.call_later(
                header_timeout_s() if timeout_s is None else timeout_s, self._head_timed_out
            )

    def _head_timed_out(self) -> None:
        self._head_timer = None
        # IDLE: no complete request head since the timer was armed (a request in progress
        # has moved the client's side on to SEND_BODY or DONE).
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._last_request:
                log.info(
                    "shutting down: closed a connection from %s that sent no request within %g s",
                    self.client and f"{self.client[0]}:{self.client[1]}",
                    min(header_timeout_s(), SHUTDOWN_HEAD_TIMEOUT_S),
                )
            if self.conn.our_state is h11.IDLE:
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()
