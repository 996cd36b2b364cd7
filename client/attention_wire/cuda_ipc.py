"""CUDA IPC through the driver API (``libcuda.so.1``, present wherever a GPU is), by ctypes.

The exporting process gets a 64-byte handle for the allocation that holds a device pointer
(plus the pointer's offset inside it); the importing process opens the handle, which maps the
same device memory into its own address space. Both must use the same GPU. torch's caching
allocator hands out slices of larger ``cudaMalloc`` blocks, hence the offset. Memory from
``cudaMallocAsync`` pools or torch's expandable segments cannot be exported this way (the
driver refuses, and the error says so).

Every call needs the device's primary context current on the calling thread. A torch call on
the device usually makes it so, but not always (a thread whose allocation came from torch's
cache never touched the runtime): ``use_primary_context`` makes sure.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 0x1


class CudaIpcError(RuntimeError):
    pass


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


_lib: ctypes.CDLL | None = None


def _driver() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaIpcError(f"CUDA driver library not found: {exc}") from None
        u64p = ctypes.POINTER(ctypes.c_uint64)
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [u64p, _Handle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        lib.cuMemGetAddressRange_v2.argtypes = [u64p, ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.c_uint64]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
        _lib = lib
    return _lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(rc, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else "unknown error"
        raise CudaIpcError(f"{what} failed: CUDA error {rc} ({text})")


def use_primary_context(ordinal: int) -> None:
    """Make device ``ordinal``'s primary context (the one torch and the runtime use) current
    on this thread if no context is. Seen on an H200 host: a pytest worker's region export
    failed with CUDA_ERROR_INVALID_CONTEXT although torch had just handed it the memory."""
    lib = _driver()
    ctx = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if ctx.value:
        return
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    primary = ctypes.c_void_p()
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), dev), "cuDevicePrimaryCtxRetain")
    try:
        _check(lib.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
    finally:
        # The runtime holds its own reference: the context stays alive (and current).
        lib.cuDevicePrimaryCtxRelease_v2(dev)


def address_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the allocation that contains device pointer ``ptr``."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check(_driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
           "cuMemGetAddressRange")
    return base.value, size.value


@dataclass(frozen=True)
class Export:
    handle: bytes  # 64 bytes
    offset: int  # of the pointer inside the exported allocation
    allocation_bytes: int


def export(ptr: int) -> Export:
    """An IPC handle for the allocation holding device pointer ``ptr``."""
    base, size = address_range(ptr)
    h = _Handle()
    _check(_driver().cuIpcGetMemHandle(ctypes.byref(h), base), "cuIpcGetMemHandle")
    # Not h.reserved: a c_char array reads as a NUL-terminated string.
    return Export(ctypes.string_at(ctypes.addressof(h), HANDLE_BYTES), ptr - base, size)


def open_handle(handle: bytes) -> tuple[int, int]:
    """Map another process's allocation: (device pointer, allocation size)."""
    if len(handle) != HANDLE_BYTES:
        raise ValueError(f"an IPC handle has {HANDLE_BYTES} bytes, got {len(handle)}")
    h = _Handle()
    ctypes.memmove(ctypes.byref(h), handle, HANDLE_BYTES)
    ptr = ctypes.c_uint64()
    _check(_driver().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS),
           "cuIpcOpenMemHandle")
    return ptr.value, address_range(ptr.value)[1]


def close_handle(ptr: int) -> None:
    _check(_driver().cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")


def device_uuid(device: object) -> bytes:
    """The 16-byte UUID of a torch CUDA device (torch gives it as a list of ints)."""
    import torch

    return bytes(torch.cuda.get_device_properties(device).uuid.bytes)


class DeviceBytes:
    """``size`` bytes at device pointer ``ptr`` as a ``__cuda_array_interface__`` (uint8), so
    ``torch.as_tensor(obj, device=...)`` wraps them without a copy; the tensor keeps ``owner``
    (anything that must outlive it) alive through this object."""

    def __init__(self, ptr: int, size: int, owner: object = None) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }
