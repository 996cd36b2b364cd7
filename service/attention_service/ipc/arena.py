"""Shared memory between a front-end process and the engine: one arena per front end.

The engine creates each arena (an anonymous ``memfd``: no file in /dev/shm, gone with the last
process that maps it), page-locks it for the GPU (``cudaHostRegister``) and hands the
descriptor to the front end it belongs to. The front end alone allocates from it (one event
loop, no locks): a call's tensors, inputs and outputs, in one block. The front end writes the
request bytes there once; the engine copies them to the GPU and the outputs back into the same
block; the front end streams them out and frees the block when both are done with it.

A call that does not fit the free space gets a one-off segment (another memfd, sent with the
request), so nothing waits or fails for want of arena; those copies run from pageable memory.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np

from attention_wire.alloc import ALIGN, FreeList, align, layout

__all__ = ["ALIGN", "FreeList", "Mapped", "align", "create", "layout"]


def create(size: int, name: str = "attention-arena") -> int:
    """A new anonymous shared-memory object of ``size`` bytes; returns its descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


class Mapped:
    """A shared-memory object mapped read-write: ``array`` is its bytes (uint8, writable)."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self.mm = mmap.mmap(fd, size)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)

    def close(self) -> None:
        self.array = np.empty(0, np.uint8)
        # Views still alive somewhere: the mapping goes with the last one.
        with contextlib.suppress(BufferError):
            self.mm.close()
