"""The engine core: one backend, one executor, one region registry, one KV-cache registry,
whatever the process model.

Both links end here: ``LocalLink`` (same process) calls it directly, and in the multi-process
model each front end's connection handler (``FrontendConnection``, below) calls it with
tensors that are views into that front end's shared-memory arena. ``submit`` turns a request
(params + where its tensors live) into a Job and queues it; the caller's ``done`` is called
exactly once.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import mmap
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Executor as ThreadPool
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

import grpc
import torch

from attention_service.config import ServerConfig
from attention_service.engine.backends import Backend
from attention_service.engine.dtypes import TORCH_DTYPES
from attention_service.engine.executor import Executor, LaunchObserver
from attention_service.engine.jobs import ByteBase, CacheWork, Done, ExecStats, Job, LazyTensor
from attention_service.engine.kv_caches import METHODS as CACHE_METHODS
from attention_service.engine.kv_caches import CacheRegistry
from attention_service.engine.kv_pool import KvPool
from attention_service.engine.nixl_agent import available as nixl_available
from attention_service.engine.nixl_agent import backend_name as nixl_backend
from attention_service.engine.regions import NixlSpans, RegionRegistry
from attention_service.engine.warmup import warm_caches
from attention_service.errors import Cancelled, RequestError, StartupError, invalid
from attention_service.ipc.channel import (
    Bound,
    Cancel,
    Channel,
    ControlCall,
    Failed,
    ForgetParams,
    Reply,
    SegmentSpan,
    Submit,
    rpc_types,
)
from attention_service.ipc.channel import Done as DoneMessage
from attention_service.link import EngineInfo
from attention_service.params import INPUTS, OUTPUTS, Op, Params, RegionSpan
from attention_wire import ucx_defaults

# A tensor's bytes: a uint8 tensor (host or device) of exactly its size, or a region span.
# Where a tensor's bytes are: a uint8 tensor of exactly its size (pinned buffers), a byte offset
# into a ByteBase (a front end's arena or segment), or a span of a registered region.
Source = torch.Tensor | tuple[ByteBase, int] | RegionSpan
log = logging.getLogger("attention_service")


def as_request_failure(exc: BaseException) -> BaseException:
    """What a caller is told (and what crosses to a front-end process): Cancelled, or a
    RequestError with the status that fits; tracebacks stay in the engine's log."""
    if isinstance(exc, RequestError | Cancelled):
        return exc
    if isinstance(exc, torch.OutOfMemoryError):
        first = str(exc).splitlines()[0] if str(exc) else ""
        return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"device out of memory: {first}")
    if isinstance(exc, ValueError):
        # A kernel refused what validation let through: still the caller's input.
        log.warning("validation gap: %s", exc)
        return RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"rejected by the kernel: {exc}")
    log.error("internal error in a launch", exc_info=exc)
    return RequestError.internal(exc)


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


_NO_WORK = ExecStats(0.0, 0.0, 0.0, 0.0, batch_requests=0, batch_tokens=0)
assert ExecStats._fields[7:] == ("cache_lengths",)  # ``settle`` builds one positionally


class EngineCore:
    def __init__(
        self, config: ServerConfig, backend: Backend, observer: LaunchObserver | None = None,
        frontends: int = 1,
        delivery_scope: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        # UCX's settings for NIXL regions, while this process has few threads: setting the
        # environment races with other threads' getenv (glibc), and UCX reads it later.
        if config.nixl and config.regions_allowed:
            ucx_defaults.apply()
        self.backend = backend
        self.executor = Executor(
            backend, batching=config.batching, max_batch_tokens=config.max_batch_tokens,
            max_queue_delay_s=config.max_queue_delay_ms / 1e3,
            max_queue_size=config.max_queue_size, observer=observer,
            delivery_scope=delivery_scope,
            inline_ops=frozenset({Op.CACHE_DECODE}),  # see the executor's module doc
        )
        self.regions = RegionRegistry(
            backend, allowed=config.regions_allowed, nixl=config.nixl,
            max_per_owner=config.max_regions_per_caller,
            system_bytes_per_owner=config.system_region_bytes_per_caller,
            gpu_bytes_per_owner=config.gpu_region_bytes_per_caller,
            ttl_seconds=config.region_ttl,
            # Metrics have it; a bare observer (a benchmark's tally) may not.
            observe_nixl=getattr(observer, "observe_nixl", None),
        )
        # NIXL regions' transfers (``_pull_and_submit``, ``_push``): waited for here, never on
        # a channel reader, the event loop or the completer.
        self._mover = ThreadPoolExecutor(4, thread_name_prefix="attention-nixl")
        self.caches = CacheRegistry(
            _make_pool(config, backend), ttl_seconds=config.kv_cache_ttl,
            max_caches=config.max_caches, max_request_flops=config.max_request_flops,
        )
        pool = self.caches.pool
        self.info = EngineInfo(
            device=backend.device_name, backend=backend.name, batching=config.batching,
            regions=config.regions_allowed, frontends=frontends,
            torch_version=str(torch.__version__), triton_version=_dist_version("triton"),
            cuda_version=(torch.version.cuda or "") if backend.name == "cuda" else "",
            kv_cache_bytes=pool.nbytes if pool is not None else 0,
            kv_page_bytes=pool.page_bytes if pool is not None else 0,
            nixl=(nixl := config.regions_allowed and config.nixl and nixl_available()),
            nixl_backend=nixl_backend() if nixl else "", instance=uuid.uuid4().hex,
        )

    def queue_depth(self, op: Op) -> int:
        return self.executor.queue_depth(op)

    def warmup(self) -> None:
        self.backend.warmup()
        # Test doubles of a backend may not say what to compile: they skip this part.
        warm_caches(self.backend, self.caches, getattr(self.backend, "warmup_dtypes", ()))

    def close(self) -> None:
        self.executor.close()  # issued launches finish (their NIXL pushes queue on the movers)
        # Every NIXL transfer queued is waited for: a pull finds the executor closed and
        # answers UNAVAILABLE, a push answers its call (each transfer ends within its timeout).
        self._mover.shutdown(wait=True)
        self.regions.close()
        self.caches.close()

    def submit(
        self, params: Params, sources: Mapping[str, Source], owner: str, done: Done,
        issue_here: bool = False,
    ) -> Job:
        """Queue one request; ``done`` gets its stats or the exception that ended it, once.
        Raises RequestError (unknown region, bounds, queue full) without calling ``done``.
        ``issue_here``: ``Executor.submit``'s (this thread may take a launch's time)."""
        held: list[Callable[[], None]] = []  # region releases
        cache: CacheWork | None = None
        try:
            tensors: dict[str, torch.Tensor] = {}
            spans: dict[str, LazyTensor] = {}
            regions: dict[str, RegionSpan] = {}
            self._place(params, sources, tensors, spans, regions)
            remote: NixlSpans = {}
            if regions:
                in_regions, release, remote = self.regions.acquire(owner, regions)
                held.append(release)
                self._place(params, in_regions, tensors, spans, {})
            if params.op.cached:  # last: from here on, its caches are reserved
                cache = self.caches.begin(params, owner)
            job = Job(params, cache=cache, spans=spans, **tensors)

            def finish(value: ExecStats | BaseException) -> None:
                if remote and not isinstance(value, BaseException) and not job.cancelled:
                    # Outputs in NIXL regions go back to the client before it hears.
                    self._mover.submit(self._push, remote, value, settle)
                    return
                settle(value)

            def settle(value: ExecStats | BaseException) -> None:
                failed = isinstance(value, BaseException)
                if cache is not None:  # before the caller hears: its next call sees the cache
                    if not failed and job.cancelled:
                        # Its caller left (a cancel, a deadline) while the launch ran: nobody
                        # hears this answer, so its caches stay as they were, as for a cancel
                        # that found the job queued. (A cancel that arrives after this point
                        # finds the tokens stored: docs/service.md, "Rules".)
                        value, failed = Cancelled(), True
                    lengths = cache.finish(not failed)
                    if not failed:  # positional: ``_replace`` took ~9 us of a step (H200)
                        value = ExecStats(*value[:7], lengths)  # type: ignore[index,misc]
                for release in held:
                    release()
                done(as_request_failure(value) if failed else value)  # type: ignore[arg-type]

            if not params.rows and not params.op.cached:
                # An empty batch (a stateless call of no queries): no launch, empty outputs,
                # as flash_attn answers it. Its regions were still checked above.
                finish(_NO_WORK)
                return job
            if remote:  # inputs in NIXL regions come over first, off this thread
                self._mover.submit(self._pull_and_submit, job, remote, finish)
                return job
            self.executor.submit(job, finish, issue_here=issue_here)
        except BaseException:
            if cache is not None:
                cache.finish(False)
            for release in held:
                release()
            raise
        return job

    def _pull_and_submit(self, job: Job, remote: NixlSpans, finish: Done) -> None:
        """On a mover thread: a NIXL call's inputs into the mirrors, then the job queued."""
        try:
            self.regions.move(remote, INPUTS, "READ")
            if job.cancelled:
                raise Cancelled()
            self.executor.submit(job, finish)
        except BaseException as exc:
            finish(exc)

    def _push(self, remote: NixlSpans, value: ExecStats, settle: Done) -> None:
        """On a mover thread: a NIXL call's outputs back to the client, then its answer."""
        try:
            self.regions.move(remote, OUTPUTS, "WRITE")
        except BaseException as exc:
            settle(exc)
            return
        settle(value)

    def cancel(self, job: Job) -> None:
        self.executor.cancel(job)

    def control_call(self, method: str, request: Any, owner: str) -> Any:
        """A unary control rpc (regions, caches): the pb request in, the pb reply out."""
        if method in CACHE_METHODS:
            return self.caches.call(method, request, owner)
        return self.regions.call(method, request, owner)

    @staticmethod
    def _place(
        params: Params, sources: Mapping[str, Source], tensors: dict[str, torch.Tensor],
        spans: dict[str, LazyTensor], regions: dict[str, RegionSpan],
    ) -> None:
        """Sort ``sources`` into typed tensors, checked spans (views made later) and region
        spans (still to be looked up). Per request on a channel reader's thread: each tensor's
        dtype, size and shape come from ``_layout`` (once per Params object), in one pass over
        the sources: four arena spans took 2.2 us instead of 5.8 (dev box, 2026-11-28)."""
        layout = _layout(params)
        for name, at in sources.items():
            if isinstance(at, RegionSpan):
                regions[name] = at
            elif isinstance(at, tuple):  # (ByteBase, offset): an arena, a segment, a region
                base, offset = at
                dtype, nbytes, shape = layout[name]
                if offset + nbytes > base.nbytes:  # the front end sized it: a bug
                    raise AssertionError(f"{name}: bytes past the end of their block")
                # ByteBase.check_aligned's test, inline: it raises ValueError, and this path
                # answers INVALID_ARGUMENT per request (only a region span can be misaligned).
                if (base.ptr + offset) % dtype.itemsize:
                    raise invalid(
                        f"header.regions.{name}.offset",
                        f"must leave the tensor aligned to {dtype.itemsize} bytes ({dtype})",
                    )
                spans[name] = (base, offset, dtype, shape)
            else:  # a uint8 tensor of exactly the tensor's bytes
                dtype, nbytes, shape = layout[name]
                if at.numel() != nbytes:  # the front end sized it: a bug, not input
                    raise AssertionError(f"{name}: {at.numel()} bytes, expected {nbytes}")
                tensors[name] = at.view(dtype).view(shape)


_Layout = dict[str, tuple[torch.dtype, int, tuple[int, ...]]]


def _layout(params: Params) -> _Layout:
    """Tensor name -> (dtype, bytes, shape) of ``params``' tensors, made once per Params
    object (kept in ``params.memo``; it holds no reference back to ``params``, so a Params a
    front end forgets is freed at once, not by the cycle collector)."""
    memo = params.memo
    got = memo.get(_layout)
    if got is None:
        names = ("q", "k", "v", "out", "lse") if params.return_lse else ("q", "k", "v", "out")
        got = memo[_layout] = {
            name: (torch.float32 if name == "lse" else TORCH_DTYPES[params.wire_dtype(name)],
                   params.nbytes(name), params.shape(name))
            for name in names
        }
    return got  # type: ignore[return-value]


def _make_pool(config: ServerConfig, backend: Backend) -> KvPool | None:
    """The KV-cache pool of ``--kv-cache-bytes`` (auto: a quarter of the free device memory
    on cuda, 256 MiB on cpu), allocated once now; None when caches are off."""
    nbytes = config.kv_cache_bytes
    if nbytes == -1:
        if backend.device.type == "cuda":
            nbytes = torch.cuda.mem_get_info(backend.device)[0] // 4
        else:
            nbytes = 256 << 20
    nbytes -= nbytes % config.kv_page_bytes
    if nbytes <= 0:
        return None
    try:
        # Zeros: at odd head dims the kernels read each row with its pad (never written), and
        # a non-finite pad would have every step read its keys twice (``kv_shift``).
        storage = torch.zeros(nbytes, dtype=torch.uint8, device=backend.device)
    except RuntimeError as exc:  # out of memory: say which flag asked for it
        raise StartupError(f"--kv-cache-bytes: could not allocate a pool of {nbytes} bytes on "
                           f"{backend.device}: {str(exc).splitlines()[0]}") from None
    caller_pages = config.kv_cache_bytes_per_caller // config.kv_page_bytes
    log.info("kv cache pool: %d pages of %d bytes (%.1f GiB) on %s; %s pages per caller",
             nbytes // config.kv_page_bytes, config.kv_page_bytes, nbytes / 2**30,
             backend.device, caller_pages or "no limit on")
    return KvPool(storage, config.kv_page_bytes, caller_pages)


# The engine's side of one front-end process: its channel, its arena, its calls.
#
# Requests arrive on the channel's reader thread and go straight to the engine core (no event
# loop in the engine's request path; when the device is idle the reader issues the launch
# itself); answers go back from the executor's completer thread, one corked write per launch
# (the channel's writer thread takes over only what the socket cannot take at once). Params
# arrive once each, with the first Submit that names them by id. The connection tracks its calls
# so that when its front end dies they are cancelled and the arena is not handed to a new front
# end before the last copy into it has finished.
log = logging.getLogger("attention_service")


class FrontendConnection:
    def __init__(
        self, slot: int, core: EngineCore, arena: torch.Tensor, control_pool: ThreadPool,
        on_bound: Callable[[Bound], None],
    ) -> None:
        self.slot = slot
        self.core = core
        self.arena = ByteBase(arena)  # the front end's arena (page-locked on cuda)
        self._control_pool = control_pool
        self._on_bound = on_bound
        self._lock = threading.Condition()
        self._calls: dict[int, Job | None] = {}  # in the engine; None: being submitted
        self._params: dict[int, Params] = {}  # what Submits brought, by id (reader only)
        self.channel: Channel | None = None

    def attach(self, channel: Channel) -> None:
        self.channel = channel

    def send(self, msg: Any) -> None:
        assert self.channel is not None
        self.channel.send(msg)

    # ---- reader thread ------------------------------------------------------------------

    def on_message(self, msg: Any, fds: list[int]) -> None:
        if isinstance(msg, Submit):
            self._submit(msg, fds)
        elif isinstance(msg, ForgetParams):
            self._params.clear()
        elif isinstance(msg, Cancel):
            with self._lock:
                job = self._calls.get(msg.call_id)
            if job is not None:
                self.core.cancel(job)
        elif isinstance(msg, ControlCall):
            self._control_pool.submit(self._control_call, msg)
        elif isinstance(msg, Bound):
            self._on_bound(msg)
        else:
            log.error("front end %d sent an unknown message %s", self.slot, type(msg).__name__)
        for fd in fds:  # segments were mapped (a mapping outlives its descriptor)
            with contextlib.suppress(OSError):
                os.close(fd)

    def on_channel_close(self) -> None:
        """Nothing to do here: the supervisor acts on the process's exit (``Group._watch``);
        the channel closes when that process goes (or when the supervisor closes it)."""

    def _sources(self, msg: Submit, fds: list[int]) -> dict[str, Source]:
        segments: dict[int, ByteBase] = {}
        sources: dict[str, Source] = {}
        for name, span in msg.spans.items():
            if type(span) is tuple:  # ArenaSpan
                sources[name] = (self.arena, span[0])
            elif isinstance(span, SegmentSpan):
                if span.fd_index not in segments:
                    # Unmapped when the last tensor viewing it goes (after the call's done).
                    fd = fds[span.fd_index]
                    mm = mmap.mmap(fd, os.fstat(fd).st_size)
                    segments[span.fd_index] = ByteBase(torch.frombuffer(mm, dtype=torch.uint8))
                sources[name] = (segments[span.fd_index], span.offset)
            elif isinstance(span, RegionSpan):
                sources[name] = span
            else:
                raise TypeError(f"unknown span {span!r}")
        return sources

    def _submit(self, msg: Submit, fds: list[int]) -> None:
        with self._lock:
            self._calls[msg.call_id] = None
        try:
            params = msg.params
            if params is None:
                params = self._params[msg.params_id]  # a bug when unknown: answered below
            else:
                self._params[msg.params_id] = params
            job = self.core.submit(
                params, self._sources(msg, fds), msg.owner,
                lambda value, call_id=msg.call_id: self._done(call_id, value),
                issue_here=True,  # the channel's reader thread: no event loop to stall
            )
        except RequestError as exc:
            self._done(msg.call_id, exc)
            return
        except Exception as exc:  # a bug: answer the call, keep the connection
            log.exception("front end %d: submit failed", self.slot)
            self._done(msg.call_id, RequestError.internal(exc))
            return
        with self._lock:
            if msg.call_id in self._calls:  # not already answered
                self._calls[msg.call_id] = job

    def _done(self, call_id: int, value: ExecStats | BaseException) -> None:
        """Exactly once per Submit (executor thread, or the reader for a refusal)."""
        with self._lock:
            self._calls.pop(call_id, None)
            if not self._calls:  # what wait_idle waits for
                self._lock.notify_all()
        if isinstance(value, BaseException):
            self.send(Failed(call_id, value))
        else:
            self.send(DoneMessage(call_id, value))

    def _control_call(self, msg: ControlCall) -> None:
        try:
            request = rpc_types(msg.method)[0].FromString(msg.request)
            reply = self.core.control_call(msg.method, request, msg.owner).SerializeToString()
        except RequestError as exc:
            self.send(Failed(msg.call_id, exc))
        except Exception as exc:
            log.exception("front end %d: %s failed", self.slot, msg.method)
            self.send(Failed(msg.call_id, RequestError.internal(exc)))
        else:
            self.send(Reply(msg.call_id, reply))

    # ---- supervisor ---------------------------------------------------------------------

    @property
    def inflight(self) -> int:
        with self._lock:
            return len(self._calls)

    def cancel_all(self) -> None:
        """Its front end is gone: nobody will read these results."""
        with self._lock:
            jobs = [j for j in self._calls.values() if j is not None]
        for job in jobs:
            self.core.cancel(job)

    def wait_idle(self, timeout: float) -> bool:
        """Until no call of this connection is in the engine (its arena is quiet)."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._calls, timeout)
