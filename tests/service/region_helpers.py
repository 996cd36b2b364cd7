"""A POSIX shared-memory object a test owns, for the region tests on one process and on a
process group."""

from __future__ import annotations

import numpy as np
import torch

from attention_wire import shm
from attention_wire.pb import attention_pb2 as pb

MiB = 1 << 20


class Shm:
    """A POSIX shared-memory object the test owns (and maps), unlinked at the end."""

    def __init__(self, size: int = MiB) -> None:
        self.key = shm.new_key("attention-test")
        self.mapping = shm.map_object(self.key, 0, size, create=True)
        self.bytes = np.frombuffer(self.mapping.mm, dtype=np.uint8)
        self.size = size

    def put(self, offset: int, t: torch.Tensor) -> pb.RegionSpan:
        raw = t.contiguous().view(-1).view(torch.uint8).numpy()
        self.bytes[offset : offset + raw.size] = raw
        return pb.RegionSpan(offset=offset, byte_size=raw.size)

    def get(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        n = like.numel() * like.element_size()
        raw = torch.from_numpy(self.bytes[offset : offset + n].copy())
        return raw.view(like.dtype).view(like.shape)

    def close(self) -> None:
        shm.unlink(self.key)
        self.bytes = np.empty(0, np.uint8)
        self.mapping.close()
