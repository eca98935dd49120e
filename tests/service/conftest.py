"""Fixtures of the service tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.service.serving import RedisProcess


@pytest.fixture
def own_redis() -> Iterator[RedisProcess]:
    """A redis-server of the test's own, so that the test can stop, kill and restart it."""
    server = RedisProcess()
    try:
        yield server
    finally:
        server.close()
