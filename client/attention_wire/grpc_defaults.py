"""grpcio's I/O settings for this project's clients and servers, applied before grpc loads.

grpcio 1.85 moves a connection's bytes through its EventEngine by default, with a thread hop
between the socket's poller and the work on it. Its older path (``iomgr``) is still built in
and selected per side by two of grpc's experiment switches. With both sides on the older path,
a streamed 12 KB request and 8 KB reply on loopback took 0.113 ms instead of 0.235 ms (p50,
dev box; the server's CPU per message 76 instead of 131 us), and 96 MiB up + 32 MiB down in
1 MiB messages moved 1.74-1.83 GB/s instead of 1.44-1.55. On an H100 host the echo went 0.26-0.28
-> 0.12-0.13 ms and a one-client decode step's overhead fell 0.08-0.31 ms (docs/service.md,
Wire behaviour; benchmarks/results/README.md).

grpc reads ``GRPC_EXPERIMENTS`` once, when it is first imported, so ``apply`` must run before
that: ``attention_service`` and ``attention_client`` call it first thing. It does nothing when
``GRPC_EXPERIMENTS`` is already set (to anything, even empty: the way to keep grpc's defaults),
or when grpc is already imported (too late to matter; child processes are left alone too).
"""

from __future__ import annotations

import os
import sys

ENV = "GRPC_EXPERIMENTS"
# The client side's and the server side's switch back to iomgr endpoints.
LEGACY_IO = "-event_engine_client,-event_engine_listener"


def apply() -> None:
    """Set ``GRPC_EXPERIMENTS`` to ``LEGACY_IO`` if it is unset and grpc is not loaded yet."""
    if ENV not in os.environ and "grpc" not in sys.modules:
        os.environ[ENV] = LEGACY_IO
