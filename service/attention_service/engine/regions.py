"""Registered shared-memory regions: same-host zero copy, in the manner of Triton Inference
Server's shared-memory extension.

A client registers a region once; requests then name ``(region, offset, byte_size)`` spans
instead of carrying bytes. Two kinds:

* **system**: a POSIX shared-memory object (``/dev/shm/<key>``) mapped read-write here and, on
  the cuda backend, page-locked (``cudaHostRegister``) once at registration, so copies to and
  from the GPU run at full PCIe speed straight from the client's memory;
* **cuda**: device memory of another process, opened through its CUDA IPC handle; the bytes
  never leave the GPU;
* **nixl**: memory of a client on any host, registered with its NIXL agent: the engine keeps a
  mirror of the region in its own memory of the same kind (host memory, page-locked on cuda, for
  the client's host memory; the server's GPU for the client's GPU memory), pulls a call's input
  spans into it before the call and pushes its output spans back after (``nixl_agent.py``).
  The mirror counts against the caller's system bytes.

Safety rules:

* registration is allowed only when the operator allows it (``--regions``; by default only
  with auth on or on a loopback address: it makes the server map memory a caller names);
* a region belongs to its owner (the caller's token with auth on): another owner's lookups
  answer NOT_FOUND, never the bytes, and another owner cannot register the same system object
  or CUDA allocation (PERMISSION_DENIED) while it is registered;
* torch's caching allocator puts several tensors, so several regions, in one allocation (one
  IPC handle): the allocation's owner is who registered it first, and one mapping of it is
  shared by that owner's regions and closed with the last of them (CUDA documents one open
  per handle and process; older drivers answer "already mapped" to a second);
* an owner holds at most ``--max-regions-per-caller`` regions, system regions and NIXL
  mirrors in host memory of at most ``--system-region-bytes-per-caller`` bytes together (the
  server maps and page-locks those), and NIXL mirrors on the server's GPU of at most
  ``--gpu-region-bytes-per-caller``: RESOURCE_EXHAUSTED past any, checked before anything is
  mapped;
* every span is bounds-checked against its region (INVALID_ARGUMENT naming the field);
* a region dropped while calls use it stays mapped until the last of them finishes;
* a region no call has used for ``--region-ttl`` seconds is dropped (never while a call uses
  it): a client that died without unregistering (kill -9) would otherwise keep it mapped, and
  page-locked, and counted against its caller's limits, until the server restarts.
  ``attention_client`` registers a region the server dropped again on its next call;
* keys are one path component under /dev/shm, opened without following symlinks.

A system region's object must not shrink while registered: the server would fault on pages
that vanished (a same-host trust assumption Triton shares; it is why registration is opt-in).
Likewise, a caller may name any object in /dev/shm that the server's user may open and no
other caller has registered: system regions trust the processes of the host that run as the
server's user (which could map those objects themselves). The server's own shared memory
(arenas) is anonymous (memfd), never in /dev/shm.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from attention_service.engine.jobs import PINNED, ByteBase
from attention_service.engine.nixl_agent import NixlAgent, Observe
from attention_service.engine.nixl_agent import backend_name as nixl_backend
from attention_service.engine.sweeper import Sweeper
from attention_service.errors import RequestError, exhausted, invalid, not_found
from attention_service.params import RegionSpan
from attention_wire import cuda_ipc, shm
from attention_wire.pb import attention_pb2 as pb

log = logging.getLogger("attention_service")
# A UCX choice (ucx_choices.Choice) as NixlTransport takes it: its fields, in order.
_TRANSPORT_FIELDS = [f.name for f in pb.NixlTransport.DESCRIPTOR.fields]


CUDA_KEY = "cuda:"  # _Region.key of a CUDA region: this and its IPC handle in hex
# A call's spans in NIXL regions, by tensor name: (region, span).
NixlSpans = dict[str, tuple["_Region", RegionSpan]]


@dataclass(frozen=True)
class _Claim:
    """A registration in progress: its name, key and memory are taken while it maps."""

    key: str
    nbytes: int  # of the server's host memory
    gpu_bytes: int = 0  # of the server's GPU memory (a mirror of a client's GPU memory)


@dataclass(frozen=True)
class _Remote:
    """Where a NIXL region's bytes live: the client's agent and its memory."""

    peer: str
    address: int
    memory: str  # "DRAM" | "VRAM", the client's memory and the mirror's alike
    device: int  # the client's GPU (VRAM)
    local_device: int = 0  # the mirror's GPU (VRAM)


@dataclass(eq=False)
class _Region:
    owner: str
    name: str
    kind: str  # "system" | "cuda" | "nixl"
    tensor: torch.Tensor  # uint8 [byte_size], host or device
    closer: Callable[[], None]
    # A system region's object (``shm.check_key`` form), or CUDA_KEY + a CUDA region's handle.
    key: str = ""
    inflight: int = 0
    dropped: bool = False
    last_used: float = 0.0  # the clock's time when a call last let go of it (or registered)
    remote: _Remote | None = None  # a NIXL region's client memory (``tensor`` its mirror)
    gpu_mirror: bool = False  # ``tensor`` is the server's GPU memory, mirroring a client's
    base: ByteBase = field(init=False)

    def __post_init__(self) -> None:
        self.base = ByteBase(self.tensor)

    @property
    def size(self) -> int:
        return self.base.nbytes

    def info(self) -> pb.RegionInfo:
        return pb.RegionInfo(name=self.name, kind=self.kind, byte_size=self.tensor.numel(),
                             inflight=self.inflight)


def pin(tensor: torch.Tensor, nbytes: int) -> Callable[[], None]:
    """Page-lock host memory for full-speed DMA; returns the undo (a no-op if it failed)."""
    cudart = torch.cuda.cudart()
    ptr = tensor.data_ptr()
    rc = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(rc) != 0:
        log.warning("cudaHostRegister of %d bytes failed (error %s): copies run unpinned",
                    nbytes, int(rc))
        return lambda: None
    PINNED[ptr] = nbytes

    def unpin() -> None:
        PINNED.pop(ptr, None)  # first: no kernel is handed these addresses any more
        cudart.cudaHostUnregister(ptr)

    return unpin


class IpcMappings:
    """CUDA IPC handles opened in this process, one mapping per allocation, counted: two
    regions of one allocation (two tensors torch's caching allocator placed in one segment)
    share a mapping, closed when the last of them goes. CUDA documents one open per handle and
    process (older drivers refuse a second: "already mapped"); driver 580 counts the opens
    (git history: benchmarks/results/issue10/2026-11-29), so this is for the drivers that do not."""

    def __init__(self, open_handle: Callable[[bytes], tuple[int, int]],
                 close_handle: Callable[[int], None]) -> None:
        self._open = open_handle
        self._close = close_handle
        self._lock = threading.Lock()
        self._maps: dict[bytes, list[int]] = {}  # handle -> [pointer, allocation bytes, users]

    def open(self, handle: bytes) -> tuple[int, int]:
        """(device pointer, allocation bytes) of ``handle``'s allocation, mapped once."""
        with self._lock:  # held while opening: two first users must not both open it
            entry = self._maps.get(handle)
            if entry is None:
                ptr, alloc = self._open(handle)
                entry = self._maps[handle] = [ptr, alloc, 0]
            entry[2] += 1
            return entry[0], entry[1]

    def release(self, handle: bytes) -> None:
        with self._lock:
            entry = self._maps[handle]
            entry[2] -= 1
            if entry[2]:
                return
            del self._maps[handle]
        self._close(entry[0])

    def __len__(self) -> int:
        return len(self._maps)


class RegionRegistry:
    def __init__(
        self, backend: Any, allowed: bool, max_per_owner: int = 64,
        system_bytes_per_owner: int = 0, ttl_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic, observe_nixl: Observe | None = None,
        nixl: bool = True, gpu_bytes_per_owner: int = 0,
    ) -> None:
        """``max_per_owner``: regions one owner may hold; ``system_bytes_per_owner``: bytes
        of its system regions and host mirrors together, ``gpu_bytes_per_owner``: of its
        GPU mirrors (0 = no limit); ``ttl_seconds``: idle seconds after which a region is
        dropped (0 = never)."""
        self.backend = backend
        self.allowed = allowed
        self.max_per_owner = max_per_owner
        self.system_bytes_per_owner = system_bytes_per_owner
        self.gpu_bytes_per_owner = gpu_bytes_per_owner
        self.ttl = ttl_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._regions: dict[tuple[str, str], _Region] = {}
        self._claims: dict[tuple[str, str], _Claim] = {}  # registrations mapping right now
        self._ipc = IpcMappings(cuda_ipc.open_handle, self._close_ipc)
        self.nixl = NixlAgent(observe_nixl, enabled=nixl)
        self.expired_total = 0  # regions dropped by the TTL (a metric)
        self._sweeper = (Sweeper("region-ttl", ttl_seconds, self.expire)
                         if allowed and ttl_seconds > 0 else None)

    # ---- rpcs --------------------------------------------------------------------------

    def call(self, method: str, request: Any, owner: str) -> Any:
        if method == "RegisterRegion":
            return self.register(owner, request)
        if method == "UnregisterRegion":
            return pb.UnregisterRegionResponse(released=self.unregister(owner, request.name))
        if method == "ConnectNixl":
            self._check_allowed()
            self.nixl.connect(owner, request.agent_name, bytes(request.agent_metadata))
            return pb.ConnectNixlResponse(server_agent=self.nixl.name, backend=nixl_backend())
        if method == "GetServerInfo":  # the engine's live part of it (the front end's rest)
            return pb.ServerInfo(nixl_transports=[
                pb.NixlTransport(**dict(zip(_TRANSPORT_FIELDS, choice, strict=True)))
                for choice in self.nixl.transports()])
        if method == "ListRegions":
            with self._lock:
                mine = [r.info() for (o, _), r in self._regions.items() if o == owner]
            return pb.ListRegionsResponse(regions=mine)
        raise ValueError(f"unknown region method {method}")

    def _check_allowed(self) -> None:
        if not self.allowed:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "regions: shared-memory registration is off on this server (--regions on "
                "enables it; by default it is on only with auth or on a loopback address)",
            )

    def register(self, owner: str, req: pb.RegisterRegionRequest) -> pb.RegionInfo:
        self._check_allowed()
        try:
            shm.check_name(req.name)
        except ValueError as exc:
            raise invalid("name", str(exc)) from None
        if req.byte_size == 0:
            raise invalid("byte_size", "must be positive")
        kind = req.WhichOneof("source")
        key = ""
        if kind == "system":
            try:
                key = shm.check_key(req.system.key)
            except ValueError as exc:
                raise invalid("system.key", str(exc)) from None
        elif kind == "cuda":
            # The allocation's handle: one owner per allocation, as per system object.
            key = CUDA_KEY + bytes(req.cuda.ipc_handle).hex()
        elif kind != "nixl":
            raise invalid("source", "set system, cuda or nixl")
        # The server's memory it takes: a system region's mapping, a NIXL region's mirror (on
        # the server's GPU for the client's GPU memory).
        memory = self._nixl_memory(req.nixl) if kind == "nixl" else ""
        gpu = memory == "VRAM"
        claim = _Claim(key, 0 if kind == "cuda" or gpu else req.byte_size,
                       req.byte_size if gpu else 0)
        slot = (owner, req.name)
        with self._lock:  # name, key, count and bytes are taken together, then mapped
            self._check_free(owner, req.name, key)
            self._check_room(owner, claim)
            self._claims[slot] = claim
        try:
            remote = None
            if kind == "system":
                tensor, closer = self._open_system(req.system, req.byte_size)
            elif kind == "cuda":
                tensor, closer = self._open_cuda(req.cuda, req.byte_size)
            else:
                tensor, closer, remote = self._open_nixl(owner, req.nixl, memory,
                                                         req.byte_size)
            region = _Region(owner, req.name, kind, tensor, closer, key, remote=remote,
                             gpu_mirror=gpu)
        except BaseException:
            with self._lock:
                del self._claims[slot]
            raise
        with self._lock:
            del self._claims[slot]
            region.last_used = self._clock()
            self._regions[slot] = region
        log.info("region registered: kind=%s name=%s bytes=%d", kind, req.name, req.byte_size)
        return region.info()

    def _check_room(self, owner: str, claim: _Claim) -> None:
        """Under the lock: ``owner`` may take one more region, of ``claim``'s bytes."""
        held = [r for (o, _), r in self._regions.items() if o == owner]
        claimed = [c for (o, _), c in self._claims.items() if o == owner]
        if len(held) + len(claimed) >= self.max_per_owner:
            raise exhausted(
                "name", f"this caller holds {self.max_per_owner} regions, the server's limit "
                "(--max-regions-per-caller): unregister one first")
        for nbytes, limit, on_gpu, what, flag in (
                (claim.nbytes, self.system_bytes_per_owner, False,
                 "system (or NIXL host mirror) regions", "--system-region-bytes-per-caller"),
                (claim.gpu_bytes, self.gpu_bytes_per_owner, True,
                 "NIXL regions' mirrors on the server's GPU", "--gpu-region-bytes-per-caller")):
            if not limit or not nbytes:
                continue
            used = (sum(r.size for r in held if r.kind != "cuda" and r.gpu_mirror == on_gpu)
                    + sum(c.gpu_bytes if on_gpu else c.nbytes for c in claimed))
            if used + nbytes > limit:
                raise exhausted(
                    "byte_size", f"{nbytes} more bytes of {what} would make this caller's "
                    f"{used + nbytes}, over the server's limit of {limit} per caller ({flag}): "
                    "unregister regions or register less")

    def _check_free(self, owner: str, name: str, key: str) -> None:
        """Under the lock: ``name`` is not one of the owner's regions (registered or being
        registered), and no other caller has registered (or is registering) system object
        ``key``. A system object registered by one caller is theirs: another caller (token)
        naming the same object is refused, so a token cannot read or write another's region
        memory by its key (keys are visible to anyone on the host who lists /dev/shm)."""
        if (owner, name) in self._regions or (owner, name) in self._claims:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                               f"name: region {name!r} is already registered")
        taken = [(r.owner, r.key) for r in self._regions.values()]
        taken += [(o, c.key) for (o, _), c in self._claims.items()]
        if key and any(k == key and o != owner for o, k in taken):
            if key.startswith(CUDA_KEY):
                raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                                   "cuda.ipc_handle: that allocation is registered by another "
                                   "caller")
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED,
                "system.key: that shared-memory object is registered by another caller",
            )

    def unregister(self, owner: str, name: str) -> int:
        with self._lock:
            if name:
                if (owner, name) not in self._regions:
                    raise not_found("name", f"no region {name!r} is registered")
                keys = [(owner, name)]
            else:
                keys = [k for k in self._regions if k[0] == owner]
            gone = [self._regions.pop(k) for k in keys]
            to_close = []
            for r in gone:
                r.dropped = True
                if r.inflight == 0:
                    to_close.append(r)
        for r in to_close:
            self._close(r)
        return len(gone)

    # ---- requests ----------------------------------------------------------------------

    def acquire(
        self, owner: str, spans: Mapping[str, RegionSpan]
    ) -> tuple[dict[str, tuple[ByteBase, int]], Callable[[], None], NixlSpans]:
        """Where the spans' bytes are (each region's ByteBase and the span's offset, by tensor
        name), each checked against its region, the release to call once the call is done
        (the regions count it as in flight), and the spans of NIXL regions (``move`` them:
        inputs in before the call, outputs out after)."""
        found: dict[str, _Region] = {}
        held: list[_Region] = []
        with self._lock:
            for name, span in spans.items():
                field = f"header.regions.{name}"
                region = self._regions.get((owner, span.region))
                if region is None:
                    raise not_found(
                        f"{field}.region", f"no region {span.region!r} is registered (never, "
                        "unregistered, unused for --region-ttl seconds, or the server restarted: "
                        "register it again)")
                if span.end > region.size:
                    raise invalid(
                        field, f"bytes [{span.offset}, {span.end}) run past the end of region "
                        f"{span.region!r} ({region.size} bytes)",
                    )
                found[name] = region
                if region not in held:
                    held.append(region)
            for region in held:
                region.inflight += 1
        views = {n: (r.base, spans[n].offset) for n, r in found.items()}
        remote = {n: (r, spans[n]) for n, r in found.items() if r.remote is not None}
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            with self._lock:
                to_close = []
                now = self._clock()
                for region in held:
                    region.inflight -= 1
                    region.last_used = now
                    if region.dropped and region.inflight == 0:
                        to_close.append(region)
            for region in to_close:
                self._close(region)

        return views, release, remote

    def move(self, remote: NixlSpans, names: tuple[str, ...], op: str) -> None:
        """NIXL regions' spans of tensors ``names``: "READ" pulls them from the clients' memory
        into the mirrors, "WRITE" pushes them back; one transfer per client agent."""
        by_peer: dict[tuple[str, str], tuple[list[tuple[int, int, int]], list[tuple[int, int, int]],
                                 str, str]] = {}
        for name in names:
            if name not in remote:
                continue
            region, span = remote[name]
            far = region.remote
            assert far is not None
            # One transfer per peer and memory kind (a transfer's descriptors are of one kind).
            local, there, _, _ = by_peer.setdefault(
                (far.peer, far.memory), ([], [], far.memory, f"header.regions.{name}"))
            local.append((region.base.ptr + span.offset, span.nbytes, far.local_device))
            there.append((far.address + span.offset, span.nbytes, far.device))
        for (peer, _), (local, there, memory, named) in by_peer.items():
            self.nixl.move(op, peer, local, there, named, local_memory=memory,
                           remote_memory=memory)

    def expire(self) -> int:
        """Drop every region no call has used for the TTL; returns how many."""
        if self.ttl <= 0:
            return 0
        with self._lock:
            cutoff = self._clock() - self.ttl
            old = [k for k, r in self._regions.items()
                   if r.inflight == 0 and r.last_used < cutoff]
            gone = [self._regions.pop(k) for k in old]
            for r in gone:
                r.dropped = True
            self.expired_total += len(gone)
        for r in gone:
            self._close(r)
            log.info("region %s (%s, %d bytes) of %s dropped after %.0f s unused (--region-ttl)",
                     r.name, r.kind, r.size, "a caller" if r.owner else "anonymous", self.ttl)
        return len(gone)

    def gauges(self) -> tuple[int, int]:
        """(regions registered, all callers; regions dropped by the TTL so far)."""
        with self._lock:
            return len(self._regions), self.expired_total

    def close(self) -> None:
        """Engine shutdown: drop every region (mappings go as their calls finish)."""
        if self._sweeper is not None:
            self._sweeper.stop()
        with self._lock:
            owners = {o for o, _ in self._regions}
        for owner in owners:
            self.unregister(owner, "")
        self.nixl.close()

    # ---- backing memory ----------------------------------------------------------------

    def _open_system(
        self, src: pb.SystemRegion, nbytes: int
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        try:
            mapping = shm.map_object(src.key, src.offset, nbytes)
        except shm.NotSharedMemory as exc:
            raise invalid("system.key", str(exc)) from None
        except ValueError as exc:
            raise invalid("system", str(exc)) from None
        except FileNotFoundError:
            raise not_found(
                "system.key", f"no shared-memory object {src.key!r} on the server's host (a "
                "client on another host, or in another IPC namespace, cannot use regions)",
            ) from None
        except PermissionError:
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                               f"system.key: the server may not open {src.key!r}") from None
        except OSError as exc:
            # A symbolic link (not followed), a directory, a device: the caller's input. Its
            # key and the reason, never the server's path (OSError's str() carries it).
            reason = os.strerror(exc.errno) if exc.errno else type(exc).__name__
            raise invalid("system.key", f"{src.key!r} cannot be mapped as a shared-memory "
                          f"object: {reason}") from None
        # The tensor keeps the mapping alive; it is unmapped when the last view of it goes.
        tensor = torch.frombuffer(mapping.view, dtype=torch.uint8)
        unpin = pin(tensor, nbytes) if self.backend.name == "cuda" else (lambda: None)
        return tensor, unpin

    def _open_cuda(
        self, src: pb.CudaRegion, nbytes: int
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        if self.backend.name != "cuda":
            raise invalid("cuda", "this server runs the cpu backend: register a system region")
        device = self.backend.device
        mine = cuda_ipc.device_uuid(device)
        if bytes(src.device_uuid) != mine:
            raise invalid("cuda.device_uuid", "the region is on another GPU than the server's")
        torch.cuda.set_device(device)
        handle = bytes(src.ipc_handle)
        try:
            cuda_ipc.use_primary_context(torch.device(device).index or 0)
            ptr, alloc = self._ipc.open(handle)
        except (ValueError, cuda_ipc.CudaIpcError) as exc:
            raise invalid("cuda.ipc_handle", str(exc)) from None
        if src.offset + nbytes > alloc:
            self._ipc.release(handle)
            raise invalid("cuda", f"bytes [{src.offset}, {src.offset + nbytes}) run past the "
                          f"end of the allocation ({alloc} bytes)")
        tensor = torch.as_tensor(cuda_ipc.DeviceBytes(ptr + src.offset, nbytes), device=device)
        return tensor, lambda: self._ipc.release(handle)

    def _nixl_memory(self, src: pb.NixlRegion) -> str:
        """The kind of the client's memory (NIXL's name: DRAM, or VRAM on a cuda server),
        checked before the registration takes any room."""
        memory = src.memory or "DRAM"
        if memory not in ("DRAM", "VRAM"):
            raise invalid("nixl.memory", f"{memory!r}: use DRAM (host memory) or VRAM (GPU)")
        if memory == "VRAM" and self.backend.name != "cuda":
            raise invalid("nixl.memory", "VRAM: this server runs the cpu backend: register "
                          "host memory (DRAM)")
        return memory

    def _open_nixl(
        self, owner: str, src: pb.NixlRegion, memory: str, nbytes: int
    ) -> tuple[torch.Tensor, Callable[[], None], _Remote]:
        """A mirror of the client's region (``memory``: its kind), registered with the
        engine's agent: in this process's host memory for the client's host memory (DRAM), on
        the server's GPU for the client's GPU memory (VRAM: UCX moves it GPU to GPU); the
        client's agent known (its metadata added)."""
        if src.address == 0:
            raise invalid("nixl.address", "missing: where the registered memory starts")
        self.nixl.add_peer(owner, src.agent_name, bytes(src.agent_metadata))
        handle = None
        device = 0
        try:
            if memory == "VRAM":
                device = self.backend.device.index or 0
                try:
                    mirror = torch.empty(nbytes, dtype=torch.uint8, device=self.backend.device)
                except torch.OutOfMemoryError:
                    raise exhausted("byte_size", f"the server's GPU has no room for a "
                                    f"{nbytes}-byte mirror of this region") from None
            else:
                mirror = self.backend.alloc_host(nbytes)
            try:
                handle = self.nixl.register(mirror.data_ptr(), nbytes, memory, device)
            except RequestError:
                raise
            except Exception as exc:  # e.g. GPU memory where the server's UCX has no CUDA
                raise RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"nixl.memory: this server's NIXL could not register {memory} memory "
                    f"({type(exc).__name__}): check its UCX_TLS") from None
            # The region's first and last byte read once: a range the client's agent does not
            # cover (or an agent that cannot be reached) is refused now, not at each call.
            ends = sorted({0, nbytes - 1})
            self.nixl.move("READ", src.agent_name,
                           [(mirror.data_ptr() + at, 1, device) for at in ends],
                           [(src.address + at, 1, src.device_id) for at in ends],
                           "nixl.address", local_memory=memory, remote_memory=memory,
                           timeout_s=10.0)
        except BaseException:
            if handle is not None:
                self.nixl.deregister(handle)
            self.nixl.drop_peer(src.agent_name)
            raise

        def close() -> None:
            self.nixl.deregister(handle)
            self.nixl.drop_peer(src.agent_name)

        return mirror, close, _Remote(src.agent_name, int(src.address), memory,
                                      int(src.device_id), device)

    def _close_ipc(self, ptr: int) -> None:
        torch.cuda.set_device(self.backend.device)
        cuda_ipc.close_handle(ptr)

    def _close(self, region: _Region) -> None:
        try:
            region.closer()
        except Exception:
            log.exception("closing region %s failed", region.name)
        log.info("region released: kind=%s name=%s", region.kind, region.name)
