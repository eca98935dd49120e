"""``python -m service`` / ``budgetserve-serve``: run the API with uvicorn.

The listening socket is made here, not by uvicorn, for any number of workers: a TCP socket
(``IPPROTO_TCP``) with ``TCP_NODELAY``, which accepted connections inherit. uvicorn's own
socket for several workers has neither, and asyncio then leaves Nagle's algorithm on, so
every response on a reused connection waits for the client's delayed ACK (~40 ms).

With several workers the parent process closes its copy of the socket as soon as it is told
to stop, before it signals the workers (each closes its own as its graceful shutdown
begins): new connections are then refused at once instead of waiting in the accept queue
of a socket nobody accepts from, while requests in flight complete.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import tempfile

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors.multiprocess import Multiprocess

from service.api import create_app
from service.settings import Settings

log = logging.getLogger("budgetserve.serve")


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


def main() -> None:
    settings = Settings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    sock = listening_socket(settings.host, settings.port)
    log.info("listening on %s:%d (TCP_NODELAY), %d worker(s)",
             settings.host, sock.getsockname()[1], settings.workers)
    if settings.workers > 1:
        # Workers share their metrics through files (prometheus-client multiprocess mode);
        # the variable must be set before the workers import prometheus_client.
        created = None
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            created = tempfile.mkdtemp(prefix="budgetserve-prom-")
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = created
        try:
            config = uvicorn.Config(
                "service.api:create_app", factory=True, host=settings.host, port=settings.port,
                workers=settings.workers, timeout_graceful_shutdown=30,
            )
            DrainingMultiprocess(config, sockets=[sock]).run()
        finally:
            sock.close()
            if created is not None:  # the folder this process made for its workers
                shutil.rmtree(created, ignore_errors=True)
    else:
        config = uvicorn.Config(
            create_app(settings), host=settings.host, port=settings.port,
            timeout_graceful_shutdown=30,
        )
        server = uvicorn.Server(config)
        try:
            server.run(sockets=[sock])
        finally:
            sock.close()
        if not server.started:
            sys.exit(STARTUP_FAILURE)


if __name__ == "__main__":
    main()
