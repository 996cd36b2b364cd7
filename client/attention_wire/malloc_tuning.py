"""glibc malloc settings for processes that move large gRPC messages.

Every message grpc receives or sends (1 MiB by default here) is a Python ``bytes`` object and
grpc slices of that size. glibc serves blocks over its mmap threshold (128 KiB, raised as such
blocks are freed) with fresh ``mmap`` calls, and gives the top of its heap back to the kernel
once more than twice that is free; either way the next message's pages are faulted in again,
one by one. Keeping blocks up to ``MMAP_THRESHOLD`` in the heap and up to ``TRIM_THRESHOLD``
of free heap in the process removes those faults. Measured on the dev box (raw grpc.aio,
96 MiB up + 32 MiB down in 1 MiB messages, loopback): the server's CPU per GB moved
0.47-0.52 -> 0.35-0.38 s, the client's 0.42-0.44 -> 0.36-0.43 s; a front end serving 87-token
prefills over a null engine 833-920 -> 705-708 us of CPU per call.

The cost: each malloc arena of the process may keep up to ``TRIM_THRESHOLD`` of freed memory
(a handful of arenas: the threads that allocate), and blocks of 128 KiB - 8 MiB come from the
heap, where they can fragment it. The server applies this in each of its processes
(``attention_service`` imports it first thing); a client process only when asked
(``ATTENTION_MALLOC_TUNING=1``, or ``apply(default=True)``): a library should not change the
allocator of the application that imports it unasked.

``ATTENTION_MALLOC_TUNING=0`` leaves malloc alone everywhere, and so does any glibc malloc
setting of the user's own (``MALLOC_*_`` variables or ``GLIBC_TUNABLES``). Elsewhere than on
glibc (musl, macOS) nothing is done.
"""

from __future__ import annotations

import ctypes
import os

ENV = "ATTENTION_MALLOC_TUNING"
MMAP_THRESHOLD = 8 << 20  # above any gRPC message of ours (4 MiB limit)
TRIM_THRESHOLD = 32 << 20  # 32 / 64 / 128 MiB measured alike
# mallopt's parameter numbers (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                  "MALLOC_MMAP_MAX_", "GLIBC_TUNABLES")


def wanted(default: bool) -> bool:
    """Whether to tune this process: ``ENV`` says (``0`` no, anything else yes), else
    ``default``; never over a malloc setting of the user's own."""
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    value = os.environ.get(ENV, "").strip()
    return default if not value else value != "0"


def apply(default: bool) -> None:
    """Raise glibc's mmap and trim thresholds in this process (see the module's doc), if
    ``wanted(default)`` and the C library is glibc."""
    if not wanted(default):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- glibc's own symbol: not musl, not macOS
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
