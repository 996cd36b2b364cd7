"""UCX settings both sides' NIXL agents start with (the client's and the engine's), applied
before the agent is made: UCX reads its environment then. A value the operator set stays.

* ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``: UCX keeps cuda_ipc reads (get) off on a GPU without
  NVLink peers, and a read of GPU memory then crawls through TCP emulation: 0.5-0.6 GB/s
  against 1.7 TB/s with it on (one H200, 128 MiB between two processes, 2026-11-30). Reads
  are how the engine pulls a call's inputs.
* ``UCX_TCP_TX_SEG_SIZE`` / ``UCX_TCP_RX_SEG_SIZE`` 64 KiB (UCX's default 8 KiB): over TCP
  alone (``UCX_TLS=tcp,self``; a remote host without RDMA) a 128 MiB read between two
  processes ran 1.57 GB/s with 8 KiB segments and 3.2-4.3 GB/s with 64 KiB to 4 MiB ones
  (dev box, loopback, 2026-11-30); writes ran ~4 GB/s either way.
"""

from __future__ import annotations

import os

DEFAULTS = {
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
    "UCX_TCP_TX_SEG_SIZE": "64k",
    "UCX_TCP_RX_SEG_SIZE": "64k",
}


def apply() -> None:
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
