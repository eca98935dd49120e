"""Start-up problems of ``budgetserve-serve`` as one readable line each (exit status 2).

``budgetserve-serve`` checks what it can before anything starts: the settings (pydantic:
``service.settings``), the models folder, and here the listening socket, whose failures
(a port in use, a host that does not resolve or is not this machine's, a port below 1024
without the right) are said in terms of the settings that cause them, not as a traceback.
"""

from __future__ import annotations

import errno
import socket

from service.server import listening_socket


class StartupError(Exception):
    """Something that keeps the server from starting, worded for the operator (one line)."""


def env_name(field: str) -> str:
    """The environment variable of a :class:`~service.settings.Settings` field."""
    return "REDIS_URL" if field == "redis_url" else f"BUDGETSERVE_{field.upper()}"


def bind(host: str, port: int) -> socket.socket:
    """:func:`service.server.listening_socket` on ``host:port``, or :class:`StartupError`
    saying why not and which setting to change."""
    where = f"BUDGETSERVE_HOST={host!r} BUDGETSERVE_PORT={port}"
    try:
        return listening_socket(host, port)
    except socket.gaierror as exc:
        raise StartupError(
            f"cannot listen on {where}: the host does not resolve ({exc.strerror}); use an "
            "address of this machine (127.0.0.1, 0.0.0.0, ::) or a name that resolves to one"
        ) from exc
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            why = "the port is in use by another process: stop it, or pick another port"
        elif exc.errno == errno.EADDRNOTAVAIL:
            why = "the address is not one of this machine's: use 127.0.0.1 or 0.0.0.0"
        elif exc.errno in (errno.EACCES, errno.EPERM):
            why = "permission denied: ports below 1024 need privileges; pick a port >= 1024"
        else:
            why = exc.strerror or str(exc)
        raise StartupError(f"cannot listen on {where}: {why}") from exc
