"""The one GPU launch path: a batch (a single request is a batch of one) on one stream.

Each job's inputs go straight into slices of packed device tensors (host pinned memory: async
DMA; CUDA regions: device-to-device copies), the merged cu_seqlens go up in one pinned buffer
and one copy, one kernel call runs over the merged cu_seqlens, and each job's rows of the
output go straight into that job's destination (pinned host memory or its CUDA region).
Everything is queued on one stream and timed with CUDA events; the caller gets a
``PendingLaunch`` at once, so it can issue the next batch on another stream while this one's
kernel runs (copy engines and SMs work in parallel).

A lone job whose tensors already live on the GPU (CUDA regions) skips the packing copies and
has the kernel write its outputs in place: its round trip is the kernel plus small launches.

A batch of two or more jobs in memory the device can address (page-locked arenas and regions,
CUDA regions) is packed and unpacked by two ``copy_segments`` launches over one table instead
of a view and a copy per job and tensor (``_by_segments``): 7-31% more requests per second under
64 clients of small prefills (H100, 2026-11-27; docs/service.md, "Execution").

Cached ops (AppendKV / CachePrefill / CacheDecode) take the same path: their k/v are the new
tokens, which go into their reserved pool slots (two scatter kernels) before the paged kernel
reads the whole sequences through the block table.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections import deque
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import torch

from attention_kernels.copy_segments import (
    MAX_UNITS,
    ROW,
    can_use_host_pointers,
    copy_segments,
    unit_of,
)
from attention_service.engine.dtypes import TORCH_DTYPES
from attention_service.engine.jobs import (
    BatchPlan,
    ByteBase,
    DoneLaunch,
    LaunchTimes,
    LazyTensor,
    PendingLaunch,
)
from attention_service.engine.paged_store import block_table, store_new_tokens
from attention_wire.messages import out_dtype

_ALIGN = 4  # int32 entries: keep the cu_seqlens_q view 16-byte aligned like a fresh tensor
# ATTENTION_PACK_KERNEL=0: batches pack with a view and a copy per job and tensor, as before
# the one-launch packing (``_Segments``).
PACK_KERNEL = os.environ.get("ATTENTION_PACK_KERNEL", "1") != "0"
# ATTENTION_PACK_MAX_SEGMENT_BYTES=N: in a batch the kernel packs, segments longer than N bytes
# go through the copy engines instead (one DMA copy each, in one foreach call). Unset: none do.
# The kernel needs SMs and the copy engines do not: pinned host to device on an H200, on an
# idle GPU the kernel was 1.3-11x faster than DMA copies for 8-32 segments of 16-256 KiB;
# beside a matmul on another stream it waited for SMs, up to 39x slower (one run: 3-39x at
# 16-256 KiB; another: still faster at 16 KiB, 2.8-20x slower from 256 KiB)
# (tools/tuning/bench_copy_segments.py; git history: benchmarks/results/issue10/2026-11-28/).
# But end to end, 64 clients of
# small prefills through shared memory (kernel busy 12%), a 64 KiB limit made 3600 / 3590
# req/s against 4328 / 4470 without one: the engine's per-copy work costs more than the
# kernel's wait. For GPUs kept busy by long kernels, where that may turn.
PACK_MAX_SEGMENT_BYTES = int(os.environ.get("ATTENTION_PACK_MAX_SEGMENT_BYTES") or sys.maxsize)
_SEGMENT_ALIGN = 256  # bytes: each packed tensor starts where a fresh allocation would


class _Events:
    """Each launch's four timing events, given back once the launch is waited for and taken by
    a later one: made per launch, the four ``Event()`` and their first records cost an idle
    engine ~0.12 ms before a prefill's kernel could start, ~0.035 ms reused (H100,
    git history: ``benchmarks/trace_call.py``, 2026-11-24). Launches take them under the executor's
    launch
    lock; the completer gives them back. (Pinned buffers need no such pool: torch's caching
    host allocator already reuses them, and a pool of our own measured slower.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: deque[list[torch.cuda.Event]] = deque()

    def take(self) -> list[torch.cuda.Event]:
        with self._lock:
            if self._free:
                return self._free.pop()
        return [torch.cuda.Event(enable_timing=True) for _ in range(4)]

    def give_back(self, events: list[torch.cuda.Event]) -> None:
        with self._lock:
            self._free.append(events)


_EVENTS = _Events()


def _on_device(t: torch.Tensor, device: torch.device) -> bool:
    return t.device == device and t.is_contiguous()


def _packed(
    plan: BatchPlan, name: str, rows: int, row_shape: tuple[int, int], offsets: list[int],
    device: torch.device,
) -> torch.Tensor:
    """The batch's ``name`` tensors packed into one device tensor (or the lone job's own)."""
    parts = [getattr(job, name) for job in plan.jobs]
    if len(parts) == 1 and _on_device(parts[0], device):
        return parts[0]
    dtype = TORCH_DTYPES[plan.shared.dtype if name == "q" else plan.shared.kv_dtype]
    dst = torch.empty((rows, *row_shape), dtype=dtype, device=device)
    # Job i's rows start at offsets[i]: one split gives every job's slot, one foreach call
    # queues every copy (a pinned source + non_blocking: an async DMA on the current stream;
    # a device source: a device-to-device copy). Per job a slice and a ``copy_`` from Python
    # cost the engine ~17% of its time under 64 clients of small prefills (py-spy, H100
    # host, 2026-11-24). The sources outlive the launch (each job holds its own until its
    # done callback).
    slots = _row_slots(dst, offsets)
    _copy_each([(d if d.shape[0] == s.shape[0] else d[: s.shape[0]], s)
                for d, s in zip(slots, parts, strict=True)])
    return dst


class _Segments(NamedTuple):
    """A batch packed by one ``copy_segments`` launch and unpacked by another: the packed
    device tensors (one allocation) and the copy table (inputs' rows first, then outputs')."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    table: torch.Tensor  # int64 [rows, ROW] on the device
    n_in: int
    unit: int
    max_in: int
    max_out: int
    dma_in: list[tuple[torch.Tensor, torch.Tensor]]  # (dst, src) byte views: long segments
    dma_out: list[tuple[torch.Tensor, torch.Tensor]]
    keep: tuple[object, ...]

    def pack(self) -> None:
        copy_segments(self.table[: self.n_in], self.unit, self.max_in)
        _copy_each(self.dma_in)

    def unpack(self) -> None:
        copy_segments(self.table[self.n_in :], self.unit, self.max_out)
        _copy_each(self.dma_out)


_IO = ("q", "k", "v", "out")


def _nbytes(span: LazyTensor) -> int:
    return math.prod(span[3]) * span[2].itemsize


def _by_segments(plan: BatchPlan, device: torch.device) -> _Segments | None:
    """A batch of two or more jobs whose q, k, v and out all lie in device-readable memory
    (pinned arenas and regions, device regions), packed with one kernel instead of a view and
    a copy per job and tensor; None when it does not qualify. Not for a segment past what one
    launch copies, nor when some address or length leaves only 1- or 2-byte words (a region
    span at an odd offset): the DMA copies move those faster, and the gain measured was with
    8-byte words."""
    if (not PACK_KERNEL or len(plan.jobs) < 2 or plan.op.cached or plan.return_lse
            or not can_use_host_pointers(device.index or 0)):
        return None
    spans = []
    for job in plan.jobs:
        row = [job.span(name) for name in _IO]
        for span in row:
            # Device memory only of this device (a region on another GPU needs peer access).
            if (span is None or not span[0].device_readable
                    or (span[0].on_device and span[0].u8.device != device)):
                return None
        spans.append(row)
    key = plan.shared
    q_dtype, kv_dtype = TORCH_DTYPES[key.dtype], TORCH_DTYPES[key.kv_dtype]
    o_dtype = TORCH_DTYPES[out_dtype(key.dtype)]
    q_row = key.num_heads * key.head_dim * q_dtype.itemsize
    o_row = key.num_heads * key.head_dim * o_dtype.itemsize
    kv_row = key.num_kv_heads * key.head_dim * kv_dtype.itemsize
    sizes = (plan.total_q * q_row, plan.total_k * kv_row, plan.total_k * kv_row,
             plan.total_q * o_row)
    at, total = [], 0
    for n in sizes:
        at.append(total)
        total += -(-n // _SEGMENT_ALIGN) * _SEGMENT_ALIGN
    buf = torch.empty(max(total, _SEGMENT_ALIGN), dtype=torch.uint8, device=device)
    base = buf.data_ptr()
    q_at, k_at, v_at, o_at = at
    # Segments as (source block, offset, destination block, offset, bytes): a job's span, or
    # the packed buffer (``None``).
    ins: list[tuple[Any, int, Any, int, int]] = []
    outs: list[tuple[Any, int, Any, int, int]] = []
    for i, (sq, sk, sv, so) in enumerate(spans):
        q_off, k_off = plan.q_offsets[i] * q_row, plan.k_offsets[i] * kv_row
        ins.append((sq[0], sq[1], None, q_at + q_off, _nbytes(sq)))
        ins.append((sk[0], sk[1], None, k_at + k_off, _nbytes(sk)))
        ins.append((sv[0], sv[1], None, v_at + k_off, _nbytes(sv)))
        outs.append((None, o_at + plan.q_offsets[i] * o_row, so[0], so[1], _nbytes(so)))

    def ptr(block: Any, offset: int) -> int:
        return (base if block is None else block.ptr) + offset

    def u8(block: Any, offset: int, n: int) -> torch.Tensor:
        return buf[offset : offset + n] if block is None else block.view(offset, torch.uint8,
                                                                          (n,))

    def split(segments: list[tuple[Any, int, Any, int, int]]
              ) -> tuple[list[tuple[int, int, int]], list[tuple[torch.Tensor, torch.Tensor]]]:
        rows = [(ptr(sb, so), ptr(db, do), n) for sb, so, db, do, n in segments
                if n <= PACK_MAX_SEGMENT_BYTES]
        dma = [(u8(db, do, n), u8(sb, so, n)) for sb, so, db, do, n in segments
               if n > PACK_MAX_SEGMENT_BYTES]
        return rows, dma

    rows, dma_in = split(ins)
    out_rows, dma_out = split(outs)
    n_in = len(rows)
    host = torch.zeros((n_in + len(out_rows), ROW), dtype=torch.int64,
                       pin_memory=device.type == "cuda")
    table = host.numpy()
    if n_in:
        table[:n_in, :3] = rows
    if out_rows:
        table[n_in:, :3] = out_rows
    unit = unit_of(int(np.bitwise_or.reduce(table, axis=None))) if len(table) else 8
    table[:, 2] //= unit
    max_in = int(table[:n_in, 2].max()) if n_in else 0
    max_out = int(table[n_in:, 2].max()) if out_rows else 0
    if unit < 4 or max(max_in, max_out) > MAX_UNITS:
        return None

    # The packed tensors as one typed view of ``buf`` per dtype and an ``as_strided`` each
    # (ByteBase): torch calls release the GIL and wait to get it back behind the engine's
    # readers, ~65 us each under 64 clients of small prefills, and a slice and two views per
    # tensor made these four lines 16% of the dispatcher's wall time (py-spy --idle, H100,
    # 2026-11-28).
    packed = ByteBase(buf)
    q_shape = (plan.total_q, key.num_heads, key.head_dim)
    kv_shape = (plan.total_k, key.num_kv_heads, key.head_dim)
    return _Segments(
        q=packed.view(q_at, q_dtype, q_shape), k=packed.view(k_at, kv_dtype, kv_shape),
        v=packed.view(v_at, kv_dtype, kv_shape), out=packed.view(o_at, o_dtype, q_shape),
        table=host.to(device, non_blocking=True), n_in=n_in, unit=unit, max_in=max_in,
        max_out=max_out, dma_in=dma_in, dma_out=dma_out, keep=(buf, host),
    )


def _row_slots(t: torch.Tensor, offsets: list[int]) -> tuple[torch.Tensor, ...]:
    """``t``'s rows cut at ``offsets``: job i's are ``offsets[i]:offsets[i + 1]`` (the last
    offset is ``t``'s length)."""
    return t.split([b - a for a, b in zip(offsets, offsets[1:], strict=False)])


def _copy_each(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src, non_blocking=True)`` for every pair with rows, in one foreach call."""
    pairs = [(d, s) for d, s in pairs if s.shape[0]]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs], non_blocking=True)


def _scatter_rows(plan: BatchPlan, out: torch.Tensor) -> None:
    """Each job's rows of the packed output into its destination, the way ``_packed`` packs
    its inputs, instead of a slice and a ``copy_`` per job. An A/B under 64 clients of small
    prefills (batches of ~17) measured no difference beyond the run-to-run spread (3288 /
    3385 against 3509 / 3316 req/s, H100, 2026-11-24): what bounds that load is not this."""
    slots = _row_slots(out, plan.q_offsets)
    _copy_each([(job.out, s) for job, s in zip(plan.jobs, slots, strict=True)])


class _PagedMeta:
    """A cached batch's block table, lengths, cu_seqlens_q and slots: built in pinned memory,
    sent with two copies (int32 and int64 parts)."""

    def __init__(self, plan: BatchPlan, device: torch.device) -> None:
        batch, width = len(plan.seq_lens), plan.table_width
        n_q = len(plan.cu_seqlens_q) if plan.cu_seqlens_q is not None else 0
        lens_at = batch * width
        q_at = -(-(lens_at + batch) // _ALIGN) * _ALIGN
        host = torch.zeros(q_at + n_q, dtype=torch.int32, pin_memory=True)
        block_table(plan, host[:lens_at].view(batch, width))
        view = host.numpy()
        view[lens_at : lens_at + batch] = plan.seq_lens
        if plan.cu_seqlens_q is not None:
            view[q_at:] = plan.cu_seqlens_q
        n = len(plan.slot_pages)
        slots = torch.empty((2, n), dtype=torch.int64, pin_memory=True)
        slots.numpy()[0] = plan.slot_pages
        slots.numpy()[1] = plan.slot_offsets
        dev = host.to(device, non_blocking=True)
        dev_slots = slots.to(device, non_blocking=True)
        self.keep = (host, slots, dev, dev_slots)
        work = plan.jobs[0].cache  # every job's pages are views of the one pool
        assert work is not None, "a cached op's job carries its cache work"
        self.k_pages, self.v_pages = work.k_pages, work.v_pages
        self.table = dev[:lens_at].view(batch, width)
        self.seq_lens = dev[lens_at : lens_at + batch]
        self.cu_q = dev[q_at:] if plan.cu_seqlens_q is not None else None
        self.slots = (dev_slots[0], dev_slots[1])


# Device copies of recent merged cu_seqlens, by value and stream: a call of the same lengths as
# an earlier one (a region call repeated, the same batch shape) skips the pinned buffer and the
# h2d copy, ~0.1 ms of host time before a prefill's kernel could start on an H100 host
# (git history: ``benchmarks/trace_call.py``, 2026-11-24). Kernels only read them; a launch keeps
# its own
# reference until it has completed, so one dropped from here is never freed while in use. By
# stream: the copy that filled it was queued on that stream, ahead of every launch that reads
# it there. Short arrays only; a full memo starts over.
_CU_MEMO: dict[tuple[int, tuple[int, ...], tuple[int, ...] | None],
               tuple[torch.Tensor, torch.Tensor | None]] = {}
_CU_MEMO_ENTRIES = 256
_CU_MEMO_MAX_LEN = 64


def _cu_seqlens(
    plan: BatchPlan, device: torch.device, stream: torch.cuda.Stream
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Merged cu_seqlens_k (and _q) on the device: (pinned buffer or None, cu_k, cu_q)."""
    cu_q_host = plan.cu_seqlens_q
    memo_key = None
    if len(plan.cu_seqlens_k) <= _CU_MEMO_MAX_LEN:
        memo_key = (stream.cuda_stream, tuple(plan.cu_seqlens_k),
                    None if cu_q_host is None else tuple(cu_q_host))
        hit = _CU_MEMO.get(memo_key)
        if hit is not None:
            return None, hit[0], hit[1]
    host, cu_k, cu_q = _upload_cu_seqlens(plan, device)
    if memo_key is not None:
        if len(_CU_MEMO) >= _CU_MEMO_ENTRIES:
            _CU_MEMO.clear()
        _CU_MEMO[memo_key] = (cu_k, cu_q)
    return host, cu_k, cu_q


def _upload_cu_seqlens(
    plan: BatchPlan, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Merged cu_seqlens_k (and _q) in one pinned buffer and one h2d copy."""
    n_k = len(plan.cu_seqlens_k)
    q_at = -(-n_k // _ALIGN) * _ALIGN
    n_q = len(plan.cu_seqlens_q) if plan.cu_seqlens_q is not None else 0
    host = torch.zeros(q_at + n_q, dtype=torch.int32, pin_memory=True)
    view = host.numpy()
    view[:n_k] = plan.cu_seqlens_k
    if plan.cu_seqlens_q is not None:
        view[q_at:] = plan.cu_seqlens_q
    dev = host.to(device, non_blocking=True)
    cu_q = dev[q_at:] if plan.cu_seqlens_q is not None else None
    return host, dev[:n_k], cu_q


class _CudaLaunch:
    """Holds every buffer of an issued batch until its last event has completed; then gives
    its events back for later launches."""

    def __init__(self, events: list[torch.cuda.Event], keep: tuple[object, ...]) -> None:
        self._events = events
        self._keep: tuple[object, ...] | None = keep

    def wait(self) -> LaunchTimes:
        e = self._events
        e[3].synchronize()  # releases the GIL while the GPU finishes
        self._keep = None  # device buffers go back to their stream's pool
        times = LaunchTimes(
            h2d_seconds=e[0].elapsed_time(e[1]) / 1e3,
            kernel_seconds=e[1].elapsed_time(e[2]) / 1e3,
            d2h_seconds=e[2].elapsed_time(e[3]) / 1e3,
        )
        _EVENTS.give_back(e)
        return times


# Each op's kernel call (``Op.kernel``), over the packed q, k, v: ``meta`` is a cached batch's
# block table and lengths, ``cu_k`` / ``cu_q`` a stateless one's merged cu_seqlens. Prefill
# kernels take no ``max_seqlen_k`` (they never read it); decode's picks its split count by it.
def _prefill(kernels: ModuleType, plan: BatchPlan, q: Any, k: Any, v: Any, meta: Any,
             cu_k: Any, cu_q: Any, **kw: Any) -> Any:
    return kernels.prefill(q, k, v, cu_q, cu_k, max_seqlen_q=plan.max_seqlen_q,
                           causal=plan.shared.causal, **kw)


def _decode(kernels: ModuleType, plan: BatchPlan, q: Any, k: Any, v: Any, meta: Any,
            cu_k: Any, cu_q: Any, **kw: Any) -> Any:
    return kernels.decode(q, k, v, cu_k, max_seqlen_k=plan.max_seqlen_k,
                          num_splits=plan.shared.num_splits, **kw)


def _paged_prefill(kernels: ModuleType, plan: BatchPlan, q: Any, k: Any, v: Any,
                   meta: _PagedMeta, cu_k: Any, cu_q: Any, **kw: Any) -> Any:
    return kernels.paged_prefill(q, meta.k_pages, meta.v_pages, meta.table, meta.cu_q,
                                 meta.seq_lens, max_seqlen_q=plan.max_seqlen_q,
                                 causal=plan.shared.causal, **kw)


def _paged_decode(kernels: ModuleType, plan: BatchPlan, q: Any, k: Any, v: Any,
                  meta: _PagedMeta, cu_k: Any, cu_q: Any, **kw: Any) -> Any:
    return kernels.paged_decode(q, meta.k_pages, meta.v_pages, meta.table, meta.seq_lens,
                                max_seqlen_k=plan.max_seqlen_k, num_splits=plan.shared.num_splits,
                                **kw)


_KERNEL_CALLS = {"prefill": _prefill, "decode": _decode, "paged_prefill": _paged_prefill,
                 "paged_decode": _paged_decode}


def launch_on_stream(
    kernels: ModuleType, plan: BatchPlan, device: torch.device, stream: torch.cuda.Stream
) -> PendingLaunch:
    """Queue the input copies, the kernel and the output copies of ``plan`` on ``stream``;
    don't wait. Device tensors are allocated while ``stream`` is current and used on it alone,
    so the caching allocator never hands their memory to another stream while they are in use.
    """
    # The stream made current by hand, as DecodeSteps.launch does (``with
    # torch.cuda.device(...), torch.cuda.stream(...)`` took ~60 us on an idle engine), the
    # current one asked for by device index (DecodeSteps.launch says why).
    previous = torch.cuda.current_stream(torch.cuda.current_device())
    torch.cuda.set_stream(stream)
    try:
        return _launch(kernels, plan, device, stream)
    finally:
        torch.cuda.set_stream(previous)


def _launch(
    kernels: ModuleType, plan: BatchPlan, device: torch.device, stream: torch.cuda.Stream
) -> PendingLaunch:
    """``launch_on_stream``'s work, with ``stream`` (and its device) current."""
    key = plan.shared
    if plan.sees_no_keys:
        plan.fill_no_keys()  # host fills are immediate; device fills run on this stream
        stream.synchronize()
        return DoneLaunch(LaunchTimes())
    events = _EVENTS.take()
    events[0].record(stream)
    seg = _by_segments(plan, device)
    if seg is not None:
        seg.pack()
        q, k, v = seg.q, seg.k, seg.v
    else:
        q = _packed(plan, "q", plan.total_q, (key.num_heads, key.head_dim), plan.q_offsets,
                    device)
        kv_row = (key.num_kv_heads, key.head_dim)
        k = _packed(plan, "k", plan.total_k, kv_row, plan.k_offsets, device)
        v = _packed(plan, "v", plan.total_k, kv_row, plan.k_offsets, device)
    meta: _PagedMeta | None = None
    cu_k = cu_q = None
    if plan.op.cached:
        meta = index = _PagedMeta(plan, device)
        store_new_tokens(plan, k, v, meta.slots)
    else:
        index, cu_k, cu_q = _cu_seqlens(plan, device, stream)
    events[1].record(stream)
    if not plan.op.queries:  # AppendKV: stored, nothing to compute or send back
        events[2].record(stream)
        events[3].record(stream)
        return _CudaLaunch(events, keep=(q, k, v, index, plan))
    lone = plan.jobs[0] if len(plan) == 1 else None
    # A lone job with device destinations gets the kernel's output written in place.
    out = lone.out if lone is not None and _on_device(lone.out, device) else None
    if seg is not None:
        out = seg.out
    lse = None
    if lone is not None and lone.lse is not None and _on_device(lone.lse, device):
        lse = lone.lse
    # Window / softcap / ALiBi and FP8 scales, when the launch has any.
    mods = {**plan.score_kwargs(device), **plan.fp8_kwargs(device)}
    call = _KERNEL_CALLS[plan.op.kernel]  # type: ignore[index]
    res = call(kernels, plan, q, k, v, meta, cu_k, cu_q, out=out, lse_out=lse,
               softmax_scale=key.softmax_scale, return_lse=plan.return_lse, **mods)
    out, lse = res if plan.return_lse else (res, None)
    events[2].record(stream)
    if seg is not None:
        seg.unpack()
    elif lone is None or lone.out.data_ptr() != out.data_ptr():
        _scatter_rows(plan, out)
    if lse is not None:
        for i, job in enumerate(plan.jobs):
            if job.lse is not None and job.lse.data_ptr() != lse.data_ptr():
                job.lse.copy_(plan.op.lse_rows(lse, *plan.rows(i)), non_blocking=True)
    events[3].record(stream)
    return _CudaLaunch(events, keep=(q, k, v, index, cu_k, out, lse, plan, mods,
                                     seg.keep if seg is not None else None))
