"""``python -m service`` / ``budgetserve-serve``: run the API with uvicorn, on a listening
socket made here for any number of workers (``service.server`` says why)."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from service.http import create_app
from service.server import DrainingMultiprocess, HeadTimeoutH11Protocol, listening_socket
from service.settings import Settings

log = logging.getLogger("budgetserve.serve")


def main() -> None:
    settings = Settings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    sock = listening_socket(settings.host, settings.port)
    log.info(
        "listening on %s:%d (TCP_NODELAY), %d worker(s)",
        settings.host,
        sock.getsockname()[1],
        settings.workers,
    )
    if settings.workers > 1:
        # Workers share their metrics through files (prometheus-client multiprocess mode);
        # the variable must be set before the workers import prometheus_client.
        created = None
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            created = tempfile.mkdtemp(prefix="budgetserve-prom-")
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = created
        try:
            config = uvicorn.Config(
                "service.http:create_app",
                factory=True,
                host=settings.host,
                port=settings.port,
                workers=settings.workers,
                timeout_graceful_shutdown=30,
                http=HeadTimeoutH11Protocol,
            )
            DrainingMultiprocess(config, sockets=[sock]).run()
        finally:
            sock.close()
            if created is not None:  # the folder this process made for its workers
                shutil.rmtree(created, ignore_errors=True)
    else:
        config = uvicorn.Config(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            timeout_graceful_shutdown=30,
            http=HeadTimeoutH11Protocol,
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
