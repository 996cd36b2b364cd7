"""Cached decode steps on the GPU: one CUDA-graph replay per launch, its copies included.

A ``CacheDecode`` launch is tiny on the GPU (64 steps over 4K-token caches: ~0.1 ms) and was
expensive on the host: the general path (cuda_launch.py) packs q/k/v with one device copy per
job and tensor, builds the block table and slots in two more pinned buffers, scatters the new
tokens with two indexing kernels and launches the Triton kernel through its Python wrapper;
profiled on an H100 at 64 clients, that was ~0.55 ms of engine time per launch and the engine
(one process, one GIL) capped the server near 1,300 steps/s.

Here a launch's inputs are packed on the host (numpy) into one pinned staging buffer, and one
CUDA graph replay does the rest: the H2D copy of the staging into a device buffer of the same
layout, the scatter of the new tokens into their pool slots, the split-K paged decode kernel,
and the D2H copy of out and lse into the staging's pinned outputs, from where numpy copies
each job's rows into its destination once the launch is done. Each staging has its own graph
(captured with its addresses); a shape bucket keeps one staging per launch in flight, usually
one. The copies are graph nodes because each torch call on the launch path costs the engine
tens of microseconds at one client (a timestamp trace on an H100, benchmarks/trace_step.py:
the two copies, their events and the destination's view took ~110 us of a step's ~340 us
launch, against ~4 us each in a warm loop; git history: benchmarks/host_calls.py). So a step's
``kernel_seconds`` is the graph's GPU time, its few-KB copies included, and its h2d/d2h
seconds are 0.

Shapes are bucketed so a few graphs serve every step: the batch to the power of two above it
(padding rows have length 0: zeros out, never read), the block-table width likewise (entries
past a sequence's length are never read). Padding slots repeat the first new token's slot and
value, so their writes are identical duplicates. Graphs are captured lazily on first use, one
set per launch stream (replays on two streams must not share buffers), each set sharing one
memory pool (its graphs replay in stream order). ``--no-cuda-graphs`` keeps this staging but
runs the same device work eagerly.

Launches whose tensors are all in device memory (CUDA IPC regions: the caller's q, new k/v and
outputs on this GPU) take the same graphs in a variant of their own (``StepShape.device``):
the graph's copy-in moves the staged tables only, q and the new tokens are copied device to
device into the graph's buffers before the replay, and out/lse from them into the callers'
tensors after it, a few ``copy_`` calls instead of the general path's ~0.5 ms (issue 61: B=64
CUDA IPC steps took 2.06-2.12 ms p50 on an H200 against 1.76-1.81 through system shared
memory, which already came here).

Only ``CacheDecode`` launches whose tensors are all in host memory or all on the device, and
whose shape fits (``MAX_BATCH`` sequences, ``MAX_TABLE_WIDTH`` pages), come here; everything
else (a launch mixing the two, say) takes the general path.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch

from attention_kernels.fp8 import quantize_kv
from attention_service.engine.dtypes import TORCH_DTYPES
from attention_service.engine.jobs import BatchPlan, Job, LaunchTimes, PendingLaunch
from attention_service.engine.paged_store import scatter_rows
from attention_service.params import BatchKey, Params, key_fp8
from attention_wire.pb import attention_pb2 as pb

MAX_BATCH = 256  # sequences per launch on this path (the budget allows ~250 4K-token steps)
MAX_TABLE_WIDTH = 4096  # pages per sequence (256K tokens of 64-token pages)
_ALIGN = 128  # bytes: every staged tensor starts 128-byte aligned, like a fresh allocation


def bucket(n: int) -> int:
    """The power of two at or above ``n`` (at least 1)."""
    return 1 << max(0, n - 1).bit_length()


def eligible(plan: BatchPlan) -> bool:
    """A CacheDecode launch with keys, host tensors (outputs included) and a shape within this
    path's limits."""
    if plan.op.kernel != "paged_decode" or plan.max_seqlen_k == 0:
        return False
    if plan.shared.window != (-1, -1) or plan.shared.softcap > 0 or plan.shared.alibi_slopes:
        return False  # score modifiers run on the eager path (not staged or captured)
    if len(plan.seq_lens) > MAX_BATCH or plan.table_width > MAX_TABLE_WIDTH:
        return False
    # Host tensors go through the staging and numpy, device ones device to device: a launch
    # takes one way for all its tensors.
    places = {_place(j) for j in plan.jobs}
    return places == {"host"} or places == {"device"}


def _tensor_names(job: Job) -> list[str]:
    names = ["q", "out"]
    if job.params.return_lse:
        names.append("lse")
    if job.params.k_shape[0]:  # new tokens to store (k and v come together)
        names += ["k", "v"]
    return names


def _place(job: Job) -> str:
    """"host" when all of the job's tensors are in host memory, "device" when all are on a
    CUDA device, else "mixed"."""
    names = _tensor_names(job)
    if all(job.on_host(n) for n in names):
        return "host"
    tensors = [job.tensor(n) for n in names]
    if all(t is not None and t.is_cuda for t in tensors):
        return "device"
    return "mixed"


@dataclass(frozen=True)
class StepShape:
    """A graph's shape bucket: everything its captured work depends on."""

    key: BatchKey  # the launch's batch key (``Params.key``, FP8 caches marked)
    # The key's fields by name: the params of a job of that key (``BatchPlan.shared``). Not
    # compared: equal keys have equal fields.
    params: Params = field(compare=False)
    batch: int  # bucketed sequences
    width: int  # bucketed block-table columns
    new_rows: int  # bucketed new tokens to write first (usually one per sequence); 0: none
    device: bool = False  # the jobs' tensors are on the device (see the module doc)

    @staticmethod
    def of(plan: BatchPlan) -> StepShape:
        n = len(plan.slot_pages)
        return StepShape(plan.key, plan.shared, bucket(len(plan.seq_lens)),
                         bucket(plan.table_width), bucket(n) if n else 0,
                         not plan.jobs[0].on_host("q"))

    @property
    def fp8(self) -> bool:
        return key_fp8(self.key)

    @functools.cached_property
    def tables_at(self) -> int:
        """Where the staged tables start (after q, k and v): a device launch copies in from
        here only."""
        return next(at for name, _, _, at in self.layout[0] if name == "slots")

    @property
    def store(self) -> bool:
        return self.new_rows > 0

    @property
    def quantize(self) -> bool:
        """New tokens arrive in the queries' dtype for FP8 caches: quantized before the store."""
        return self.fp8 and self.store and self.params.kv_dtype != pb.FLOAT8_E4M3

    @functools.cached_property
    def layout(self) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...], int]], int]:
        """The staged fields (name, dtype, dims, byte offset, each 128-byte aligned) and the
        bytes they take: the same layout on host and device, so one copy moves them all."""
        k = self.params
        dtype, kv_dtype = TORCH_DTYPES[k.dtype], TORCH_DTYPES[k.kv_dtype]
        fields = [
            ("q", dtype, (self.batch, k.num_heads, k.head_dim)),
            ("k", kv_dtype, (self.new_rows, k.num_kv_heads, k.head_dim)),
            ("v", kv_dtype, (self.new_rows, k.num_kv_heads, k.head_dim)),
            ("slots", torch.int64, (2, self.new_rows)),
            ("lens", torch.int32, (self.batch,)),
            ("table", torch.int32, (self.batch, self.width)),
        ]
        if self.fp8:  # FP8 caches: each sequence's scales (k, v), and each new token's
            fields.append(("scales", torch.float32, (2, self.batch, k.num_kv_heads)))
            if self.quantize:
                fields.append(("new_scales", torch.float32, (2, self.new_rows, k.num_kv_heads)))
        placed, at = [], 0
        for name, dt, dims in fields:
            placed.append((name, dt, dims, at))
            at = -(-(at + math.prod(dims) * dt.itemsize) // _ALIGN) * _ALIGN
        return placed, at

    def outputs(self, **alloc: object) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers for the bucket's out ``[batch, H, D]`` and lse ``[batch, H]``."""
        k = self.params
        out = torch.empty((self.batch, k.num_heads, k.head_dim), dtype=TORCH_DTYPES[k.dtype],
                          **alloc)  # type: ignore[arg-type]
        return out, torch.empty((self.batch, k.num_heads), dtype=torch.float32,
                                **alloc)  # type: ignore[arg-type]

    def carve(self, u8: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of the fields in ``u8`` (``layout[1]`` bytes)."""
        return {name: u8[at : at + math.prod(dims) * dt.itemsize].view(dt).view(dims)
                for name, dt, dims, at in self.layout[0]}


class Staging:
    """One launch's pinned host buffers: the packed inputs and, for batches, the outputs."""

    def __init__(self, shape: StepShape, pin: bool = True) -> None:
        self.u8 = torch.empty(shape.layout[1], dtype=torch.uint8, pin_memory=pin)
        self.views = shape.carve(self.u8)
        # The same fields as numpy bytes: jobs' tensors are packed in and unpacked out with
        # numpy, no torch call per job (each would release and retake the engine's GIL).
        u8 = self.u8.numpy()
        self.bytes = {name: u8[at : at + math.prod(dims) * dt.itemsize]
                      for name, dt, dims, at in shape.layout[0]}
        self.lens = self.views["lens"].numpy()
        self.table = self.views["table"].numpy()
        self.slots = self.views["slots"].numpy()
        self.out, self.lse = shape.outputs(pin_memory=pin)
        self.out_bytes = self.out.view(-1).view(torch.uint8).numpy()
        self.lse_bytes = self.lse.view(-1).view(torch.uint8).numpy()
        # The launch's two timing events, made on its first launch and reused with it: the
        # staging goes back to its graph only after they are read.
        self.events: list[torch.cuda.Event] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None  # copies in, work, copies out
        self.table_rows: list[list[int]] | None = None  # what ``table`` holds

    def fill(self, plan: BatchPlan, shape: StepShape) -> None:
        v = self.views
        jobs = plan.jobs
        b = len(plan.seq_lens)
        n = len(plan.slot_pages)
        if not shape.device:  # device tensors are copied on the device (``copy_in``)
            _pack([j.host_bytes("q") for j in jobs], self.bytes["q"])
            if shape.store:
                _pack([j.host_bytes("k") for j in jobs], self.bytes["k"])
                _pack([j.host_bytes("v") for j in jobs], self.bytes["v"])
                if n < shape.new_rows:  # duplicates of the first write: harmless
                    v["k"][n:] = v["k"][0]
                    v["v"][n:] = v["v"][0]
        if shape.store:
            self.slots[0, :n] = plan.slot_pages
            self.slots[1, :n] = plan.slot_offsets
            self.slots[0, n:] = plan.slot_pages[0]
            self.slots[1, n:] = plan.slot_offsets[0]
        self.lens[:b] = plan.seq_lens
        self.lens[b:] = 0  # padding rows: no keys, zeros out, the table row is never read
        if shape.fp8:
            scales = v["scales"].numpy()
            scales[:, :b] = np.asarray(plan.seq_scales, dtype=np.float32).transpose(1, 0, 2)
            scales[:, b:] = 1.0  # padding rows read no keys
            if shape.quantize:  # per new token, its sequence's scales; padding repeats row 0
                new = v["new_scales"].numpy()
                new[:, :n] = np.repeat(scales[:, :b], plan.seq_new_rows, axis=1)
                new[:, n:] = new[:, :1]
        # The table is written only when it changed: 64 rows of 32 pages a row at a time took
        # ~135 us in a loop on the dev box, the comparison ~4 us, and steps on the same caches
        # repeat it until a store crosses into a new page. (On the H200 host the fill stayed
        # ~110-130 us: there q's copy into the pinned staging is most of it.)
        rows = plan.block_table
        if rows != self.table_rows:
            for i, row in enumerate(rows):
                self.table[i, : len(row)] = row  # columns past a sequence's pages: never read
            self.table_rows = rows  # page lists are never changed in place (kv_caches)


    def scatter(self, plan: BatchPlan) -> None:
        """Each job's rows of the staged out [B, H, D] and lse [B, H] (contiguous bytes) into
        its own destination, through numpy (a lone job's too: no torch view of it is made)."""
        out_row = self.out_bytes.size // self.out.shape[0]
        lse_row = self.lse_bytes.size // self.lse.shape[0]
        for i, job in enumerate(plan.jobs):
            r0, r1 = plan.rows(i)
            job.host_bytes("out")[:] = self.out_bytes[r0 * out_row : r1 * out_row]  # type: ignore[index]
            lse = job.host_bytes("lse")
            if lse is not None:
                lse[:] = self.lse_bytes[r0 * lse_row : r1 * lse_row]


def _pack(parts: list[np.ndarray | None], dst: np.ndarray) -> None:
    """The parts' bytes one after another at the start of ``dst`` (empty parts add none)."""
    size = sum(p.size for p in parts)  # type: ignore[union-attr]
    if size:
        np.concatenate(parts, out=dst[:size])  # type: ignore[arg-type]


class _StepGraph:
    """The device side of one shape bucket on one stream: the device buffers, the eager work,
    and a free list of host stagings, each with the graph captured over its buffers."""

    def __init__(self, kernels: ModuleType, shape: StepShape, k_pages: torch.Tensor,
                 v_pages: torch.Tensor, device: torch.device,
                 capture: tuple[object, torch.cuda.Stream] | None) -> None:
        """``capture``: (memory pool, capture stream) to capture each staging's graph with;
        None: run the staged work eagerly (``--no-cuda-graphs``)."""
        self.kernels, self.shape = kernels, shape
        self.k_pages, self.v_pages = k_pages, v_pages
        self.dev_u8 = torch.zeros(shape.layout[1], dtype=torch.uint8, device=device)
        self.dev = shape.carve(self.dev_u8)
        self.out, self.lse = shape.outputs(device=device)
        # FP8 caches: the staged per-sequence scales ([batch, H_kv] each), so any caches'
        # scales share the bucket's graph.
        self.fp8: dict[str, torch.Tensor] = {}
        if shape.fp8:
            self.fp8 = {"k_scale": self.dev["scales"][0], "v_scale": self.dev["scales"][1]}
        self._capture = capture
        self.captured = 0  # graphs captured (one per staging)
        # Popped by the launching thread, pushed back by the completer.
        self._free: deque[Staging] = deque()

    def run_eager(self, store: bool = True) -> None:
        d, shape = self.dev, self.shape
        if store and shape.store:
            slots = (d["slots"][0], d["slots"][1])
            k, v = d["k"], d["v"]
            if shape.quantize:  # new tokens in the queries' dtype, FP8 cache
                k = quantize_kv(k, d["new_scales"][0])[0]
                v = quantize_kv(v, d["new_scales"][1])[0]
            scatter_rows(self.k_pages, slots, k)
            scatter_rows(self.v_pages, slots, v)
        key = shape.params
        self.kernels.paged_decode(
            d["q"], self.k_pages, self.v_pages, d["table"], d["lens"],
            max_seqlen_k=shape.width * self.k_pages.shape[1], softmax_scale=key.softmax_scale,
            num_splits=key.num_splits, return_lse=True, out=self.out, lse_out=self.lse,
            **self.fp8,
        )

    def run_staged(self, staging: Staging) -> None:
        """The whole step on the current stream: staging in, the work, out and lse back (a
        device launch: the tables in, the work; its tensors move in ``copy_in``/``copy_out``)."""
        if self.shape.device:
            at = self.shape.tables_at
            self.dev_u8[at:].copy_(staging.u8[at:], non_blocking=True)
            self.run_eager()
            return
        self.dev_u8.copy_(staging.u8, non_blocking=True)
        self.run_eager()
        staging.out.copy_(self.out, non_blocking=True)
        staging.lse.copy_(self.lse, non_blocking=True)

    def copy_in(self, plan: BatchPlan) -> None:
        """A device launch's q and new k/v, device to device into this graph's buffers (on the
        current stream, before the replay); padding rows of k/v repeat the first new token."""
        d = self.dev
        for i, job in enumerate(plan.jobs):
            r0, r1 = plan.rows(i)
            d["q"][r0:r1].copy_(job.q, non_blocking=True)  # type: ignore[arg-type]
            k0, k1 = plan.k_offsets[i], plan.k_offsets[i + 1]
            if self.shape.store and k1 > k0:
                d["k"][k0:k1].copy_(job.k, non_blocking=True)  # type: ignore[arg-type]
                d["v"][k0:k1].copy_(job.v, non_blocking=True)  # type: ignore[arg-type]
        n = len(plan.slot_pages)
        if self.shape.store and n < self.shape.new_rows:
            d["k"][n:].copy_(d["k"][:1].expand_as(d["k"][n:]), non_blocking=True)
            d["v"][n:].copy_(d["v"][:1].expand_as(d["v"][n:]), non_blocking=True)

    def copy_out(self, plan: BatchPlan) -> None:
        """A device launch's out (and lse) rows into each job's tensors (after the replay)."""
        for i, job in enumerate(plan.jobs):
            r0, r1 = plan.rows(i)
            job.out.copy_(self.out[r0:r1], non_blocking=True)  # type: ignore[union-attr]
            if job.params.return_lse:
                job.lse.copy_(self.lse[r0:r1], non_blocking=True)  # type: ignore[union-attr]

    def _capture_for(self, staging: Staging) -> None:
        """Capture ``staging``'s graph on the capture stream (DecodeSteps' own, never a launch
        stream: see there)."""
        assert self._capture is not None
        pool, stream = self._capture
        # A first eager run compiles whatever Triton variant this shape needs (a compile inside
        # a capture failed for an fp32 variant on an H100), as the captured calls take it
        # (``for_cuda_graphs``: on Hopper, the decode's PDL merge). Its inputs are zeros: every
        # length is 0, so nothing is read; the store is left out, since slot (0, 0) may hold a
        # live cache's key.
        # After this thread's work so far (the zero fill of this graph's fresh buffers).
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with self.kernels.for_cuda_graphs():
            if not self.captured:
                with torch.cuda.stream(stream):
                    self.run_eager(store=False)
                stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the completer thread synchronizes on events meanwhile, which a
            # global capture would refuse. The staging's pinned buffers are never freed while
            # the graph lives (its copies are nodes of the graph).
            with torch.cuda.graph(graph, pool=pool, stream=stream,
                                  capture_error_mode="thread_local"):
                self.run_staged(staging)
        staging.graph = graph
        self.captured += 1

    def staging(self, rows: list[list[int]] | None = None) -> Staging:
        """A free staging (its graph captured), or a new one when all are in flight. One
        whose block table holds ``rows`` already comes first: with several steps in flight a
        model host's layers alternate, and each layer's steps then find their table written
        (``Staging.fill``: ~100 us to rewrite 64 rows, dev box). No staging is made for that
        alone: a capture in the middle of traffic holds the launching thread."""
        free = self._free
        if rows is not None:
            for i in range(len(free) - 1, -1, -1):  # the most recent first
                if free[i].table_rows == rows:
                    staging = free[i]
                    del free[i]
                    staging.table_rows = rows  # equal: ``fill``'s check then compares by identity
                    return staging
        try:
            return free.pop()
        except IndexError:
            pass
        staging = Staging(self.shape)
        if self._capture is not None:
            self._capture_for(staging)
        return staging

    def give_back(self, staging: Staging) -> None:
        self._free.append(staging)


class _StepLaunch:
    """An issued step launch: waits, copies each job's rows from the pinned staging into its
    destination, and returns the staging to its graph."""

    def __init__(self, events: list[torch.cuda.Event], plan: BatchPlan, graph: _StepGraph,
                 staging: Staging) -> None:
        self._events, self._plan, self._graph = events, plan, graph
        self._staging = staging

    def wait(self) -> LaunchTimes:
        e = self._events
        e[1].synchronize()  # releases the GIL while the GPU finishes
        try:
            if not self._graph.shape.device:  # device outputs are written already
                self._staging.scatter(self._plan)
            # Read before the staging (and its events) can be launched again.
            return LaunchTimes(kernel_seconds=e[0].elapsed_time(e[1]) / 1e3)
        finally:
            self._graph.give_back(self._staging)


class DecodeSteps:
    """Step graphs per (shape bucket, stream), captured on first use; see the module doc."""

    def __init__(self, kernels: ModuleType, device: torch.device, streams: list[torch.cuda.Stream],
                 graphs: bool = True) -> None:
        self.kernels, self.device, self.streams = kernels, device, streams
        self.use_graphs = graphs
        # One memory pool per stream: a stream's graphs replay one after another, so their
        # temporaries may share memory; graphs of two streams may run at once, so they don't.
        self._pools = [torch.cuda.graph_pool_handle() for _ in streams] if graphs else []
        # Captures run on a stream of their own (a graph replays on any stream; captured
        # kernels get buffers of the graph's own). On a launch stream, a pinned host buffer
        # freed meanwhile by another thread (its last copy ran on that stream) had torch's host
        # allocator record an event into the capture, and the next pinned allocation's event
        # query failed and invalidated it (a GPU service test, H100, 2026-11-24: "operation
        # not permitted on an event last recorded in a capturing stream"). No copy ever runs
        # on this one; captures are one at a time (launches are, under the executor's lock).
        self._capture_stream = torch.cuda.Stream(device) if graphs else None
        self._graphs: dict[tuple[StepShape, int, int], _StepGraph] = {}

    eligible = staticmethod(eligible)

    @property
    def captured(self) -> int:
        return sum(g.captured for g in self._graphs.values())

    def _graph(self, shape: StepShape, stream_index: int, k_pages: torch.Tensor,
               v_pages: torch.Tensor) -> _StepGraph:
        gkey = (shape, stream_index, k_pages.data_ptr())
        got = self._graphs.get(gkey)
        if got is None:
            capture = None
            if self.use_graphs:
                assert self._capture_stream is not None
                capture = (self._pools[stream_index], self._capture_stream)
            got = _StepGraph(self.kernels, shape, k_pages, v_pages, self.device, capture)
            self._graphs[gkey] = got
        return got

    def launch(self, plan: BatchPlan, stream_index: int) -> PendingLaunch:
        """Issue ``plan`` (``eligible``) on stream ``stream_index``; don't wait."""
        work = plan.jobs[0].cache
        assert work is not None
        shape = StepShape.of(plan)
        graph = self._graph(shape, stream_index, work.k_pages, work.v_pages)
        staging = graph.staging(plan.block_table)
        try:
            staging.fill(plan, shape)
        except BaseException:
            graph.give_back(staging)
            raise
        stream = self.streams[stream_index]
        events = staging.events
        if events is None:
            events = staging.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        # The stream made current by hand (set_stream also makes its device current, and the
        # restore puts both back): ``with torch.cuda.device(...), torch.cuda.stream(...)``
        # took ~13 us a launch in a warm loop (host_calls.py), ~60 us on an idle engine.
        # Events are recorded on the stream named (record() without one looks it up), and the
        # current stream is asked for by device index: without one, torch finds the device
        # through is_available() and an environment read (~5% of a B=64 socket step's
        # engine GIL time in a py-spy profile, H200).
        previous = torch.cuda.current_stream(torch.cuda.current_device())
        torch.cuda.set_stream(stream)
        try:
            events[0].record(stream)
            if shape.device:
                graph.copy_in(plan)
            if staging.graph is not None:
                staging.graph.replay()
            else:
                graph.run_staged(staging)
            if shape.device:
                graph.copy_out(plan)
            events[1].record(stream)
        finally:
            torch.cuda.set_stream(previous)
        return _StepLaunch(events, plan, graph, staging)
