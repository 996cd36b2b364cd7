"""The engine's leaf types: a Job (params + tensors + cancelled flag), its KV-cache work, the
BatchPlan that packs jobs of one key into a launch, launch timings, Cancelled, and the
PendingLaunch handles the backends return."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from attention_service.errors import Cancelled
from attention_service.link import ExecStats
from attention_service.params import BatchKey, KvScales, Params, key_fp8, key_with_fp8
from attention_wire.pb import attention_pb2 as pb

__all__ = [
    "BatchPlan", "CacheWork", "Cancelled", "Done", "DoneLaunch", "ExecStats", "Job",
    "LaunchTimes", "PendingLaunch", "batch_key",
]

# Called exactly once per submitted job, with its stats or the exception that ended it.
Done = Callable[[ExecStats | BaseException], None]


@dataclass(eq=False)
class CacheWork:
    """What a cached op (AppendKV / CachePrefill / CacheDecode) does to the KV pool, fixed when
    the engine accepts it (``kv_caches.CacheRegistry.begin``): the pages of its sequences, with
    room for the new tokens already reserved, and where each new token goes."""

    k_pages: torch.Tensor  # [pages, page_tokens, H_kv, D] view of the pool (this layout)
    v_pages: torch.Tensor
    # Per sequence: its pages, in key order; a decode step's, the pages before ``new_pages``.
    block_table: list[list[int]]
    seq_lens: list[int]  # per sequence: keys after the new tokens (cached + new)
    slot_pages: list[int]  # per new token, in k's packed order: its page ...
    slot_offsets: list[int]  # ... and its row inside that page
    flops: int  # the real work (the params count only the new tokens)
    kv_bytes: int  # key/value bytes the kernel reads
    # Called once with whether the op succeeded: keeps (store) or drops the new tokens, frees
    # the caches for the next call; returns each cache's length afterwards.
    finish: Callable[[bool], tuple[int, ...]]
    # FP8 caches: each sequence's cache's scales (the pool pages are e4m3); None otherwise.
    seq_scales: list[KvScales] | None = None
    # A decode step's: per sequence, the one page it starts past its ``block_table`` row (-1:
    # none); the rows are then the caches' own page lists, the same objects step after step
    # while the caches keep their pages, so neither ``begin`` copies them (64 rows of 129
    # pages: ~66 us of the reader's GIL time a step, py-spy, H200 host) nor a staging rewrites
    # them (``decode_steps``). None: the rows are whole.
    new_pages: list[int] | None = None
    # Counted once by ``begin``, which has the lists at hand (-1: counted here): the keys in
    # all (``sum(seq_lens)``, which the job's weight, tokens and plan each took again) and
    # the block table's columns (its longest row with ``new_pages``: a plan's scan of 64 rows
    # took ~10 us of a B=64 step, py-spy, modelled GPU).
    keys: int = -1
    width: int = -1

    def __post_init__(self) -> None:
        if self.keys < 0:
            self.keys = sum(self.seq_lens)
        if self.width < 0:
            self.width = max(map(len, self.rows()), default=0)

    def rows(self) -> list[list[int]]:
        """Each sequence's whole page list (a copy per row that gains a page; the others are
        the caches' own lists: never change them in place)."""
        if self.new_pages is None:
            return self.block_table
        return [r if p < 0 else [*r, p]
                for r, p in zip(self.block_table, self.new_pages, strict=True)]


# Where a tensor's bytes are, for a typed view made on first use: (base, byte offset, dtype,
# shape). The engine's step path makes none (``decode_steps.places`` reads the spans'
# addresses): every torch call releases and retakes the GIL, and on the engine's reader thread,
# against the dispatcher and completer, four views a request took a fifth of its GIL time
# (py-spy, H100 host, 64 decode sessions).
LazyTensor = tuple["ByteBase", int, torch.dtype, tuple[int, ...]]


class Job:
    """One request inside the engine: its params, its input tensors (host, usually pinned, or
    device for CUDA regions) and the destinations its outputs are written to. Tensors are
    given, or made from ``spans`` when first asked for. Once submitted (``queued``) it also
    carries where its result goes and what the batch queue sorts and weighs it by. (A slots
    class: one is made per request on the engine's hot path.)"""

    __slots__ = ("params", "cache", "cancelled", "submitted_at", "_tensors", "_spans", "done",
                 "key", "weight")

    def __init__(
        self, params: Params, q: torch.Tensor | None = None, k: torch.Tensor | None = None,
        v: torch.Tensor | None = None, out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,  # None unless params.return_lse
        cache: CacheWork | None = None,  # cached ops only
        *, spans: dict[str, LazyTensor] | None = None,
    ) -> None:
        self.params = params
        self.cache = cache
        # Set when the call is cancelled or its deadline passes: compute stops where it can.
        # A bare attribute: nobody waits on it (a ``threading.Event`` built a Condition and a
        # lock per job, ~3 us of the engine's GIL time per request, measured).
        self.cancelled = False
        self.submitted_at = 0.0  # perf_counter when handed to the executor
        self._tensors: dict[str, torch.Tensor | None] = {
            "q": q, "k": k, "v": v, "out": out, "lse": lse}
        self._spans = spans or {}

    def queued(self, done: Done) -> Job:
        """Ready for the batch queue: ``done`` gets its result; its batch key and its weight
        against the token budget are looked up once, here."""
        self.done = done
        self.key: BatchKey = batch_key(self)
        self.weight: int = self.budget_tokens
        return self

    def tensor(self, name: str) -> torch.Tensor | None:
        t = self._tensors[name]
        if t is None and name in self._spans:
            base, offset, dtype, shape = self._spans[name]
            t = self._tensors[name] = base.view(offset, dtype, shape)
        return t

    def set_tensor(self, name: str, t: torch.Tensor | None) -> None:
        self._tensors[name] = t
        self._spans.pop(name, None)

    q = property(lambda self: self.tensor("q"), lambda self, t: self.set_tensor("q", t))
    k = property(lambda self: self.tensor("k"), lambda self, t: self.set_tensor("k", t))
    v = property(lambda self: self.tensor("v"), lambda self, t: self.set_tensor("v", t))
    out = property(lambda self: self.tensor("out"), lambda self, t: self.set_tensor("out", t))
    lse = property(lambda self: self.tensor("lse"), lambda self, t: self.set_tensor("lse", t))

    def span(self, name: str) -> LazyTensor | None:
        """Where tensor ``name``'s bytes are, when it was given as a span (a view made of it
        since keeps the span: the same bytes); None when it was given as a tensor, or
        replaced by one (``set_tensor``)."""
        return self._spans.get(name)

    @property
    def flops(self) -> int:
        return self.cache.flops if self.cache is not None else self.params.flops

    @property
    def kv_bytes(self) -> int:
        return self.cache.kv_bytes if self.cache is not None else self.params.kv_bytes

    @property
    def tokens(self) -> int:
        """The batch-token unit (queries for prefill, keys for decode, cached keys included)."""
        if self.cache is not None and self.params.op.decode_like:
            return self.cache.keys
        return self.params.tokens

    @property
    def budget_tokens(self) -> int:
        """Weight against the batching token budget (cached keys included).

        A cached decode step's keys weigh ``1 / CACHED_KEYS_PER_TOKEN`` of a token each: they
        are read in place from the pool, nothing is packed or copied for them, so a launch of
        many steps costs the GPU little more than one (H100, 8 x 128 bf16: 64 sequences of
        8K cached keys decode in about 0.3 ms). Counted as plain keys, the default budget let
        only 3 steps of 4K-token caches share a launch, and batching bought 1.6x at 64 clients.
        """
        if self.cache is None:
            return self.params.budget_tokens
        keys = self.cache.keys
        if self.params.op.decode_like:
            return max(self.params.rows, -(-keys // CACHED_KEYS_PER_TOKEN))
        return max(self.params.rows, keys)


def batch_key(job: Job) -> BatchKey:
    """The key ``job`` batches under: its params' own, with FP8 set when its caches are FP8
    (only the engine knows a cache's dtype; that twin is made once per params object)."""
    key = job.params.key
    if key_fp8(key) or job.cache is None or job.cache.seq_scales is None:
        return key
    memo = job.params.memo
    fp8 = memo.get(batch_key)
    if fp8 is None:
        fp8 = memo[batch_key] = key_with_fp8(key)
    return fp8  # type: ignore[return-value]


# With the default 16384-token budget: about 1M cached keys per launch (e.g. 256 steps of
# 4K-token caches), a few milliseconds of GPU time at most.
CACHED_KEYS_PER_TOKEN = 64


@dataclass(frozen=True)
class LaunchTimes:
    h2d_seconds: float = 0.0
    kernel_seconds: float = 0.0
    d2h_seconds: float = 0.0


class PendingLaunch(Protocol):
    """An issued launch; ``wait`` blocks until every output is in its job's destination."""

    def wait(self) -> LaunchTimes: ...


class DoneLaunch:
    """A launch that finished while it was issued (cpu backend, batches without keys)."""

    def __init__(self, times: LaunchTimes) -> None:
        self._times = times

    def wait(self) -> LaunchTimes:
        return self._times


@functools.lru_cache(maxsize=4096)
def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Contiguous strides of ``shape`` (requests repeat a few shapes: cached)."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(strides[::-1])


# Host memory page-locked for the GPU (``regions.pin``): start address -> byte count. A
# device under unified addressing reads and writes it at these addresses (when
# ``attention_kernels.copy_segments.can_use_host_pointers``), so one kernel can pack a batch
# straight out of it.
PINNED: dict[int, int] = {}


class ByteBase:
    """A block of bytes (an arena, a region, a segment) that hands out typed tensors at byte
    offsets with one ``as_strided`` each, from a typed view per dtype made once. (A slice plus
    two views per tensor cost about a sixth of the engine's time per request: measured.)"""

    def __init__(self, u8: torch.Tensor, pinned: bool = False) -> None:
        """``pinned``: ``u8`` is page-locked host memory the device reads at its address
        (torch's pinned allocations: ``cudaHostAlloc``, mapped under unified addressing)."""
        self.u8 = u8
        self.nbytes = int(u8.numel())
        self._ptr = u8.data_ptr()
        self.on_device = u8.device.type == "cuda"
        self.pinned = pinned
        # Host memory: the same bytes through numpy, sliced without torch calls.
        self.np: np.ndarray | None = u8.numpy() if u8.device.type == "cpu" else None
        # Per dtype: the typed view of the whole block and its storage offset (in elements).
        self._typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}

    @property
    def ptr(self) -> int:
        return self._ptr

    @property
    def device_readable(self) -> bool:
        """Whether a kernel may take this block's addresses as they are: device memory, or
        host memory page-locked whole (its registration may end before the block goes)."""
        return self.on_device or self.pinned or PINNED.get(self._ptr, -1) >= self.nbytes

    def check_aligned(self, offset: int, dtype: torch.dtype) -> None:
        if (self._ptr + offset) % dtype.itemsize:
            raise ValueError(f"offset {offset} leaves {dtype} misaligned")

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """``shape`` of ``dtype`` at byte ``offset``; ValueError if misaligned for ``dtype``.
        The caller has checked that the bytes lie inside the block."""
        size = dtype.itemsize
        self.check_aligned(offset, dtype)
        got = self._typed.get(dtype)
        if got is None:
            typed = self.u8[: self.nbytes - self.nbytes % size].view(dtype)
            got = self._typed[dtype] = (typed, typed.storage_offset())
        return got[0].as_strided(shape, _strides(shape), got[1] + offset // size)


# Merging jobs into one packed varlen launch (pure host-side bookkeeping, no device work): jobs
# of one key (``batch_key`` above) share a launch; ``BatchPlan`` is their merged ``cu_seqlens``,
# row offsets and launch parameters.
def scale_rows(rows: Sequence[KvScales], device: object,
               repeats: Sequence[int] | None = None) -> tuple[object, object]:
    """FP8 scales per row (sequence) as float32 tensors for ``k`` and ``v``: ``[H_kv]`` when
    every row has the same (the kernels' shared form), else ``[rows, H_kv]``, or with
    ``repeats`` row i repeated ``repeats[i]`` times (per new token: done on the host in one
    call, not per token in Python). Made per launch and sent with ``upload``, so no buffer is
    shared between streams."""
    import torch

    first = rows[0]
    if all(r == first for r in rows):
        rows, repeats = [first], None
    host = torch.tensor([[k for k, _ in rows], [v for _, v in rows]], dtype=torch.float32)
    if repeats is not None:
        host = host.repeat_interleave(torch.tensor(repeats), dim=1)
    dev = upload(host, device)
    if len(rows) == 1:  # shared by every row (repeats dropped with the others)
        return dev[0, 0], dev[1, 0]
    return dev[0], dev[1]


def upload(host: Any, device: object) -> Any:
    """A launch's small host tensor (scales, slopes) on ``device``: on a GPU through pinned
    memory and an async copy on the current stream (the launch's), since a pageable copy
    would wait for the stream's earlier work; the launch holds the result."""
    if str(device) == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _offsets(sizes: Sequence[int]) -> list[int]:
    acc = [0]
    for n in sizes:
        acc.append(acc[-1] + n)
    return acc


def _merge_cu(cus: Sequence[Sequence[int]], starts: Sequence[int]) -> list[int]:
    """Concatenate per-job cu_seqlens, each shifted by where its tokens start."""
    merged = [0]
    for cu, start in zip(cus, starts, strict=False):
        merged += map(start.__add__, cu[1:])  # ~3x a generator's speed (7 x 64 steps)
    return merged


class BatchPlan:
    """One launch serving ``jobs`` (all with the same batch key), packed in their order.

    Job i owns query rows ``q_offsets[i]:q_offsets[i+1]`` (tokens for prefill, sequences for
    decode) and key rows ``k_offsets[i]:k_offsets[i+1]`` of the packed tensors.
    """

    def __init__(self, jobs: Sequence[Job], key: BatchKey | None = None) -> None:
        """``key``: the jobs' batch key when the caller knows it (the queue grouped them by
        it); otherwise every job's key is computed and must agree."""
        if not jobs:
            raise ValueError("a batch needs at least one job")
        self.jobs = list(jobs)
        if key is None:
            key = batch_key(self.jobs[0])
            if any(batch_key(j) != key for j in self.jobs[1:]):
                raise ValueError("jobs of different batch keys cannot share a launch")
        self.key = key
        params = [j.params for j in self.jobs]
        # The first job's params: the fields in the key (heads, dtypes, scale, window ...) are
        # every job's, so the launch reads them here.
        self.shared = params[0]
        self.fp8 = key_fp8(key)  # the jobs' FP8 k/v, or their FP8 caches
        self.op = self.shared.op
        self.q_offsets = _offsets([p.rows for p in params])
        self.k_offsets = _offsets([p.total_k for p in params])
        alone = len(params) == 1  # a lone job's lists serve as they are (read, never changed)
        self.cu_seqlens_k = (list(self.shared.cu_seqlens_k) if alone else
                             _merge_cu([p.cu_seqlens_k for p in params], self.k_offsets))
        self.cu_seqlens_q: list[int] | None = None
        if not self.op.decode_like:
            self.cu_seqlens_q = _merge_cu(
                [p.cu_seqlens_q for p in params], self.q_offsets  # type: ignore[misc]
            )
        self.max_seqlen_q = max(p.max_seqlen_q for p in params)
        self.max_seqlen_k = max(p.max_seqlen_k for p in params)
        # The kernel computes lse for everyone or no one; it costs little, so any asker wins.
        self.return_lse = any(p.return_lse for p in params)
        # ALiBi: [sequences, num_heads] slopes, row-major, each job's rows in its order (a
        # job that gave num_heads slopes has them repeated for each of its sequences).
        self.alibi_slopes: list[float] | None = None
        if self.shared.alibi_slopes:
            h = self.shared.num_heads
            self.alibi_slopes = []
            for p in params:
                seqs = len(p.cu_seqlens_k) - 1
                given = list(p.alibi_slopes)
                self.alibi_slopes += given if len(given) == seqs * h else given * seqs
        self.tokens = sum(j.tokens for j in self.jobs)
        self.flops = sum(j.flops for j in self.jobs)
        self.kv_bytes = sum(j.kv_bytes for j in self.jobs)
        # Cached ops: the sequences' pages and lengths, and where each new k/v row goes, in
        # the packed order (k's rows are the new tokens, packed like any k).
        self.block_table: list[list[int]] = []
        self.new_pages: list[int] | None = None  # ``CacheWork.new_pages``, merged
        self.seq_lens: list[int] = []
        self.slot_pages: list[int] = []
        self.slot_offsets: list[int] = []
        if self.op.cached and alone:
            work = self.jobs[0].cache
            assert work is not None, "a cached op's job carries its cache work"
            self.block_table, self.seq_lens = work.block_table, work.seq_lens
            self.slot_pages, self.slot_offsets = work.slot_pages, work.slot_offsets
            self.new_pages = work.new_pages
        elif self.op.cached:
            for j in self.jobs:
                work = j.cache
                assert work is not None, "a cached op's job carries its cache work"
                self.block_table += work.block_table
                self.seq_lens += work.seq_lens
                self.slot_pages += work.slot_pages
                self.slot_offsets += work.slot_offsets
            if any(j.cache.new_pages is not None for j in self.jobs):  # type: ignore[union-attr]
                self.new_pages = []
                for j in self.jobs:
                    work = j.cache
                    assert work is not None
                    self.new_pages += (work.new_pages if work.new_pages is not None
                                       else [-1] * len(work.block_table))
        # Block-table columns (at least one, so the table is never empty).
        self.table_width = 1
        if self.op.cached:
            self.max_seqlen_k = max(self.seq_lens, default=0)
            self.table_width = max(1, *(j.cache.width for j in self.jobs))  # type: ignore[union-attr]
        # FP8: every sequence's scales in launch order, and how many new k/v rows each
        # sequence brings (the rows a cached op's store quantizes with those scales).
        self.seq_scales: list[KvScales] = []
        self.seq_new_rows: list[int] = []
        if self.fp8:
            for j in self.jobs:
                lens = j.params.new_keys
                if j.cache is not None:
                    assert j.cache.seq_scales is not None
                    self.seq_scales += j.cache.seq_scales
                else:
                    self.seq_scales += j.params.sequence_scales
                self.seq_new_rows += lens

    def score_kwargs(self, device: object = "cpu") -> dict[str, object]:
        """The kernels' (and the reference's) window_size / softcap / alibi_slopes arguments;
        empty when the launch uses none, so plain launches pass nothing new."""
        import torch

        key, out = self.shared, {}
        if key.window != (-1, -1):
            out["window_size"] = key.window
        if key.softcap > 0:
            out["softcap"] = key.softcap
        if self.alibi_slopes is not None:
            slopes = torch.tensor(self.alibi_slopes, dtype=torch.float32)
            out["alibi_slopes"] = upload(slopes, device).view(-1, key.num_heads)
        return out

    def fp8_kwargs(self, device: object = "cpu") -> dict[str, object]:
        """The kernels' ``k_scale`` / ``v_scale`` of an FP8 launch (empty otherwise): ``[H_kv]``
        when every sequence has the same scales, else ``[batch, H_kv]``; and ``q_scale`` of
        FP8 queries."""
        if not self.fp8:
            return {}
        k, v = scale_rows(self.seq_scales, device)
        if self.shared.dtype != pb.FLOAT8_E4M3:
            return {"k_scale": k, "v_scale": v}
        # FP8 queries: their scales came folded into the keys' (``params.check_kv_scales``).
        return {"q_scale": k.new_ones(k.shape), "k_scale": k, "v_scale": v}  # type: ignore[attr-defined]

    def new_token_scales(self, device: object = "cpu") -> tuple[object, object]:
        """The scales each new k/v row is stored with (a cached FP8 batch): ``[H_kv]`` when
        all equal, else ``[rows, H_kv]`` in the packed rows' order."""
        return scale_rows(self.seq_scales, device, self.seq_new_rows)

    @property
    def total_q(self) -> int:
        return self.q_offsets[-1]

    @property
    def total_k(self) -> int:
        return self.k_offsets[-1]

    @property
    def lse_shape(self) -> tuple[int, int]:
        return self.op.lse_shape(self.total_q, self.shared.num_heads)

    @property
    def sees_no_keys(self) -> bool:
        """No query of the batch sees a key (cached ops: nothing cached and nothing new);
        the cpu and cuda launch paths then answer with ``fill_no_keys``, no kernel."""
        if self.op.cached:
            return self.max_seqlen_k == 0
        return self.total_k == 0

    def fill_no_keys(self) -> None:
        """No query sees a key: outputs are zeros and lse -inf."""
        for job in self.jobs:
            job.out.zero_()
            if job.lse is not None:
                job.lse.fill_(float("-inf"))

    def rows(self, i: int) -> tuple[int, int]:
        """Job i's query rows in the packed output."""
        return self.q_offsets[i], self.q_offsets[i + 1]

    def __len__(self) -> int:
        return len(self.jobs)

    def cancelled(self) -> bool:
        """Every job's caller has gone: compute may stop (the backends check between
        tiles); one job still waiting keeps the launch going for it."""
        return all(j.cancelled for j in self.jobs)
