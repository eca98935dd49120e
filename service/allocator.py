"""The C allocator's thresholds: freed memory kept for reuse, not handed back per request.

glibc's ``malloc`` serves a block above its mmap threshold (128 KiB at first) with fresh
pages from the kernel and returns them when it is freed, and it trims the top of its heap
once more than the trim threshold (128 KiB) lies free there. A request for a large image
allocates and frees arrays of megabytes (the decoded pixels, gradients, bins), so under the
defaults each one comes back as fresh pages that fault and are zeroed on first touch, on
every request. Measured on the shared 2-core machine (2026-11-28): ``hog`` on a 512 px
image 6.7 → 1.7 ms a call, ``lbp`` 4.8 → 1.9, ``histogram`` 2.1 → 0.44
(``docs/benchmarks/extractors.md`` has both columns); in-process, the digits bundle's plan
at 512 px and a 20 ms budget 8.3 → 4.2 ms of extraction, and decoding a 128 px PNG 0.17 →
0.10 ms. :func:`keep_freed_memory` raises both thresholds, once
per process: the service at start-up (``BUDGETSERVE_ALLOCATOR_KEEP_MB``), the builders
before they profile, so the costs a bundle records are the ones served. The price is
memory: each allocator arena (the event loop's, one per extraction thread) may keep up to
that much freed memory for its next request (``docs/operating.md``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

#: The service's default (``BUDGETSERVE_ALLOCATOR_KEEP_MB``) and the builders' setting, MiB.
DEFAULT_KEEP_MIB = 32
#: glibc refuses an mmap threshold above 32 MiB on 64-bit machines (HEAP_MAX_SIZE / 2):
#: blocks larger than that (a 4096 px image's pixels) are still mapped and unmapped.
MMAP_THRESHOLD_MAX_MIB = 32

# mallopt's parameter numbers (<malloc.h>)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(mib: int = DEFAULT_KEEP_MIB) -> bool:
    """Let this process's allocator keep up to ``mib`` MiB of freed memory per arena for
    reuse, and serve blocks up to ``min(mib, 32)`` MiB from its heaps instead of fresh
    mappings (see the module). True when applied; False with ``mib`` 0 (glibc's defaults
    stay) or on a C library other than glibc (musl, macOS: nothing to tune this way)."""
    if mib < 0:
        raise ValueError(f"mib must be >= 0, got {mib}")
    if mib == 0 or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mmap_bytes = min(mib, MMAP_THRESHOLD_MAX_MIB) << 20
    trim_bytes = mib << 20
    applied = libc.mallopt(_M_MMAP_THRESHOLD, mmap_bytes) == 1
    return bool(libc.mallopt(_M_TRIM_THRESHOLD, trim_bytes) == 1 and applied)
