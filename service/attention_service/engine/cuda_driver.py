"""CUDA driver calls that keep the GIL.

Why: under 64 clients of small prefills the engine's dispatcher spent 2.5-3.9 ms issuing a
batch that issues in 0.31 ms in a quiet process (H200, 2026-11-28), 41-57% of its wall time
spent taking the GIL back after the torch and Triton calls that let it go (native py-spy): each
such call hands the GIL to a channel reader or the completer, and the dispatcher then waits for
that thread's Python and for the OS to wake it again. ``Driver`` calls ``libcuda`` through
``ctypes.PyDLL``, which holds the GIL for the call (a ``CDLL`` call releases it). Only calls
that return at once are made this way: an event record, and an async copy from page-locked
memory. (Views of what the launch laid out itself go without torch calls too:
``attention_kernels.DeviceArray``.)
"""

from __future__ import annotations

import ctypes
import threading


class DriverError(RuntimeError):
    pass


class Driver:
    """The few ``libcuda`` calls a launch makes holding the GIL (see the module doc). A thread
    that has not used CUDA through torch yet gets the device's primary context (torch's)."""

    def __init__(self, device_index: int) -> None:
        lib = ctypes.PyDLL("libcuda.so.1")
        u64, ptr, size = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
        self._memcpy = lib.cuMemcpyHtoDAsync_v2
        self._memcpy.argtypes = (u64, ptr, size, ptr)
        self._record = lib.cuEventRecord
        self._record.argtypes = (ptr, ptr)
        self._get_ctx = lib.cuCtxGetCurrent
        self._set_ctx = lib.cuCtxSetCurrent
        self._set_ctx.argtypes = (ptr,)
        for f in (self._memcpy, self._record, self._get_ctx, self._set_ctx):
            f.restype = ctypes.c_int
        dev, ctx = ctypes.c_int(0), ctypes.c_void_p(0)
        self._check(lib.cuInit(0), "cuInit")
        self._check(lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
                    "cuDevicePrimaryCtxRetain")
        self._ctx = ctx
        self._threads = threading.local()  # .ready: this thread has a current context

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise DriverError(f"{what} failed: CUresult {rc}")

    def _ensure_context(self) -> None:
        if getattr(self._threads, "ready", False):
            return
        current = ctypes.c_void_p(0)
        self._check(self._get_ctx(ctypes.byref(current)), "cuCtxGetCurrent")
        if not current.value:
            self._check(self._set_ctx(self._ctx), "cuCtxSetCurrent")
        self._threads.ready = True

    def copy_to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue ``nbytes`` from page-locked host address ``src`` to device address ``dst``
        on ``stream`` (a raw CUstream); returns at once."""
        self._ensure_context()
        self._check(self._memcpy(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")

    def record(self, event: int, stream: int) -> None:
        """``cuEventRecord`` of a raw CUevent (a torch event's ``cuda_event``) on ``stream``."""
        self._ensure_context()
        self._check(self._record(event, stream), "cuEventRecord")
