"""The C allocator's thresholds (``service.allocator``): a service worker keeps freed memory
for its next request, so a large image's arrays reuse pages instead of faulting in fresh
ones. Observed by the page faults a loop of requests' worth of arrays takes (the kernel's
count, not a timing), in fresh processes: a threshold once raised stays for the process."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from service.allocator import keep_freed_memory
from tests.service.serving import fresh_python

GLIBC = platform.libc_ver()[0] == "glibc"

FAULTS_AFTER_START = """
import resource, sys
import numpy as np
from fastapi.testclient import TestClient
from service.http import create_app
from service.settings import Settings

def faults() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        # a request's arrays: six of 4 MiB alive at once, every page written, then freed
        arrays = [np.ones(1 << 20, dtype=np.float32) for _ in range(6)]
        del arrays
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

with TestClient(create_app(Settings(models_dir=sys.argv[1]))) as client:
    assert client.get("/readyz").status_code == 200
    faults()  # the first allocation of the size may fault once
    print(faults())
"""


def faults_in_a_started_service(models: Path, keep_mb: str) -> int:
    out = fresh_python(
        FAULTS_AFTER_START, str(models.parent), BUDGETSERVE_ALLOCATOR_KEEP_MB=keep_mb
    )
    return int(out.split()[-1])


@pytest.mark.skipif(
    not GLIBC,
    reason="mallopt's thresholds are glibc's: on musl or macOS the setting does nothing, so "
    "there is no difference in page faults to observe (CI and the image run glibc)",
)
def test_a_started_service_reuses_freed_pages(digits_bundle_dir: Path) -> None:
    kept = faults_in_a_started_service(digits_bundle_dir, "32")
    defaults = faults_in_a_started_service(digits_bundle_dir, "0")
    # 20 rounds of 24 MiB: glibc's defaults (whose thresholds follow the largest block
    # freed, 4 MiB, and twice that) hand most of it back each round and fault it in again
    # (60,920 faults when written); the kept heap reuses the first round's pages (0).
    assert defaults > 20_000, defaults
    assert kept < 1_000, kept


def test_zero_leaves_the_allocator_alone_and_a_negative_size_is_refused() -> None:
    assert keep_freed_memory(0) is False
    with pytest.raises(ValueError, match="mib must be >= 0, got -1"):
        keep_freed_memory(-1)
    assert keep_freed_memory(32) is GLIBC
