"""``python -m service`` / ``budgetserve-serve``: run the API with uvicorn."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import uvicorn

from service.api import create_app
from service.settings import Settings


def main() -> None:
    settings = Settings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if settings.workers > 1:
        # Workers share their metrics through files (prometheus-client multiprocess mode);
        # the variable must be set before the workers import prometheus_client.
        created = None
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            created = tempfile.mkdtemp(prefix="budgetserve-prom-")
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = created
        try:
            uvicorn.run(
                "service.api:create_app", factory=True, host=settings.host, port=settings.port,
                workers=settings.workers, timeout_graceful_shutdown=30,
            )
        finally:
            if created is not None:  # the folder this process made for its workers
                shutil.rmtree(created, ignore_errors=True)
    else:
        uvicorn.run(
            create_app(settings), host=settings.host, port=settings.port,
            timeout_graceful_shutdown=30,
        )


if __name__ == "__main__":
    main()
