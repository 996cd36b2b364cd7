"""Wire bytes <-> torch tensors: dtype tables, input buffers, output row slices.

Tensors travel as little-endian row-major bytes; torch's in-memory layout on every supported host
(x86-64, aarch64) is little-endian, so bytes are copied as they are.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import numpy as np
import torch
from attention_client.pb import attention_pb2 as pb

from attention_service.wire import encode_output_chunk

if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts in scope
    raise ImportError("attention_service needs a little-endian host")

TORCH_DTYPES: dict[int, torch.dtype] = {
    pb.FLOAT16: torch.float16,
    pb.BFLOAT16: torch.bfloat16,
    pb.FLOAT32: torch.float32,
}
PB_DTYPES: dict[torch.dtype, int] = {v: k for k, v in TORCH_DTYPES.items()}
ELEMENT_BYTES: dict[int, int] = {pb.FLOAT16: 2, pb.BFLOAT16: 2, pb.FLOAT32: 4}

# Allocates an uninitialised uint8 host buffer (pinned on a GPU backend).
HostAllocator = Callable[[int], torch.Tensor]


def dtype_name(value: int) -> str:
    try:
        return pb.DType.Name(value)
    except ValueError:
        return str(value)


class TensorBuffer:
    """Host bytes of one input tensor, filled chunk by chunk in order."""

    def __init__(self, nbytes: int, alloc: HostAllocator) -> None:
        self.nbytes = nbytes
        self.received = 0
        self._storage = alloc(nbytes)
        self._view = self._storage.numpy()  # shares memory, so writes are plain memcpy

    def write(self, data: bytes) -> None:
        n = len(data)
        self._view[self.received : self.received + n] = np.frombuffer(data, dtype=np.uint8)
        self.received += n

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self._storage.view(dtype).view(shape)


def spec(tensor: torch.Tensor) -> pb.TensorSpec:
    return pb.TensorSpec(dtype=PB_DTYPES[tensor.dtype], shape=list(tensor.shape))


def output_messages(
    field: int, tensor: torch.Tensor, chunk_bytes: int
) -> Iterator[tuple[int, bytes]]:
    """Row slices of ``tensor`` (a host tensor) of at most ``chunk_bytes`` data each, as
    (data bytes, encoded AttentionResponse) pairs (see wire.py).

    A single row larger than ``chunk_bytes`` still goes out whole (one row per message):
    validation keeps every row under the 4 MiB message limit.
    """
    tensor = tensor.contiguous()
    rows = tensor.shape[0]
    row_bytes = tensor[0].numel() * tensor.element_size() if rows else 0
    per_msg = max(1, chunk_bytes // row_bytes) if row_bytes else max(rows, 1)
    raw = memoryview(tensor.view(-1).view(torch.uint8).numpy() if tensor.numel()
                     else np.empty(0, np.uint8))
    tspec = spec(tensor)
    start = 0
    while True:
        count = min(per_msg, rows - start)
        data = raw[start * row_bytes : (start + count) * row_bytes]
        yield len(data), encode_output_chunk(field, tspec, start, count, data)
        start += count
        if start >= rows:
            return
