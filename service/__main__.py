"""``python -m service`` / ``budgetserve-serve``: run the API with uvicorn, on a listening
socket made here for any number of workers (``service.server`` says why).

Configuration is by ``BUDGETSERVE_*`` environment variables only (``--help`` lists them).
A setting that does not validate, or a models folder that does not exist, ends the command
with one line on stderr and exit status 2 before anything starts. A models folder with no
bundle in it starts the server with a warning and ``/readyz`` unready (503): bundles copied
in later are loaded by ``POST /-/reload`` or folder watching, without a restart.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import textwrap

import uvicorn
from fastapi import FastAPI
from pydantic import AliasChoices, ValidationError
from uvicorn.config import STARTUP_FAILURE

from service import tracing
from service.http import create_app
from service.http.requestlog import configure_logging
from service.registry import bundle_folders
from service.server import DrainingMultiprocess, DrainingServer, uvicorn_options, worker_count
from service.settings import Settings
from service.startup import StartupError, bind, env_name

log = logging.getLogger("budgetserve.serve")

USAGE_ERROR = 2


def _parser() -> argparse.ArgumentParser:
    lines = []
    for name, info in Settings.model_fields.items():
        env = f"BUDGETSERVE_{name.upper()}"
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):  # REDIS_URL (or BUDGETSERVE_REDIS_URL)
            names = [str(c) for c in alias.choices]
            env = f"{names[0]} (or {', '.join(names[1:])})" if len(names) > 1 else names[0]
        default = "(none)" if info.default is None else info.default
        if info.default_factory is not None:
            default = "{}"
        text = f"{env} (default {default}): {info.description or ''}"
        lines.append(textwrap.fill(text, 96, initial_indent="  ", subsequent_indent="      "))
    return argparse.ArgumentParser(
        prog="budgetserve-serve",
        description="Serve the bundles of BUDGETSERVE_MODELS_DIR over HTTP (docs/operating.md). "
        "Takes no arguments: every setting is an environment variable.",
        epilog="settings:\n" + "\n".join(lines),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def settings_error(exc: ValidationError) -> str:
    """One line naming each setting that failed, the value found and what is required."""
    problems = []
    for err in exc.errors(include_url=False):
        field = ".".join(str(p) for p in err["loc"]) or "settings"
        env = env_name(field) if err["loc"] else "settings"
        found = f"={err['input']!r}" if err["loc"] and "input" in err else ""
        problems.append(f"{env}{found}: {err['msg']}")
    return "budgetserve-serve: invalid settings: " + "; ".join(problems)


def load_settings() -> Settings:
    """The settings, or exit 2 with one readable line (a bad setting, a missing folder)."""
    try:
        settings = Settings()
    except ValidationError as exc:
        print(settings_error(exc), file=sys.stderr)
        sys.exit(USAGE_ERROR)
    problem = tracing.unavailable() if settings.tracing else None
    if problem is not None:
        print(f"budgetserve-serve: {problem}", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    folder = settings.models_dir
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        print(
            f"budgetserve-serve: BUDGETSERVE_MODELS_DIR={str(folder)!r} {what} (resolved "
            f"from {os.getcwd()!r}); point it at the folder of bundles (e.g. models/, with "
            "one folder per bundle)",
            file=sys.stderr,
        )
        sys.exit(USAGE_ERROR)
    return settings


def worker_app() -> FastAPI:
    """The app of one worker process (uvicorn's factory with several workers)."""
    settings = Settings()
    configure_logging(settings.log_format, refusals_per_s=settings.log_refusals_per_s)
    return create_app(settings)


def main(argv: list[str] | None = None) -> None:
    _parser().parse_args(argv)  # --help; anything else is a usage error
    settings = load_settings()
    configure_logging(settings.log_format, refusals_per_s=settings.log_refusals_per_s)
    if not bundle_folders(settings.models_dir):
        log.warning(
            "NO BUNDLES in %s: the server starts unready (/readyz answers 503) and serves "
            "nothing until bundles are copied in and loaded (POST /-/reload, or "
            "BUDGETSERVE_WATCH_INTERVAL_S)",
            settings.models_dir.resolve(),
        )
    workers = worker_count(settings.workers)
    # What the app reports (the admin API's scope) and what several workers read.
    os.environ["BUDGETSERVE_WORKERS"] = str(workers)
    settings = settings.model_copy(update={"workers": workers})
    try:
        sock = bind(settings.host, settings.port)
    except StartupError as exc:
        print(f"budgetserve-serve: {exc}", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    log.info(
        "listening on %s:%d (TCP_NODELAY), %d worker(s)",
        settings.host,
        sock.getsockname()[1],
        workers,
    )
    if workers > 1:
        # Workers share their metrics through files (prometheus-client multiprocess mode);
        # the variable must be set before the workers import prometheus_client.
        created = None
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            created = tempfile.mkdtemp(prefix="budgetserve-prom-")
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = created
        try:
            config = uvicorn.Config(
                "service.__main__:worker_app",
                factory=True,
                log_config=None,
                host=settings.host,
                port=settings.port,
                workers=workers,
                timeout_graceful_shutdown=30,
                **uvicorn_options(),
            )
            DrainingMultiprocess(config, sockets=[sock]).run()
        finally:
            sock.close()
            if created is not None:  # the folder this process made for its workers
                shutil.rmtree(created, ignore_errors=True)
    else:
        config = uvicorn.Config(
            create_app(settings),
            log_config=None,
            host=settings.host,
            port=settings.port,
            timeout_graceful_shutdown=30,
            **uvicorn_options(),
        )
        server = DrainingServer(config)
        try:
            server.run(sockets=[sock])
        finally:
            sock.close()
        if not server.started:
            sys.exit(STARTUP_FAILURE)


if __name__ == "__main__":
    main()
