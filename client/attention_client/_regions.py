"""Same-host zero copy: shared-memory regions registered with the server.

``client.register_shm(nbytes)`` creates a POSIX shared-memory object, maps it and registers
it; ``client.register_cuda(nbytes)`` allocates device memory and registers its CUDA IPC
handle. Then every call looks at where its tensors live:

* a tensor inside a registered region (e.g. made with ``region.empty(shape, dtype)``) is sent
  as a span of it: no bytes on the wire, the server reads it in place;
* otherwise, if a region has room, the tensor is staged into it (one local copy, far cheaper
  than gRPC; host tensors into a system region, cuda tensors into a cuda region of their GPU,
  else a system region);
* the outputs go into the region that holds q (scratch space), and are copied out to a fresh
  array or tensor when the call returns, unless ``out=`` names a tensor inside a region: then
  the server writes it in place and that tensor is returned.

``use_regions=False`` (per client or per call) sends bytes as usual. A call whose tensors fit
nowhere also falls back to bytes. Scratch space of a call that failed or was cancelled is not
reused until the server reports the region idle (its copies into it may still be running).

Here too, what the client does with its regions: ``new_region`` (one to register),
``forgotten`` (those a restarted server no longer knows) and ``release_idle``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
import os
import secrets
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from attention_client._errors import AttentionError, AttentionInputError, AttentionResourceError
from attention_client._tensors import (
    RegionTensor,
    describe,
    is_torch_tensor,
    storage_dtype,
    to_wire,
)
from attention_wire import shm, ucx_defaults
from attention_wire.alloc import FreeList
from attention_wire.pb import attention_pb2 as pb

_names = itertools.count()


def region_name(prefix: str = "client") -> str:
    return f"{prefix}-{os.getpid()}-{next(_names)}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class Span:
    """Bytes of one tensor in a region."""

    region: SharedRegion
    offset: int
    nbytes: int

    def message(self) -> pb.RegionSpan:
        return pb.RegionSpan(region=self.region.name, offset=self.offset, byte_size=self.nbytes)


def pointer(x: Any) -> tuple[int, int, str, int] | None:
    """(address, bytes, device type, device index) of a C-contiguous array or tensor."""
    if is_torch_tensor(x):
        if not x.is_contiguous():
            return None
        dev = x.device
        return x.data_ptr(), x.numel() * x.element_size(), dev.type, dev.index or 0
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            return None
        return x.__array_interface__["data"][0], x.nbytes, "cpu", 0
    return None


class SharedRegion:
    """A registered region: ``name``, ``kind`` ("system" | "cuda" | "nixl"), ``nbytes``, and
    ``device`` (its GPU, or None for host memory). Allocate tensors in it with ``empty``;
    ``close`` (or the context manager) unregisters it."""

    def __init__(
        self, name: str, kind: str, memory: Any, release: Callable[[], None],
        buffer: Any = None,
    ) -> None:
        self.name = name
        self.kind = kind
        # uint8 view of the whole region: np.ndarray (host memory) or torch tensor (a GPU's).
        self._memory = memory
        self._buffer = buffer  # host memory: the mmap that ``empty`` arrays view
        if is_torch_tensor(memory):
            self.nbytes = int(memory.numel())
            self.device = memory.device
            self._base = memory.data_ptr()
        else:
            self.nbytes = int(memory.size)
            self.device = None
            self._base = memory.__array_interface__["data"][0]
        # Set by the client that registers it: tells the server the region is gone (the async
        # client sets ``_aunregister`` instead: close it with ``await region.aclose()``).
        self._unregister: Callable[[SharedRegion], None] | None = lambda region: None
        self._aunregister: Callable[[SharedRegion], Awaitable[None]] | None = None
        self._release = release
        # What registered it (set by the client): sent again if the server forgets it.
        self._register_request: pb.RegisterRegionRequest | None = None
        self._lock = threading.Lock()
        self._free = FreeList(self.nbytes)
        self._quarantine: list[tuple[int, int]] = []  # scratch the server may still write
        self.closed = False

    def __repr__(self) -> str:
        return f"SharedRegion({self.name!r}, {self.kind}, {self.nbytes} bytes)"

    # ---- memory -------------------------------------------------------------------------

    def locate(self, x: Any) -> int | None:
        """Offset of ``x`` in this region if all of its bytes are inside, else None."""
        ptr = pointer(x)
        if ptr is None or self.closed:
            return None
        addr, n, dev_type, dev_index = ptr
        if (dev_type == "cuda") != (self.device is not None):
            return None
        if self.device is not None and dev_index != self.device.index:
            return None
        off = addr - self._base
        return off if off >= 0 and off + n <= self.nbytes and n > 0 else None

    def _alloc(self, nbytes: int) -> int | None:
        with self._lock:
            return self._free.alloc(max(nbytes, 1))

    def free(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._free.free(offset, max(nbytes, 1))

    def quarantine(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._quarantine.append((offset, nbytes))

    def release_quarantine(self) -> None:
        """The server reports no call using this region: quarantined scratch is free again."""
        with self._lock:
            held, self._quarantine = self._quarantine, []
            for off, n in held:
                self._free.free(off, max(n, 1))

    @property
    def has_quarantine(self) -> bool:
        return bool(self._quarantine)

    def raw(self, offset: int, nbytes: int) -> Any:
        """uint8 view of bytes [offset, offset + nbytes): numpy (host) or torch (a GPU's)."""
        return self._memory[offset : offset + nbytes]

    def typed(self, offset: int, shape: tuple[int, ...], wire_dtype: int) -> Any:
        """A wire-dtype storage view (numpy storage dtype, or torch on a GPU) of the span."""
        n = math.prod(shape) * storage_dtype(wire_dtype).itemsize
        raw = self.raw(offset, n)
        if self.device is not None:
            import torch

            return raw.view(_TORCH_STORAGE[wire_dtype](torch)).view(shape)
        return raw.view(storage_dtype(wire_dtype)).reshape(shape)

    def empty(self, shape: Any, dtype: Any) -> Any:
        """A new uninitialised array (numpy dtype) or tensor (torch dtype; always on a GPU)
        inside the region; its space returns to the region when it is garbage collected.
        Raises MemoryError when the region is full."""
        shape = tuple(int(d) for d in (shape if isinstance(shape, tuple | list) else (shape,)))
        torch_dtype = _torch_dtype(dtype)
        itemsize = torch_dtype.itemsize if torch_dtype is not None else np.dtype(dtype).itemsize
        nbytes = math.prod(shape) * itemsize
        off = self._alloc(nbytes)
        if off is None:
            raise MemoryError(f"region {self.name!r} has no room for {nbytes} bytes")
        # Each allocation gets an object of its own that every view of it references, so its
        # space comes back exactly when the last view is gone.
        if self.device is not None:
            import torch

            from attention_wire.cuda_ipc import DeviceBytes

            # The whole region's tensor is the owner: its memory outlives every view.
            dev_holder = DeviceBytes(self._base + off, max(nbytes, 1), owner=self._memory)
            weakref.finalize(dev_holder, self.free, off, nbytes)
            t = torch.as_tensor(dev_holder, device=self.device)[:nbytes]
            return t.view(torch_dtype or torch.uint8).view(shape)
        holder = np.frombuffer(self._buffer, dtype=np.uint8, count=max(nbytes, 1), offset=off)
        weakref.finalize(holder, self.free, off, nbytes)
        arr = holder[:nbytes]
        if torch_dtype is not None:
            import torch

            return torch.from_numpy(arr).view(torch_dtype).view(shape)
        return arr.view(np.dtype(dtype)).reshape(shape)

    # ---- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Unregister from the server and give the memory back (idempotent). Arrays made with
        ``empty`` keep their bytes mapped until they are garbage collected."""
        if self.closed:
            return
        if self._unregister is None:
            raise RuntimeError("a region of an AsyncAttentionClient: await region.aclose()")
        self.closed = True
        try:
            self._unregister(self)
        finally:
            self._release()

    async def aclose(self) -> None:
        """``close`` for a region of an AsyncAttentionClient."""
        if self.closed:
            return
        if self._aunregister is None:
            self.close()
            return
        self.closed = True
        try:
            await self._aunregister(self)
        finally:
            self._release()

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> SharedRegion:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


_TORCH_STORAGE = {
    pb.FLOAT16: lambda torch: torch.float16,
    pb.BFLOAT16: lambda torch: torch.int16,
    pb.FLOAT32: lambda torch: torch.float32,
    pb.FLOAT8_E4M3: lambda torch: torch.uint8,
}


def _torch_dtype(dtype: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        return dtype
    return None


def create_system_region(nbytes: int, name: str | None = None) -> tuple[SharedRegion, str]:
    """A new POSIX shared-memory object mapped here (not yet registered): (region, key)."""
    if nbytes <= 0:
        raise AttentionInputError(f"nbytes must be positive, got {nbytes}")
    key = shm.new_key("attention-client")
    try:
        mapping = shm.map_object(key, 0, nbytes, create=True)
    except OSError as exc:  # e.g. /dev/shm too small, or more than the address space
        raise AttentionResourceError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"nbytes: could not create a shared-memory region of {nbytes} bytes: {exc}",
        ) from exc
    memory = np.frombuffer(mapping.mm, dtype=np.uint8)
    region = SharedRegion(name or region_name(), "system", memory, lambda: None, mapping.mm)
    # A region never closed (a script that ends, or raises, before ``close``) must not leave
    # its object in /dev/shm for good: unlinked when the region is collected or the
    # interpreter exits. The server's mapping outlives the name. (Only a killed process leaves
    # one behind: ``attention-client-<pid>-*``.)
    unlink = weakref.finalize(region, shm.unlink, key)

    def release() -> None:
        unlink()
        with contextlib.suppress(BufferError):  # arrays still alive: unmapped with the last
            mapping.close()

    region._release = release
    return region, key


# This process's NIXL agent while it has NIXL regions: [agent, its name, regions]. Made by the
# first region and dropped with the last: the side whose memory is read needs NIXL's progress
# thread.
_NIXL: list[Any] = []
_NIXL_LOCK = threading.Lock()
# How long that thread waits on UCX's event file descriptors between polls, when nothing is
# due (NIXL's ``pthrDelay``, us). The wrapper sets 0, a spin of a whole core for the agent's
# life (1.0 CPU s per s idle); with a wait, the thread sleeps until UCX has work for it. Dev
# box, sim_server, B=64 steps through the step socket from host memory, 0 -> 1000 us: client
# CPU 1.11 -> 0.22 ms a step, p50 0.99 -> 1.02 ms (shared memory and cma; round 1: 0.93 ->
# 0.87); UCX over TCP 1.30 -> 0.57 ms of CPU, p50 1.13 -> 1.14 (2026-12-02).
NIXL_PROGRESS_WAIT_US = 1000


def _make_nixl_agent(nixl: Any, name: str) -> Any:
    """A UCX agent whose progress thread waits ``NIXL_PROGRESS_WAIT_US`` instead of spinning.
    The wrapper builds its config inside ``nixl_agent`` and sets ``pthrDelay = 0`` there, so
    the delay goes in at the binding's constructor, for this one call (under ``_NIXL_LOCK``);
    a wrapper without that constructor makes its agent as it would."""
    config = nixl.nixl_agent_config(backends=["UCX"])
    api = sys.modules.get(nixl.__name__ + "._api")
    bind = getattr(api, "nixlBind", None)
    real = getattr(bind, "nixlAgent", None)
    if real is None:
        return nixl.nixl_agent(name, config)

    def agent_with_wait(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = NIXL_PROGRESS_WAIT_US
        return real(agent_name, agent_config)

    bind.nixlAgent = agent_with_wait
    try:
        return nixl.nixl_agent(name, config)
    finally:
        bind.nixlAgent = real


def _nixl_agent() -> tuple[Any, str]:
    """The agent, counted: ``_nixl_done`` once per call."""
    with _NIXL_LOCK:
        if not _NIXL:
            try:
                import nixl_cu13 as nixl
            except ImportError:
                raise AttentionInputError(
                    "register_nixl needs NIXL in this process: pip install "
                    "'attention-client[nixl]' (the nixl-cu13 wheel)") from None
            name = f"attention-client-{os.getpid()}-{secrets.token_hex(4)}"
            ucx_defaults.apply()  # as the engine does: GPU memory and TCP at speed
            try:
                agent = _make_nixl_agent(nixl, name)
            except Exception as exc:  # UCX found no transport it may use (UCX_TLS, ...)
                raise AttentionError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"register_nixl: NIXL could not start its UCX backend in this process "
                    f"({type(exc).__name__}: {exc}); check UCX_TLS and UCX_NET_DEVICES") from None
            _NIXL.extend((agent, name, 0))
        _NIXL[2] += 1
        return _NIXL[0], _NIXL[1]


def _nixl_done() -> None:
    """One NIXL region went: the agent goes with the last (its progress thread stops)."""
    with _NIXL_LOCK:
        _NIXL[2] -= 1
        if not _NIXL[2]:
            _NIXL.clear()


def create_nixl_region(nbytes: int, name: str | None = None, device: Any = None) -> tuple[
    SharedRegion, pb.NixlRegion
]:
    """Memory of this process registered with its NIXL agent (not yet with the server): host
    memory, or with ``device`` that GPU's. The server, on any host, pulls inputs from it and
    pushes outputs into it over UCX."""
    if nbytes <= 0:
        raise AttentionInputError(f"nbytes must be positive, got {nbytes}")
    dev = None if device is None else _cuda_device("register_nixl", device)
    agent, agent_name = _nixl_agent()
    buffer = None
    try:
        if dev is None:
            buffer = mmap.mmap(-1, nbytes)
            memory = np.frombuffer(buffer, dtype=np.uint8)
            address = memory.__array_interface__["data"][0]
        else:
            import torch

            memory = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            address = memory.data_ptr()
    except (OSError, RuntimeError) as exc:  # no host memory, or the GPU's is full
        _nixl_done()
        raise AttentionResourceError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"nbytes: could not allocate a region of {nbytes} bytes: {exc}") from exc
    kind, index = ("DRAM", 0) if dev is None else ("VRAM", dev.index or 0)
    registered = None
    with _NIXL_LOCK:  # the agent is used from this lock only (NIXL's default: no locking)
        try:
            registered = agent.register_memory([(address, nbytes, index, "")], kind)
            # This memory's part of the agent's metadata (220 bytes against the agent's 456
            # with one region, growing with each): the connection went once, in ConnectNixl.
            metadata = agent.get_partial_agent_metadata(registered, False, ["UCX"])
        except Exception as exc:  # e.g. GPU memory where this UCX has no CUDA transport
            if registered is not None:
                agent.deregister_memory(registered)
            failed = exc
        else:
            failed = None
    if failed is not None:
        _nixl_done()
        raise AttentionError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"register_nixl: this process's NIXL could not register {kind} memory "
            f"({type(failed).__name__}: {failed}); check UCX_TLS") from None

    def release() -> None:  # the server has dropped it (or never took it): unregister here
        with _NIXL_LOCK:
            agent.deregister_memory(registered)
        _nixl_done()

    region = SharedRegion(name or region_name(), "nixl", memory, release, buffer)
    source = pb.NixlRegion(agent_metadata=metadata, address=address, memory=kind,
                           device_id=index, agent_name=agent_name)
    return region, source


def _agent_metadata(rpc: str, connection_only: bool) -> tuple[str, bytes]:
    """This process's agent's name and metadata: its connection alone (no memory), or all of
    it. The agent lives while the process has NIXL regions."""
    with _NIXL_LOCK:
        if not _NIXL:
            raise AttentionInputError(f"{rpc}: this process has no NIXL region")
        agent, name = _NIXL[0], _NIXL[1]
        if not connection_only:
            return name, agent.get_agent_metadata()
        import nixl_cu13 as nixl

        none = nixl._bindings.nixlRegDList(agent.nixl_mems["DRAM"], [])
        return name, agent.get_partial_agent_metadata(none, True, ["UCX"])


def nixl_connect_request() -> pb.ConnectNixlRequest:
    """ConnectNixl for this process's agent (made by its first NIXL region): its name and
    connection metadata."""
    name, metadata = _agent_metadata("ConnectNixl", connection_only=True)
    return pb.ConnectNixlRequest(agent_name=name, agent_metadata=metadata)


def with_full_nixl_metadata(request: pb.RegisterRegionRequest) -> pb.RegisterRegionRequest:
    """``request`` carrying this process's agent's whole metadata, not only its region's (for
    a server without ConnectNixl)."""
    full = pb.RegisterRegionRequest()
    full.CopyFrom(request)
    full.nixl.agent_metadata = _agent_metadata("RegisterRegion", connection_only=False)[1]
    return full


def create_cuda_region(nbytes: int, device: Any = None, name: str | None = None) -> tuple[
    SharedRegion, pb.CudaRegion
]:
    """Device memory (one allocation of its own) and its IPC export (not yet registered)."""
    import torch

    from attention_wire import cuda_ipc

    if nbytes <= 0:
        raise AttentionInputError(f"nbytes must be positive, got {nbytes}")
    dev = _cuda_device("register_cuda", device)
    with torch.cuda.device(dev):
        memory = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        cuda_ipc.use_primary_context(dev.index or 0)
        exported = cuda_ipc.export(memory.data_ptr())
        uuid = cuda_ipc.device_uuid(dev)
    source = pb.CudaRegion(ipc_handle=exported.handle, device_uuid=uuid,
                           offset=exported.offset)
    # Nothing to release by hand: the tensor (and every view handed out) frees it.
    return SharedRegion(name or region_name(), "cuda", memory, lambda: None), source


def _cuda_device(method: str, device: Any) -> Any:
    """``device`` (None: the current GPU) as a torch device, or AttentionInputError saying why
    there is none."""
    try:
        import torch
    except ImportError:
        raise AttentionInputError(f"{method} on a GPU needs torch") from None
    if not torch.cuda.is_available():
        raise AttentionInputError(
            f"{method} on a GPU needs a CUDA build of torch and a visible GPU (torch "
            f"{torch.__version__} sees none); register_shm makes a host-memory region")
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise AttentionInputError(f"device: {device!r} is not a device ({exc})") from None
    if dev.type != "cuda":
        raise AttentionInputError(f"device: {device!r} is not a GPU (use 'cuda' or 'cuda:N')")
    return torch.device("cuda", dev.index or 0)


def _stage(x: Any, name: str, region: SharedRegion, offset: int, shape: tuple[int, ...],
           wire_dtype: int) -> None:
    """Copy ``x`` into the region (host memcpy, or a torch copy to or from the GPU)."""
    dst = region.typed(offset, shape, wire_dtype)
    if is_torch_tensor(x):
        import torch

        src = x.detach()
        # The storage dtype: the bits are what travels (a copy between dtypes would convert).
        if src.dtype == torch.bfloat16:
            src = src.view(torch.int16)
        elif src.dtype == torch.float8_e4m3fn:
            src = src.view(torch.uint8)
        target = torch.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
        target.copy_(src.reshape(shape))
        return
    wire = to_wire(x, name)
    if isinstance(dst, np.ndarray):
        np.copyto(dst, wire.array.reshape(shape))
    else:
        import torch

        dst.copy_(torch.from_numpy(wire.array.reshape(shape)))


class Placement:
    """Where one call's tensors live. Scratch space (staged inputs, outputs) goes back when
    the call ends: at once after a success, after the server reports the region idle
    otherwise (a cancelled call's copies may still be running on the server)."""

    def __init__(self, regions: list[SharedRegion], stage: bool) -> None:
        self._regions = regions  # the client's open regions
        self._stage = stage
        self.scratch: list[Span] = []
        self.cuda_devices: set[Any] = set()

    def _note(self, region: SharedRegion) -> None:
        if region.device is not None:
            self.cuda_devices.add(region.device)

    def _scratch(self, region: SharedRegion, nbytes: int) -> Span | None:
        off = region._alloc(nbytes)
        if off is None:
            return None
        span = Span(region, off, nbytes)
        self.scratch.append(span)
        return span

    def _stage_order(self, x: Any) -> list[SharedRegion]:
        """Where a tensor not in any region may be copied: same GPU first, then host."""
        ptr = pointer(x) or (0, 0, "cuda" if is_torch_tensor(x) and x.is_cuda else "cpu", 0)
        on_gpu = ptr[2] == "cuda"
        gpu = [r for r in self._regions
               if r.device is not None and on_gpu and r.device.index == x.device.index]
        host = [r for r in self._regions if r.device is None]  # system or NIXL host memory
        return gpu + host

    def input(self, x: Any, name: str) -> Any:
        """A RegionTensor for ``x``, or None (send its bytes)."""
        shape, wire_dtype = describe(x, name)
        nbytes = math.prod(shape) * storage_dtype(wire_dtype).itemsize
        if nbytes == 0:
            return None
        big_endian = isinstance(x, np.ndarray) and x.dtype.byteorder == ">"
        for region in self._regions:
            off = None if big_endian else region.locate(x)
            if off is not None:
                self._note(region)
                return RegionTensor(name, shape, wire_dtype, Span(region, off, nbytes))
        if not self._stage:
            return None
        for region in self._stage_order(x):
            span = self._scratch(region, nbytes)
            if span is not None:
                _stage(x, name, region, span.offset, shape, wire_dtype)
                self._note(region)
                return RegionTensor(name, shape, wire_dtype, span)
        return None

    def output(self, near: Span, nbytes: int) -> Span | None:
        """Scratch for an output in the region of ``near`` (q's), or None (stream it)."""
        if nbytes == 0:
            return None
        span = self._scratch(near.region, nbytes)
        if span is not None:
            self._note(near.region)
        return span

    def user_output(self, x: Any) -> Span | None:
        """``out=``: a tensor inside a region, written in place."""
        for region in self._regions:
            off = region.locate(x)
            if off is not None:
                self._note(region)
                return Span(region, off, pointer(x)[1])  # type: ignore[index]
        return None

    def synchronize(self) -> None:
        """Before the request goes: the GPU work that fills the tensors has finished."""
        if self.cuda_devices:
            import torch

            for dev in self.cuda_devices:
                torch.cuda.synchronize(dev)

    def read(self, span: Span, shape: tuple[int, ...], wire_dtype: int) -> Any:
        """A private copy of an output in scratch (numpy storage, or a torch tensor)."""
        view = span.region.typed(span.offset, shape, wire_dtype)
        return view.clone() if not isinstance(view, np.ndarray) else np.array(view)

    def finish(self, ok: bool) -> None:
        for span in self.scratch:
            if ok:
                span.region.free(span.offset, span.nbytes)
            else:
                span.region.quarantine(span.offset, span.nbytes)
        self.scratch = []


# ---- a client's regions: registering, and after a server restart or a failed call ----


def new_region(
    kind: str, nbytes: int, name: str | None, device: Any
) -> tuple[SharedRegion, pb.RegisterRegionRequest]:
    """A new region of ``kind`` ("system", "cuda", "nixl") and its RegisterRegion request
    (kept on it: ``_register_request`` registers it again after a server restart)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int | np.integer):
        raise AttentionInputError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if name is not None:
        try:
            shm.check_name(name)
        except (TypeError, ValueError) as exc:
            raise AttentionInputError(f"name: {exc}") from None
    if kind == "system":
        region, key = create_system_region(nbytes, name)
        source = {"system": pb.SystemRegion(key=key)}
    elif kind == "nixl":
        region, nixl = create_nixl_region(nbytes, name, device)
        source = {"nixl": nixl}
    else:
        region, cuda = create_cuda_region(nbytes, device, name)
        source = {"cuda": cuda}
    request = pb.RegisterRegionRequest(name=region.name, byte_size=region.nbytes, **source)
    region._register_request = request
    return region, request


def forgotten(regions: list[SharedRegion], listing: pb.ListRegionsResponse) -> list[SharedRegion]:
    """Of a client's open ``regions`` (``_live_regions``), those the server does not know: it
    restarted (regions do not survive a restart) or dropped them. Re-registering them
    (``_register_request``: the same memory, same name) lets calls go on."""
    known = {r.name for r in listing.regions}
    return [r for r in regions if r.name not in known]


def release_idle(regions: list[SharedRegion], listing: pb.ListRegionsResponse) -> None:
    """Give back the quarantined scratch of those of ``regions`` the server reports idle."""
    idle = {r.name for r in listing.regions if r.inflight == 0}
    for region in regions:
        if region.has_quarantine and region.name in idle:
            region.release_quarantine()
