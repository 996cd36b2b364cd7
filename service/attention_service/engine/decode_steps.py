"""Cached decode steps on the GPU: one CUDA-graph replay per launch, its copies included.

A ``CacheDecode`` launch is tiny on the GPU (64 steps over 4K-token caches: ~0.1 ms) and was
expensive on the host: the general path (cuda_launch.py) packs q/k/v with one device copy per
job and tensor, builds the block table and slots in two more pinned buffers, scatters the new
tokens with two indexing kernels and launches the Triton kernel through its Python wrapper;
profiled on an H100 at 64 clients, that was ~0.55 ms of engine time per launch and the engine
(one process, one GIL) capped the server near 1,300 steps/s.

Here the host writes a launch's tables into one pinned staging buffer with numpy: where each
job's q, new k/v and outputs are (a copy table of addresses, ``copy_segments``' rows), the new
tokens' pool slots, the lengths and the block table. One CUDA graph replay does the rest: the
staging's H2D copy into a device buffer of the same layout, one ``copy_segments`` launch that
gathers every job's q and new k/v from wherever they lie (page-locked host memory the device
reads at its host address, or device memory: CUDA IPC regions) into the graph's buffers, the
scatter of the new tokens into their pool slots, the split-K paged decode kernel, and one more
``copy_segments`` launch that writes out and lse straight into each job's destinations. The
host touches no tensor bytes: packing a B=64 step's 768 KiB of inputs into the staging and its
512 KiB of outputs back out with numpy took ~150 us of the engine's GIL per step (trace_step
--socket, H200: the step's p50 went 1216 -> 1045 us without them, the graph's GPU time 209 ->
195 us), and a device-memory job's per-tensor ``copy_`` calls ~10-20 us each. The
copies are graph nodes because each torch call on the launch path costs the engine tens of
microseconds at one client (benchmarks/trace_step.py). So a step's ``kernel_seconds`` is the
graph's GPU time, its copies included, and its h2d/d2h seconds are 0.

Shapes are bucketed so a few graphs serve every step: the batch to the power of two above it
(padding rows have length 0: zeros out, never read), the block-table width likewise (entries
past a sequence's length are never read), the jobs likewise (the copy table's rows; unused
rows copy 0 bytes). Padding slots repeat the first new token's slot and value (extra copy
rows), so their writes are identical duplicates. Graphs are captured lazily on first use, one
set per launch stream (replays on two streams must not share buffers), each set sharing one
memory pool (its graphs replay in stream order). ``--no-cuda-graphs`` keeps this staging but
runs the same device work eagerly.

Only ``CacheDecode`` launches whose tensors all lie where the device can read and write them
at their addresses (``ByteBase.device_readable``: this device's memory, or page-locked host
memory), and whose shape fits (``MAX_BATCH`` sequences, ``MAX_TABLE_WIDTH`` pages), come here;
everything else (a step read into pageable memory, say) takes the general path.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch

from attention_kernels.copy_segments import (
    ROW,
    can_use_host_pointers,
    copy_segments,
    copy_segments_ref,
    unit_of,
)
from attention_kernels.fp8 import quantize_kv
from attention_service.engine.dtypes import TORCH_DTYPES
from attention_service.engine.jobs import BatchPlan, Job, LaunchTimes, PendingLaunch
from attention_service.engine.paged_store import (
    new_page_cells,
    scatter_rows,
    write_new_pages,
    write_row,
)
from attention_service.params import BatchKey, Params, key_fp8
from attention_wire.pb import attention_pb2 as pb

MAX_BATCH = 256  # sequences per launch on this path (the budget allows ~250 4K-token steps)
MAX_TABLE_WIDTH = 4096  # pages per sequence (256K tokens of 64-token pages)
_ALIGN = 128  # bytes: every staged tensor starts 128-byte aligned, like a fresh allocation
# Stagings one shape bucket keeps per stream, each holding one table (``_StepGraph.staging``):
# as many as tables in rotation (8 hosts x 2 layers: 16), within a count and pinned bytes, and
# the pinned bytes of all buckets' (a B=64 bucket's staging: ~30 KiB, B=256 x 4096 pages: 4).
_MAX_STAGINGS = 32
_MAX_STAGING_BYTES = 16 << 20
_MAX_STAGING_BYTES_ALL = 256 << 20
_OUTPUTS = ("out", "lse")

# A tensor's place for the copy table: (address, bytes).
Place = tuple[int, int]


def bucket(n: int) -> int:
    """The power of two at or above ``n`` (at least 1)."""
    return 1 << max(0, n - 1).bit_length()


def fits(plan: BatchPlan) -> bool:
    """A CacheDecode launch with keys, no score modifiers, and a shape within this path's
    limits."""
    if plan.op.kernel != "paged_decode" or plan.max_seqlen_k == 0:
        return False
    if plan.shared.window != (-1, -1) or plan.shared.softcap > 0 or plan.shared.alibi_slopes:
        return False  # score modifiers run on the eager path (not staged or captured)
    return len(plan.seq_lens) <= MAX_BATCH and plan.table_width <= MAX_TABLE_WIDTH


def places(plan: BatchPlan, registered: bool = True,
           device: torch.device | None = None) -> list[dict[str, Place]] | None:
    """Where each job's tensors lie, as (address, bytes), when the launch ``fits`` and
    ``device`` may take every address as it is (a kernel reads or writes it there); else None
    (the general path). ``device``'s memory counts (another GPU's needs peer access a kernel
    cannot assume; None: any device, for tests without one), and so does page-locked host
    memory: torch's pinned blocks (``ByteBase.pinned``), and memory page-locked by registration
    (``cudaHostRegister``: arenas, shared-memory regions) where ``registered``
    (``can_use_host_pointers``). No view of a span is made."""
    if not fits(plan):
        return None
    where = []
    for job in plan.jobs:
        got = {}
        for name in _tensor_names(job):
            place = _place(job, name, registered, device)
            if place is None:
                return None
            got[name] = place
        where.append(got)
    return where


def _tensor_names(job: Job) -> tuple[str, ...]:
    names: tuple[str, ...] = ("q", "out")
    if job.params.return_lse:
        names += ("lse",)
    if job.params.k_shape[0]:  # new tokens to store (k and v come together)
        names += ("k", "v")
    return names


def _place(job: Job, name: str, registered: bool, device: torch.device | None
           ) -> Place | None:
    """Tensor ``name``'s (address, bytes), or None where ``places`` says it may not be taken."""
    span = job.span(name)
    if span is not None:
        base, offset, dtype, dims = span
        if base.on_device:
            ok = device is None or base.u8.device == device
        else:
            ok = base.device_readable and (registered or base.pinned)
        return (base.ptr + offset, math.prod(dims) * dtype.itemsize) if ok else None
    t = job.tensor(name)
    if t is None or not t.is_contiguous():
        return None
    # Registered memory is pinned too, and a tensor does not say which kind it is.
    ok = (device is None or t.device == device) if t.is_cuda else registered and t.is_pinned()
    return (t.data_ptr(), t.numel() * t.element_size()) if ok else None


def row_bytes(params: Params) -> dict[str, int]:
    """Bytes of one row (a sequence's, or a new token's) of each of a launch's tensors."""
    q = params.num_heads * params.head_dim * TORCH_DTYPES[params.dtype].itemsize
    kv = params.num_kv_heads * params.head_dim * TORCH_DTYPES[params.kv_dtype].itemsize
    return {"q": q, "k": kv, "v": kv, "out": q, "lse": params.num_heads * 4}


def step_shape(plan: BatchPlan, where: list[dict[str, Place]]) -> StepShape:
    """The launch's bucket, its copy unit the largest that divides every address and length
    of its copies (buffer offsets are multiples of 128 bytes and of the row sizes)."""
    bits = 0
    for job in where:
        for at, n in job.values():
            bits |= at | n
    memo = plan.shared.memo
    rows = memo.get(row_bytes)
    if rows is None:
        rows = memo[row_bytes] = tuple(row_bytes(plan.shared).values())
    return StepShape.of(plan, unit_of(bits, *rows))  # type: ignore[misc]


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
    jobs: int = 1  # bucketed jobs: the copy table has rows for this many
    unit: int = 8  # bytes the copies move per element: divides every address and length

    def __post_init__(self) -> None:
        # Hashed once: a launch looks its graphs up by shape on each stream (the generated
        # hash went through the key's 13 fields each time).
        object.__setattr__(self, "_hash", hash(
            (self.key, self.batch, self.width, self.new_rows, self.jobs, self.unit)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined,no-any-return]

    @staticmethod
    def of(plan: BatchPlan, unit: int = 8) -> StepShape:
        """``plan``'s bucket at copy unit ``unit`` (``step_shape`` finds the launch's): one
        object per bucket, made once (``_SHAPES``)."""
        n = len(plan.slot_pages)
        dims = (plan.key, bucket(len(plan.seq_lens)), bucket(plan.table_width),
                bucket(n) if n else 0, bucket(len(plan.jobs)), unit)
        shape = _SHAPES.get(dims)
        if shape is None:
            if len(_SHAPES) >= _MAX_SHAPES:
                _SHAPES.clear()
            shape = _SHAPES[dims] = StepShape(dims[0], plan.shared, *dims[1:])
        return shape

    @property
    def fp8(self) -> bool:
        return key_fp8(self.key)

    @property
    def store(self) -> bool:
        return self.new_rows > 0

    @property
    def quantize(self) -> bool:
        """New tokens arrive in the queries' dtype for FP8 caches: quantized before the store."""
        return self.fp8 and self.store and self.params.kv_dtype != pb.FLOAT8_E4M3

    @property
    def padding_rows(self) -> int:
        """At most this many new-token rows are padding (fewer than half the bucket)."""
        return self.new_rows // 2

    @property
    def copies_in(self) -> int:
        """Copy-table rows that gather inputs: q, k, v per job, and each padding row's k, v."""
        return 3 * self.jobs + 2 * self.padding_rows

    @property
    def copies_out(self) -> int:
        return 2 * self.jobs  # out and lse per job

    @functools.cached_property
    def row_bytes(self) -> dict[str, int]:
        return row_bytes(self.params)

    @functools.cached_property
    def longest_copy(self) -> tuple[int, int]:
        """The most units one input row and one output row of the copy table may move."""
        r = self.row_bytes
        most_in = max(self.batch * r["q"], self.new_rows * r["k"])
        most_out = self.batch * max(r["out"], r["lse"])  # lse rows are longer at head_dim 1
        return -(-most_in // self.unit), -(-most_out // self.unit)

    @functools.cached_property
    def tables(self) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...], int]], int]:
        """The staged fields (name, dtype, dims, byte offset, each 128-byte aligned) and the
        bytes they take: the same layout on host and device, so one copy moves them all."""
        k = self.params
        fields = [
            ("copies", torch.int64, (self.copies_in + self.copies_out, ROW)),
            ("slots", torch.int64, (2, self.new_rows)),
            ("lens", torch.int32, (self.batch,)),
            ("table", torch.int32, (self.batch, self.width)),
        ]
        if self.fp8:  # FP8 caches: each sequence's scales (k, v), and each new token's
            fields.append(("scales", torch.float32, (2, self.batch, k.num_kv_heads)))
            if self.quantize:
                fields.append(("new_scales", torch.float32, (2, self.new_rows, k.num_kv_heads)))
        return _placed(fields)

    @functools.cached_property
    def buffers(self) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...], int]], int]:
        """The graph's device buffers the inputs are gathered into and the outputs computed
        in, in one allocation."""
        k = self.params
        dtype, kv_dtype = TORCH_DTYPES[k.dtype], TORCH_DTYPES[k.kv_dtype]
        return _placed([
            ("q", dtype, (self.batch, k.num_heads, k.head_dim)),
            ("k", kv_dtype, (self.new_rows, k.num_kv_heads, k.head_dim)),
            ("v", kv_dtype, (self.new_rows, k.num_kv_heads, k.head_dim)),
            ("out", dtype, (self.batch, k.num_heads, k.head_dim)),
            ("lse", torch.float32, (self.batch, k.num_heads)),
        ])


# StepShape.of's shapes by (key, batch, width, new rows, jobs, unit): a few per model host.
_SHAPES: dict[tuple[object, ...], StepShape] = {}
_MAX_SHAPES = 4096


def _placed(fields: list[tuple[str, torch.dtype, tuple[int, ...]]]
            ) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...], int]], int]:
    placed, at = [], 0
    for name, dt, dims in fields:
        placed.append((name, dt, dims, at))
        at = -(-(at + math.prod(dims) * dt.itemsize) // _ALIGN) * _ALIGN
    return placed, at


def _carve(u8: torch.Tensor, layout: list[tuple[str, torch.dtype, tuple[int, ...], int]]
           ) -> dict[str, torch.Tensor]:
    """Typed views of the fields in ``u8``."""
    return {name: u8[at : at + math.prod(dims) * dt.itemsize].view(dt).view(dims)
            for name, dt, dims, at in layout}


class Staging:
    """One launch's pinned host tables, each with the graph captured over its buffers."""

    def __init__(self, shape: StepShape, pin: bool = True) -> None:
        self.u8 = torch.zeros(shape.tables[1], dtype=torch.uint8, pin_memory=pin)
        self.views = _carve(self.u8, shape.tables[0])
        self.copies = self.views["copies"].numpy()
        self.lens = self.views["lens"].numpy()
        self.table = self.views["table"].numpy()
        self.slots = self.views["slots"].numpy()
        # The copy-table rows the last fill wrote (inputs, outputs).
        self.copy_rows: tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]] = ([], [])
        # The launch's two timing events, made on its first launch and reused with it: the
        # staging goes back to its graph only after they are read.
        self.events: list[torch.cuda.Event] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None  # tables in, copies, work, copies out
        # What ``table`` holds: these rows, and past them these pages (``CacheWork.new_pages``).
        self.table_rows: list[list[int]] | None = None
        self.new_pages: list[int] | None = None
        self.new_cells: tuple[np.ndarray, np.ndarray] | None = None  # of ``table_rows``
        # The slot pages, slot offsets and lengths ``slots`` and ``lens`` hold (lists as given).
        self.written_lists: tuple[list[int], list[int], list[int]] | None = None
        self.written = 0  # when ``_StepGraph.staging`` last handed it out
        self.ids: object = None  # the cache ids of the jobs its table was last written for

    def fill(self, plan: BatchPlan, shape: StepShape, where: list[dict[str, Place]],
             buffers: dict[str, int]) -> None:
        """The launch's tables: its copies (each job's tensors at ``where``, the graph's
        buffers at the device addresses ``buffers``), slots, lengths, scales, block table."""
        self._fill_copies(plan, shape, where, buffers)
        b = len(plan.seq_lens)
        n = len(plan.slot_pages)
        # Lists of 64 ints take ~3 us each to convert and write, their comparison ~0.3 us: a
        # step without store repeats its lengths and offsets (its pages too, but for fresh ones).
        last = self.written_lists
        self.written_lists = None  # a write that fails halfway leaves lists nobody matches
        if shape.store:
            if last is None or plan.slot_pages != last[0]:
                self.slots[0, :n] = plan.slot_pages
                self.slots[0, n:] = plan.slot_pages[0]
            if last is None or plan.slot_offsets != last[1]:
                self.slots[1, :n] = plan.slot_offsets
                self.slots[1, n:] = plan.slot_offsets[0]
        if last is None or plan.seq_lens != last[2]:
            self.lens[:b] = plan.seq_lens
            self.lens[b:] = 0  # padding rows: no keys, zeros out, the table row is never read
        if shape.fp8:
            scales = self.views["scales"].numpy()
            scales[:, :b] = np.asarray(plan.seq_scales, dtype=np.float32).transpose(1, 0, 2)
            scales[:, b:] = 1.0  # padding rows read no keys
            if shape.quantize:  # per new token, its sequence's scales; padding repeats row 0
                new = self.views["new_scales"].numpy()
                new[:, :n] = np.repeat(scales[:, :b], plan.seq_new_rows, axis=1)
                new[:, n:] = new[:, :1]
        # The table is written only where it changed: 64 rows of 33 pages take ~55-70 us to
        # convert and write (dev box; numpy converts ~25 ns an int), the comparison ~2 us,
        # and steps on the same caches repeat it until a store crosses into a new page. Then
        # only that cache's page list is new (kv_caches: lists are never changed in place, a
        # cache's list is the same object until it gains a page), so its row alone is written.
        rows, old = plan.block_table, self.table_rows
        if rows is not old and rows != old:
            table = self.table
            # A write that fails halfway leaves a table nobody matches.
            self.table_rows = self.new_pages = self.new_cells = None
            if old is None or len(old) != len(rows):
                for i, row in enumerate(rows):
                    write_row(table, i, row)  # columns past a sequence's pages: never read
            else:
                for i, (row, was) in enumerate(zip(rows, old, strict=True)):
                    if row is not was and row != was:
                        write_row(table, i, row)
            self.table_rows = rows
        # A decode step's fresh pages: a step without store on a page boundary takes one per
        # sequence every step, other pages each time with steps in flight: written at cells kept
        # while the rows stay.
        added = plan.new_pages
        if added is not None and added != self.new_pages:
            self.new_pages = None
            if self.new_cells is None:
                self.new_cells = new_page_cells(rows)
            write_new_pages(self.table, self.new_cells, added)
        self.new_pages = added
        self.written_lists = (plan.slot_pages, plan.slot_offsets, plan.seq_lens)

    def _fill_copies(self, plan: BatchPlan, shape: StepShape, where: list[dict[str, Place]],
                     buffers: dict[str, int]) -> None:
        """Copy-table rows (source, destination, bytes): job i's q into the buffer's rows
        ``plan.rows(i)``, its new k/v into rows ``k_offsets[i]:``, the padding tokens' k/v
        from the first new token; its out/lse from the buffer's rows into its own. Rows the
        last fill wrote past these copy nothing now (length 0)."""
        r = shape.row_bytes
        ins: list[tuple[int, int, int]] = []
        outs: list[tuple[int, int, int]] = []
        for i, job in enumerate(where):
            r0 = plan.q_offsets[i]
            k0 = plan.k_offsets[i]
            for name, row in (("q", r0), ("k", k0), ("v", k0)):
                if name in job:
                    at, n = job[name]
                    ins.append((at, buffers[name] + row * r[name], n))
            for name in _OUTPUTS:
                if name in job:
                    at, n = job[name]
                    outs.append((buffers[name] + r0 * r[name], at, n))
        n_new = len(plan.slot_pages)
        if shape.store and n_new < shape.new_rows:  # duplicates of the first write: harmless
            # From the first token's own memory, not the buffer's row 0: the copies of one
            # launch run in no order.
            first = next(job for job in where if "k" in job)
            for name in ("k", "v"):
                src, dst = first[name][0], buffers[name]
                ins += [(src, dst + row * r[name], r[name])
                        for row in range(n_new, shape.new_rows)]
        # Written only when they changed: a model host's steps come in the same few blocks
        # (a step socket's frames and answers reuse theirs), so a staging often finds its
        # copies as they are (the comparison: ~1 us for a lone job; the writes: a few numpy
        # calls, each several us on a busy engine).
        if (ins, outs) == self.copy_rows:
            return
        copies, unit, out_at = self.copies, shape.unit, shape.copies_in
        for at, rows, last in ((0, ins, self.copy_rows[0]), (out_at, outs, self.copy_rows[1])):
            if rows:
                copies[at : at + len(rows), :3] = rows
                copies[at : at + len(rows), 2] //= unit
            copies[at + len(rows) : at + len(last), 2] = 0  # the last fill's extra rows
        self.copy_rows = (ins, outs)


@dataclass
class _Budget:
    """Pinned bytes a DecodeSteps' graphs may still take for stagings (``_StepGraph.staging``):
    one shared count, only ever changed under the executor's launch lock."""

    left: int = _MAX_STAGING_BYTES_ALL


class _StepGraph:
    """The device side of one shape bucket on one stream: the device tables and buffers, the
    eager work, and a free list of host stagings, each with the graph captured over its
    tables."""

    def __init__(self, kernels: ModuleType, shape: StepShape, k_pages: torch.Tensor,
                 v_pages: torch.Tensor, device: torch.device,
                 capture: tuple[object, torch.cuda.Stream] | None,
                 budget: _Budget | None = None) -> None:
        """``capture``: (memory pool, capture stream) to capture each staging's graph with;
        None: run the staged work eagerly (``--no-cuda-graphs``). ``budget``: the pinned
        bytes left to all graphs' stagings (``staging``)."""
        self.kernels, self.shape = kernels, shape
        self.k_pages, self.v_pages = k_pages, v_pages
        self.device = device
        self.dev_u8 = torch.zeros(shape.tables[1], dtype=torch.uint8, device=device)
        self.dev = _carve(self.dev_u8, shape.tables[0])
        self.buf_u8 = torch.zeros(shape.buffers[1], dtype=torch.uint8, device=device)
        self.buf = _carve(self.buf_u8, shape.buffers[0])
        self.addresses = {name: t.data_ptr() for name, t in self.buf.items()}
        self.out, self.lse = self.buf["out"], self.buf["lse"]
        # FP8 caches: the staged per-sequence scales ([batch, H_kv] each), so any caches'
        # scales share the bucket's graph.
        self.fp8: dict[str, torch.Tensor] = {}
        if shape.fp8:
            self.fp8 = {"k_scale": self.dev["scales"][0], "v_scale": self.dev["scales"][1]}
        self._capture = capture
        self.captured = 0  # graphs captured (one per staging)
        self.made = 0  # stagings made, and how many it may make for tables of their own
        self.writes = 0  # stagings handed out for a table (each one's ``written``)
        self.cap = max(2, min(_MAX_STAGINGS, _MAX_STAGING_BYTES // shape.tables[1]))
        self.budget = budget if budget is not None else _Budget()
        # Popped by the launching thread, pushed back by the completer.
        self._free: deque[Staging] = deque()

    def _copy(self, rows: torch.Tensor, units: int) -> None:
        if self.device.type == "cuda":
            copy_segments(rows, self.shape.unit, units)
        else:  # the CPU tests: host addresses, the reference's memmove per row
            # What the kernel's grid would leave out, refused: the reference copies any length.
            longest = int(rows[:, 2].max()) if len(rows) else 0
            assert longest <= units, f"a copy of {longest} units, the grid's {units}"
            copy_segments_ref(rows, self.shape.unit)

    def gather(self) -> None:
        """Every job's q and new k/v (the copy table's input rows) into the buffers."""
        shape = self.shape
        self._copy(self.dev["copies"][: shape.copies_in], shape.longest_copy[0])

    def scatter(self) -> None:
        """The buffers' out and lse rows (the copy table's output rows) into each job's."""
        shape = self.shape
        self._copy(self.dev["copies"][shape.copies_in :], shape.longest_copy[1])

    def run_eager(self, store: bool = True) -> None:
        """The device work over the device tables: gather the inputs, store the new tokens
        (``store`` False: not, as a capture's first eager run over zero tables), decode, write
        the outputs to their destinations."""
        d, b, shape = self.dev, self.buf, self.shape
        self.gather()
        if store and shape.store:
            slots = (d["slots"][0], d["slots"][1])
            k, v = b["k"], b["v"]
            if shape.quantize:  # new tokens in the queries' dtype, FP8 cache
                k = quantize_kv(k, d["new_scales"][0])[0]
                v = quantize_kv(v, d["new_scales"][1])[0]
            scatter_rows(self.k_pages, slots, k)
            scatter_rows(self.v_pages, slots, v)
        key = shape.params
        self.kernels.paged_decode(
            b["q"], self.k_pages, self.v_pages, d["table"], d["lens"],
            max_seqlen_k=shape.width * self.k_pages.shape[1], softmax_scale=key.softmax_scale,
            num_splits=key.num_splits, return_lse=True, out=self.out, lse_out=self.lse,
            **self.fp8,
        )
        self.scatter()

    def run_staged(self, staging: Staging) -> None:
        """The whole step on the current stream: the staged tables in, the work."""
        self.dev_u8.copy_(staging.u8, non_blocking=True)
        self.run_eager()

    def _capture_for(self, staging: Staging) -> None:
        """Capture ``staging``'s graph on the capture stream (DecodeSteps' own, never a launch
        stream: see there)."""
        assert self._capture is not None
        pool, stream = self._capture
        # A first eager run compiles whatever Triton variant this shape needs (a compile inside
        # a capture failed for an fp32 variant on an H100), as the captured calls take it
        # (``for_cuda_graphs``: on Hopper, the decode's PDL merge). Its tables are zeros:
        # every length is 0, so nothing is read or copied (the copies run, so their unit's
        # variant is compiled here too when no warm-up did); the store is left out, since
        # slot (0, 0) may hold a live cache's key.
        # After this thread's work so far (the zero fill of this graph's fresh buffers).
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with self.kernels.for_cuda_graphs():
            if not self.captured:
                with torch.cuda.stream(stream):
                    self.run_eager(store=False)
                stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the completer thread synchronizes on events meanwhile, which a
            # global capture would refuse. The staging's pinned buffer is never freed while
            # the graph lives (its copy is a node of the graph).
            with torch.cuda.graph(graph, pool=pool, stream=stream,
                                  capture_error_mode="thread_local"):
                self.run_staged(staging)
        staging.graph = graph
        self.captured += 1

    def take(self, rows: list[list[int]], ids: object = None) -> Staging | None:
        """A free staging whose block table holds ``rows`` already, the most recent first
        (with several steps in flight a model host's layers alternate, and each layer's steps
        then find their table written; ``Staging.fill``), or None. With ``ids``: one last
        written for the same caches instead (their table changed where a cache gained a
        page: ``fill`` rewrites those rows). By index: the completer appends to the free list
        meanwhile, and an iterator over a deque that grows raises."""
        free = self._free
        for i in range(len(free) - 1, -1, -1):
            staging = free[i]
            if (staging.ids == ids) if ids is not None else (staging.table_rows == rows):
                del free[i]
                if ids is None:
                    staging.table_rows = rows  # equal: ``fill`` then compares by identity
                return staging
        return None

    def staging(self) -> Staging:
        """A staging for caches no free one was written for (``take`` missed both ways): a
        new one while fewer than ``cap`` were made and the shared ``budget`` of pinned bytes
        allows (or when all are in flight), so the caches of each host and layer in a
        rotation get one of their own and then find their table written, or rewritten only
        where a cache gained a page (with 8 hosts x 2 layers over the few stagings made for
        launches in flight, every step rewrote a table: ~20% of the engine's GIL time in a
        py-spy profile, H200; 16 tables of 64 x 33 pages in rotation took 105-109 us of host
        time a launch, and 16-18 with a staging each, dev box with CUDA stubbed). Past the
        cap, the free one handed out here last: in a rotation of more caches than stagings,
        the misses fall on one staging (one per launch in flight) and the others keep theirs.
        A capture holds the launching thread (~ms), once per staging."""
        free, nbytes = self._free, self.shape.tables[1]
        if free and (self.made >= self.cap or self.budget.left < nbytes):
            # By index, as in ``take``: the completer appends meanwhile (at the right end, so
            # the indices read stay valid; only the launching thread removes).
            last = max(range(len(free)), key=lambda i: free[i].written)
            staging = free[last]
            del free[last]
        else:
            staging = Staging(self.shape, pin=self.device.type == "cuda")
            self.made += 1
            self.budget.left -= nbytes
            if self._capture is not None:
                self._capture_for(staging)
        self.writes += 1
        staging.written = self.writes
        return staging

    def give_back(self, staging: Staging) -> None:
        self._free.append(staging)


class _StepLaunch:
    """An issued step launch: waits, and returns the staging to its graph."""

    def __init__(self, events: list[torch.cuda.Event], graph: _StepGraph,
                 staging: Staging) -> None:
        self._events, self._graph, self._staging = events, graph, staging

    def wait(self) -> LaunchTimes:
        e = self._events
        e[1].synchronize()  # releases the GIL while the GPU finishes
        try:
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
        self._budget = _Budget()  # the pinned bytes all graphs' stagings may still take
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
        self._registered = can_use_host_pointers(device.index or 0)
        self._stream_ids = [stream_ids(s) for s in streams]

    def places(self, plan: BatchPlan) -> list[dict[str, Place]] | None:
        """``places`` for this device: where the launch's tensors lie when it takes this path
        (``launch``), else None."""
        return places(plan, self._registered, self.device)

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
            got = _StepGraph(self.kernels, shape, k_pages, v_pages, self.device, capture,
                             self._budget)
            self._graphs[gkey] = got
        return got

    def _take(self, shape: StepShape, pages: int, order: list[int], rows: list[list[int]],
              ids: object) -> tuple[int, _StepGraph, Staging] | None:
        """The first stream in ``order`` whose graph has a free staging ``take`` gives."""
        for index in order:
            graph = self._graphs.get((shape, index, pages))
            staging = graph.take(rows, ids) if graph is not None else None
            if staging is not None:
                return index, graph, staging  # type: ignore[return-value]
        return None

    def launch(self, plan: BatchPlan, stream_index: int,
               where: list[dict[str, Place]] | None = None) -> PendingLaunch:
        """Issue ``plan`` on stream ``stream_index`` (or on the stream whose staging holds its
        table already); don't wait. ``where``: ``places(plan)``, not None (made here if not
        given)."""
        work = plan.jobs[0].cache
        assert work is not None
        if where is None:
            where = self.places(plan)
        assert where is not None, "launch takes a plan ``places`` placed"
        shape = step_shape(plan, where)
        rows, pages = plan.block_table, work.k_pages.data_ptr()
        # The named stream's graph first, then the others': a staging that holds this table
        # (a model host's layers alternate, each on the stream its table was staged on, until
        # a merged launch shifts the round robin by one: then every table was rewritten, ~7%
        # of the engine's GIL time at 2 B=64 steps in flight in a py-spy profile, H200).
        # Then one last written for the same caches (a cache gained a page: a row changed).
        order = [stream_index, *(i for i in range(len(self.streams)) if i != stream_index)]
        ids = tuple(job.params.cache_ids for job in plan.jobs)
        found = self._take(shape, pages, order, rows, None) or self._take(
            shape, pages, order, rows, ids)
        if found is not None:
            stream_index, graph, staging = found
        else:  # no graph is made for a stream the step does not run on
            graph = self._graph(shape, stream_index, work.k_pages, work.v_pages)
            staging = graph.staging()
        staging.ids = ids
        try:
            staging.fill(plan, shape, where, graph.addresses)
        except BaseException:
            graph.give_back(staging)
            raise
        stream = self.streams[stream_index]
        events = staging.events
        if events is None:
            events = staging.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        # The stream made current by hand (``with torch.cuda.device(...),
        # torch.cuda.stream(...)`` took ~13 us a launch in a warm loop, ~60 us on an idle
        # engine), by its ids (``enter_stream``). Events are recorded on the stream named
        # (record() without one looks it up).
        previous = enter_stream(self._stream_ids[stream_index])
        try:
            events[0].record(stream)
            if staging.graph is not None:
                staging.graph.replay()
            else:
                graph.run_staged(staging)
            events[1].record(stream)
        finally:
            leave_stream(previous)
        return _StepLaunch(events, graph, staging)


StreamIds = tuple[int, int, int]  # a CUDA stream's (stream_id, device_index, device_type)


def stream_ids(stream: torch.cuda.Stream) -> StreamIds:
    return stream.stream_id, stream.device_index, stream.device_type


def enter_stream(ids: StreamIds) -> StreamIds:
    """Make the stream of ``ids`` (and its device) current on this thread; returns the ids of
    the stream current before on the device current before, for ``leave_stream`` to make
    both current again (as ``torch.cuda.set_stream`` would). torch's ``current_stream`` and
    ``set_stream`` make a Stream object a call and look the device up: those took ~6% of a
    B=64 socket step's engine GIL time (py-spy, H200)."""
    previous = torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice())
    torch._C._cuda_setStream(stream_id=ids[0], device_index=ids[1], device_type=ids[2])
    return previous  # type: ignore[no-any-return]


def leave_stream(previous: StreamIds) -> None:
    torch._C._cuda_setStream(stream_id=previous[0], device_index=previous[1],
                             device_type=previous[2])
