"""``DeviceArray``: a contiguous array known by its address, shape, dtype and device alone.

The kernel wrappers take one wherever they read only what it has (shape, dtype, device,
strides, address): cu_seqlens, ``copy_segments``' table. A caller that lays out a launch's
small arrays in memory of its own (the service's engine) then makes no torch call per view:
each torch call lets the GIL go, and under load getting it back cost the engine's dispatcher
~0.1 ms a call (native py-spy, H200, 2026-11-28). Triton takes any object with
``data_ptr()`` and ``dtype`` as a pointer argument.
"""

from __future__ import annotations

import math

import torch


class DeviceArray:
    """A contiguous array at a device address (memory someone else keeps alive)."""

    __slots__ = ("_ptr", "device", "dtype", "shape")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        self._ptr = ptr
        self.shape = shape
        self.dtype = dtype
        self.device = device

    def data_ptr(self) -> int:
        return self._ptr

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def is_contiguous(self) -> bool:
        return True

    def stride(self, dim: int | None = None) -> tuple[int, ...] | int:
        strides, step = [], 1
        for n in reversed(self.shape):
            strides.append(step)
            step *= n
        strides.reverse()
        return tuple(strides) if dim is None else strides[dim]

    def __getitem__(self, rows: slice) -> DeviceArray:
        """Rows ``start:stop`` along the first dimension (no step); nothing else."""
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("a DeviceArray takes a slice of rows only")
        start, stop, _ = rows.indices(self.shape[0])
        row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        return DeviceArray(self._ptr + start * row_bytes, (max(0, stop - start),
                                                           *self.shape[1:]),
                           self.dtype, self.device)

    def __repr__(self) -> str:
        return f"DeviceArray({self.dtype}, {self.shape}, {self.device}, 0x{self._ptr:x})"
