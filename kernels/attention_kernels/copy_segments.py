"""Many memory-to-memory copies in one launch: a table of (source address, destination
address, length, 0) rows, each copied by its own programs. A row is 32 bytes, so any slice of
rows starts 16-byte aligned and launches the variant the warm-up compiled (Triton specializes
a pointer on its alignment).

Why: the service packs a batch of small requests into one kernel call. Per request it made
three typed views of pinned host memory and queued three copies into the packed device tensors
(and one view and copy back for the output): ~18% of the engine's GIL samples under 64 clients
of small prefills (py-spy, H100 host, 2026-11-27), for batches of ~18 requests. With the table
built in numpy, one launch reads every request's bytes straight from host memory that is
mapped into the device's address space (page-locked memory under unified addressing, where
``can_use_host_pointers`` holds), and one more writes the outputs back.

``copy_segments_ref`` is the same on the host, for tests and the interpreter's peers.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import triton
import triton.language as tl

# Units the copies move per element: the largest that divides every address and length.
_UNITS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}
BLOCK = 2048  # units per program: 16 KB of int64 words
_MAX_GRID_Y = 65535
MAX_UNITS = BLOCK * _MAX_GRID_Y  # the longest segment one launch copies, in units
ROW = 4  # int64 columns per table row: source, destination, length, padding


@triton.jit
def _copy_segments_kernel(table_ptr, UNIT: tl.constexpr, BLOCK: tl.constexpr):
    seg = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1).to(tl.int64) * BLOCK
    row = table_ptr + seg * 4
    n = tl.load(row + 2)
    if start < n:
        src = tl.load(row).to(tl.pointer_type(UNIT))
        dst = tl.load(row + 1).to(tl.pointer_type(UNIT))
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def unit_of(*values: int) -> int:
    """The largest of 8, 4, 2, 1 bytes that divides every value (addresses and lengths)."""
    bits = 0
    for v in values:
        bits |= v
    for unit in (8, 4, 2):
        if bits % unit == 0:
            return unit
    return 1


def copy_segments(table: torch.Tensor, unit: int, max_units: int) -> None:
    """Copy every row of ``table`` (int64 ``[n, 4]``, contiguous, on the device that runs the
    copies: source address, destination address, length in ``unit``-byte units, 0) in one
    launch on the current stream. Addresses must be readable (sources) and writable
    (destinations) by that device: its own memory, or page-locked host memory where
    ``can_use_host_pointers``. Segments must not overlap one another's destinations; none may
    be longer than ``MAX_UNITS``."""
    if (table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != ROW
            or not table.is_contiguous()):
        raise ValueError(f"table must be contiguous int64 [n, {ROW}], got {table.dtype} "
                         f"{tuple(table.shape)}")
    if unit not in _UNITS:
        raise ValueError(f"unit must be one of {sorted(_UNITS)} bytes, got {unit}")
    if table.shape[0] == 0 or max_units <= 0:
        return
    if max_units > MAX_UNITS:
        raise ValueError(f"a segment of {max_units} units is over {MAX_UNITS}")
    chunks = triton.cdiv(max_units, BLOCK)
    _copy_segments_kernel[(table.shape[0], chunks)](table, UNIT=_UNITS[unit], BLOCK=BLOCK)


def copy_segments_ref(table: torch.Tensor, unit: int) -> None:
    """``copy_segments`` on the host, one ``ctypes.memmove`` per row (host addresses only)."""
    for src, dst, n, _ in table.tolist():
        ctypes.memmove(dst, src, n * unit)


@functools.cache
def can_use_host_pointers(device_index: int) -> bool:
    """Whether device ``device_index`` reads page-locked host memory at its host address
    (CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, 91): then a kernel may take
    a registered arena's host pointers as they are. False where the driver cannot say."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        value = ctypes.c_int(0)
        # The answer is cached: asked before anything initialized the driver, the query
        # would fail (CUDA_ERROR_NOT_INITIALIZED) and say False for good. cuInit is idempotent.
        rc = lib.cuInit(0) or lib.cuDeviceGetAttribute(ctypes.byref(value), 91,
                                                        int(device_index))
    except (OSError, AttributeError):
        return False
    return rc == 0 and value.value == 1


def warm(device: torch.device | str) -> None:
    """Compile every unit's variant now (a server's warm-up), each checked on a small
    device-to-device copy: the first batch packed by this kernel must not wait ~1 s for it."""
    src = torch.arange(64, dtype=torch.uint8, device=device)
    for unit in _UNITS:
        dst = torch.zeros(64, dtype=torch.uint8, device=device)
        table = torch.tensor([[src.data_ptr() + 8, dst.data_ptr() + 16, 16 // unit, 0]],
                             dtype=torch.int64, device=device)
        copy_segments(table, unit, 16 // unit)
        if not torch.equal(dst[16:32], src[8:24]) or dst[:16].any() or dst[32:].any():
            raise RuntimeError(f"copy_segments ({unit}-byte units) copied wrong bytes")
