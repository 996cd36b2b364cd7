"""Compile the Triton kernels ahead of traffic.

Triton compiles one binary per (dtype, head dim, causal, return_lse, config) on first use, which
takes about a second each; a server calls ``warmup`` before it reports SERVING so no request pays
that. Binaries also land in Triton's on-disk cache (``TRITON_CACHE_DIR``), so a restart with a
persistent cache only loads them. Compiles run in parallel worker processes first
(``compile_in_workers``), as they are CPU work.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from triton import knobs

from attention_kernels._launch import kv_tile
from attention_kernels.configs import (
    MANY_PROGRAMS_TILE,
    ONE_SPLIT_TILE,
    SHORT_PAGED_SPLIT_TILE,
    TWO_WARP_TILE,
    interpreting,
    many_programs,
    num_sms,
    paged_decode_config,
)
from attention_kernels.decode_kernel import (
    PAGE_SPAN,
    _hopper,
    _merge_mode,
    decode,
    fast_dram,
    fast_dram_rule,
    for_cuda_graphs,
    paged_decode,
)
from attention_kernels.decode_span import span_heads
from attention_kernels.prefill_kernel import (
    _GLUON_HEAD_DIMS,
    _TMA_HEAD_DIMS,
    _gluon_ok,
    _gluon_padding,
    _padded_gluon_dim,
    _tma_ok,
    paged_prefill,
    prefill,
)

# Compiling is CPU work (Triton's passes, then ptxas), 1-4 s per variant, and the default
# warm-up compiles ~280 of them (on sm_90 ~20 more since: FP8 K/V on the Gluon kernel; timed
# below). So ``warmup`` first runs its calls in worker processes that share the on-disk cache,
# each taking the next call not yet taken, then runs them all itself, which then only loads
# binaries. H100 host, 16 vCPUs, bf16 + fp16, D 64 + 128, 16-token pages
# (benchmarks/bench_warmup.py, 2026-11-24): 419 s in-process (258 s on another host), 75-89 s
# with 8 workers, 52 s with 12, 46 s with 16; a restart on the filled cache 1.8 s. With the
# Gluon prefill's and FP8's variants (2026-11-24j, call 3): 76 s with 16 workers (worker RSS
# ~1 GB), 2.4 s on the filled cache; attention-server 90 s to SERVING cold, 9.4 s warm.
# ``ATTENTION_KERNELS_WARMUP_WORKERS`` (or ``workers=``) sets how many; 1 compiles in-process.
WORKERS_ENV = "ATTENTION_KERNELS_WARMUP_WORKERS"
MAX_DEFAULT_WORKERS = 16
# A worker still running after this long is stopped; the in-process pass compiles what it left.
WORKER_TIMEOUT_S = 1200.0

log = logging.getLogger("attention_kernels")


@dataclass(frozen=True)
class WarmupSpec:
    """What ``warmup`` compiles: picklable, so worker processes rebuild the same calls."""

    head_dims: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    device: str
    with_lse: bool
    page_tokens: tuple[int, ...]


def warmup(
    head_dims: Iterable[int] = (64, 128),
    dtypes: Iterable[torch.dtype] = (torch.bfloat16, torch.float16),
    device: str | torch.device = "cuda",
    *,
    with_lse: bool = True,
    page_tokens: Iterable[int] = (),
    workers: int | None = None,
) -> float:
    """Run every kernel variant once on tiny inputs; returns the seconds it took.

    ``page_tokens``: also the paged variants for these page sizes (one compile each, as the
    page size is a compile-time constant of the paged kernels). ``workers``: processes that
    compile first, in parallel, into Triton's on-disk cache (``default_workers``: from
    ``ATTENTION_KERNELS_WARMUP_WORKERS``, else one per CPU up to 16 on a GPU, else 1)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # workers must take the same one
        device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    spec = WarmupSpec(tuple(head_dims), tuple(dtypes), str(device), with_lse,
                      tuple(page_tokens))
    calls = warmup_calls(spec)
    n = default_workers(device) if workers is None else workers
    if n < 1:
        raise ValueError(f"warmup workers must be >= 1, got {n}")
    if n > 1 and not _cache_is_warm(calls):
        compile_in_workers(spec, len(calls), n)
    for call in calls:
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def default_workers(device: torch.device) -> int:
    """``ATTENTION_KERNELS_WARMUP_WORKERS`` when set, else one per usable CPU (at most
    ``MAX_DEFAULT_WORKERS``) for a GPU; 1 where nothing compiles (the interpreter, the CPU)."""
    raw = os.environ.get(WORKERS_ENV, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{WORKERS_ENV} must be an integer >= 1, got {raw!r}")
        return n
    if device.type != "cuda" or interpreting():
        return 1
    return max(1, min(MAX_DEFAULT_WORKERS, len(os.sched_getaffinity(0))))


def _cache_files() -> int:
    """Files in Triton's on-disk cache (-1 when it cannot be listed)."""
    try:
        return sum(len(files) for _, _, files in os.walk(knobs.cache.dir))
    except OSError:
        return -1


def _cache_is_warm(calls: list[Callable[[], object]]) -> bool:
    """Whether the first, middle and last calls (a prefill, a decode, a decode for graphs: both
    kernel files' variants) found their binaries without compiling: then the cache holds the
    rest too (a restart), and starting workers would only cost ~10 s and their memory. A cache
    half filled by another version of one kernel file would compile its rest in-process."""
    if not calls:
        return True
    before = _cache_files()
    for call in {id(c): c for c in (calls[0], calls[len(calls) // 2], calls[-1])}.values():
        call()
    return before > 0 and _cache_files() == before


def compile_in_workers(spec: WarmupSpec, total: int, workers: int) -> None:
    """Run ``warmup_calls(spec)`` across ``workers`` spawned processes, each taking the next
    call index not yet taken, so their compiles land in the shared on-disk cache. Best effort:
    a worker that fails or cannot start costs nothing but time (the in-process pass that
    follows compiles whatever is missing), and one still running after ``WORKER_TIMEOUT_S``
    is stopped."""
    ctx = mp.get_context("spawn")  # a forked CUDA context is unusable
    taken = ctx.Value("i", 0)
    procs = []
    try:
        for _ in range(min(workers, total)):
            proc = ctx.Process(target=_worker, args=(spec, taken, total), daemon=True)
            proc.start()
            procs.append(proc)
    except (AssertionError, OSError) as exc:  # e.g. a daemonic process may not have children
        log.warning("warm-up workers not started (%s): compiling in this process", exc)
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            log.warning("warm-up worker %s still running after %.0f s: stopped", proc.pid,
                        WORKER_TIMEOUT_S)
            proc.terminate()
            proc.join()
        elif proc.exitcode != 0:
            log.warning("warm-up worker %s exited with %s", proc.pid, proc.exitcode)


def _worker(spec: WarmupSpec, taken: Any, total: int) -> None:
    device = torch.device(spec.device)
    if device.type == "cuda" and device.index is not None:  # else the default, as the parent's
        torch.cuda.set_device(device)
    calls = warmup_calls(spec)
    if len(calls) != total:  # another build than the parent's: indices would not match
        raise RuntimeError(f"warm-up worker built {len(calls)} calls, the parent {total}")
    while True:
        with taken.get_lock():
            i = taken.value
            taken.value = i + 1
        if i >= total:
            break
        calls[i]()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warmup_calls(spec: WarmupSpec) -> list[Callable[[], object]]:
    """The calls ``warmup`` makes, in order, inputs allocated now (tiny, but for the long
    prompts that take the descriptor loads: 16 MB each)."""
    device = torch.device(spec.device)
    calls: list[Callable[[], object]] = []
    lse_flags = (False, True) if spec.with_lse else (False,)
    merges: list[Callable[[], object]] = []  # split decodes, again for CUDA graphs at the end
    for dtype in spec.dtypes:
        for d in spec.head_dims:
            # 2 query heads per kv head and two sequences: a realistic specialisation of strides.
            q = torch.randn(40, 4, d, dtype=dtype, device=device)
            kv = torch.randn(40, 2, d, dtype=dtype, device=device)
            cu = torch.tensor([0, 17, 40], dtype=torch.int32, device=device)
            calls += _prefill_variants(q, kv, cu, lse_flags)
            qd = torch.randn(2, 4, d, dtype=dtype, device=device)
            for lse in lse_flags:  # one split: the kernel writes the output directly
                calls.append(functools.partial(decode, qd, kv, kv, cu, num_splits=1,
                                               return_lse=lse))
            splits = functools.partial(_split_decodes, d, dtype, device, lse_flags, merges)
            calls += splits(decode, kv, kv, cu)
            calls += _span_decodes(d, dtype, device, lse_flags, merges)
            calls += _fast_dram_decodes(d, dtype, device, lse_flags, merges)
            rule = d == 128 and device.type == "cuda"  # decode_shape_config's other tiles
            if rule:
                for lse in lse_flags:  # one split writes directly: one variant for any group
                    for tile in (ONE_SPLIT_TILE, MANY_PROGRAMS_TILE, TWO_WARP_TILE):
                        calls.append(functools.partial(decode, qd, kv, kv, cu, num_splits=1,
                                                       return_lse=lse, _config=tile))
            # Key blocks of the paged decode tiles (a page span needs pages smaller).
            blocks = [paged_decode_config(d, dtype, device).block_n]
            if rule:
                blocks.append(ONE_SPLIT_TILE.block_n)
            for p in spec.page_tokens:
                pages = torch.randn(2 * -(-23 // p), p, 2, d, dtype=dtype, device=device)
                lens = torch.tensor([17, 23], dtype=torch.int32, device=device)
                table = torch.arange(pages.shape[0], dtype=torch.int32, device=device)
                table = table.view(2, -1)
                for causal in (False, True):
                    for lse in lse_flags:
                        calls.append(functools.partial(
                            paged_prefill, q, pages, pages, table, cu, lens, causal=causal,
                            return_lse=lse))
                tables = [table]
                if p < max(blocks):
                    # Pages smaller than a key block: tables too wide for one page span per
                    # split take per-block lookups, a variant of their own
                    # (decode_kernel.PAGE_SPAN); page 0 stands in for every entry.
                    tables.append(torch.zeros(2, 2 * PAGE_SPAN + 2, dtype=torch.int32,
                                              device=device))
                for t in tables:
                    for lse in lse_flags:
                        calls.append(functools.partial(paged_decode, qd, pages, pages, t, lens,
                                                       num_splits=1, return_lse=lse))
                        if rule:  # the one-split rules' tiles (decode_shape_config)
                            tiles = [ONE_SPLIT_TILE, TWO_WARP_TILE]
                            if p < ONE_SPLIT_TILE.block_n:
                                tiles.append(MANY_PROGRAMS_TILE)
                            for tile in tiles:
                                calls.append(functools.partial(
                                    paged_decode, qd, pages, pages, t, lens, num_splits=1,
                                    return_lse=lse, _config=tile))
                    # The tile named: these splits are short, and on Hopper short paged
                    # splits take the short-split tiles (decode_shape_config), compiled next.
                    calls += splits(paged_decode, pages, pages, t, lens,
                                    _config=paged_decode_config(d, dtype, device))
                    if rule:
                        for tile in (MANY_PROGRAMS_TILE, SHORT_PAGED_SPLIT_TILE):
                            calls += splits(paged_decode, pages, pages, t, lens, _config=tile)
    if device.type == "cuda":
        # The variants CUDA-graph callers take (``for_cuda_graphs``: on Hopper the split
        # decode's PDL merge kernel), compiled by eager calls; none where they are the eager
        # ones.
        calls += [functools.partial(_for_graphs, call, device) for call in merges]
    return calls


def _for_graphs(call: Callable[[], object], device: torch.device) -> None:
    with for_cuda_graphs():
        if _merge_mode(device) != "fused":
            call()


def _prefill_variants(q: torch.Tensor, kv: torch.Tensor, cu: torch.Tensor,
                      lse_flags: tuple[bool, ...]) -> list[Callable[[], object]]:
    """The calls of ``prefill``'s variants for ``q``'s dtype and head dim: the tiles of
    launches of few and of many programs (``configs.many_programs``), each with and without a
    short ``max_seqlen_q`` hint, and on Hopper at the head dims that take them the descriptor
    (TMA) loads and the Gluon kernel, which only launches with enough work take
    (``_TMA_MIN_WORK``), the Gluon kernel with FP8 K/V too, and at D 40-127 the Gluon kernel
    at its padded dim (``_padded_gluon_dim``: builds of its own per head dim, as it stores
    only ``out``'s columns). Without these the first long prompt or first big batch compiled
    them (~1-2 s each)."""
    d = q.shape[2]
    inputs = [(q, kv, cu)]
    fp8_calls: list[Callable[[], object]] = []
    if q.is_cuda and not interpreting():  # the interpreter has one tile, and no TMA
        # One query per sequence, many heads: the fewest bytes that make a many-program launch.
        one = torch.tensor([0, 1], dtype=torch.int32, device=q.device)
        inputs.append((torch.randn(1, _many_heads(1, q.device), d, dtype=q.dtype,
                                   device=q.device), kv[:1], one))
        big_dims = _TMA_HEAD_DIMS + _GLUON_HEAD_DIMS  # descriptors / the Gluon kernel
        padded = _gluon_padding(d)
        if d in big_dims or padded:
            n = 4096  # n * n * 16 heads = _TMA_MIN_WORK
            big_kv = torch.randn(n, 2, d, dtype=q.dtype, device=q.device)
            big_cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)
            head_counts = {16, _many_heads(n, q.device)}
            if padded and 18 * d % 16:
                # A padded launch stores into out's own rows, and Triton builds apart for a
                # token stride (H * D) that is a multiple of 16 and one that is not (D 59 at
                # 8 heads): 18 heads make the other.
                head_counts.add(18)
            for heads in head_counts:
                big_q = torch.randn(n, heads, d, dtype=q.dtype, device=q.device)
                if (_tma_ok(big_q, big_kv, big_kv, head_dims=big_dims)
                        or _padded_gluon_dim(big_q, big_kv, big_kv, True, False, 1)):
                    inputs.append((big_q, big_kv, big_cu))
                    k8 = big_kv.to(torch.float8_e4m3fn)
                    if _gluon_ok(big_q, k8, k8, True, False, 1):  # FP8 K/V, widened for it
                        ones = torch.ones(2, dtype=torch.float32, device=q.device)
                        fp8_calls += [functools.partial(
                            prefill, big_q, k8, k8, big_cu, causal=causal, return_lse=lse,
                            k_scale=ones, v_scale=ones)
                            for causal in (False, True) for lse in lse_flags]
    return [functools.partial(prefill, q_in, kv_in, kv_in, cu_in, causal=causal,
                              return_lse=lse, max_seqlen_q=hint)
            for q_in, kv_in, cu_in in inputs for causal in (False, True) for lse in lse_flags
            for hint in (None, 23)] + fp8_calls


def _many_heads(total_q: int, device: torch.device) -> int:
    """The least even head count, at least 16 (two kv heads divide it), that makes one
    sequence of ``total_q`` queries a launch of many programs on ``device``."""
    heads = 16
    while not many_programs(total_q, 1, heads, device):
        heads += 2
    return heads


def _span_decodes(d: int, dtype: torch.dtype, device: torch.device,
                  lse_flags: tuple[bool, ...],
                  merges: list[Callable[[], object]]) -> list[Callable[[], object]]:
    """``decode``'s span route (``decode_span``) where its rule takes head dim ``d`` on this
    device: 4 kv heads (a span's heads at D > 64 whatever the count above), each common group,
    split (again for CUDA graphs) and direct (more sequences than SMs). The rule and the split
    count read only the ``max_seqlen_k`` hint, so the calls name a long one over a few keys."""
    kv = torch.randn(40, 4, d, dtype=dtype, device=device)
    hint = 1 << 16
    probe = torch.empty(1, 4, d, dtype=dtype, device=device)
    hg = span_heads(probe, kv, kv, hint, _hopper(device))
    if not hg:
        return []
    sms = num_sms(device.index or 0) if device.type == "cuda" else 8
    batch = sms // (4 // hg) + 1  # one split each
    cu = torch.full((batch + 1,), 40, dtype=torch.int32, device=device)
    cu[:2] = torch.tensor([0, 17])
    calls: list[Callable[[], object]] = []
    for group in (1, 2, 4, 8):
        for lse in lse_flags:
            q = torch.randn(2, 4 * group, d, dtype=dtype, device=device)
            split = functools.partial(decode, q, kv, kv, cu[:3], max_seqlen_k=hint,
                                      return_lse=lse)
            merges.append(split)
            q = torch.randn(batch, 4 * group, d, dtype=dtype, device=device)
            calls += [split, functools.partial(decode, q, kv, kv, cu, max_seqlen_k=hint,
                                               return_lse=lse)]
    return calls


def _fast_dram_decodes(d: int, dtype: torch.dtype, device: torch.device,
                       lse_flags: tuple[bool, ...],
                       merges: list[Callable[[], object]]) -> list[Callable[[], object]]:
    """On a GPU of fast DRAM (``decode_kernel.fast_dram``), ``configs.fast_dram_decode``'s
    tiles at head dim ``d``, direct and split, named as configs so the plans make the rule's
    variants. Layouts of 2, 8 and 16 packed kv heads: rows skewed where 8 heads' rows are whole
    16-byte pieces but one head's are not (D 111), and token strides of both divisibilities
    by 16 (Triton specializes on it: D 111 at 8 heads 888, at 16 1776). Direct calls at groups
    1 and 2 for the same reason (q's token stride); splits at groups 1, 2, 4 and 8 (a merge
    variant each)."""
    if dtype not in (torch.float16, torch.bfloat16) or not fast_dram(device):
        return []
    calls: list[Callable[[], object]] = []
    seen: set[tuple[int, int, bool]] = set()
    cu = torch.tensor([0, 17, 40], dtype=torch.int32, device=device)
    for heads in (2, 8, 16):
        kv = torch.randn(40, heads, d, dtype=dtype, device=device)
        strides = (*kv.stride()[:2], *kv.stride()[:2], None, None, None)
        block_d, shift = kv_tile(kv, kv, strides, d)
        rule = fast_dram_rule(kv, kv, strides, d, block_d, shift, 1, 1, 1)
        layout = (block_d, shift, kv.stride(0) % 16 == 0)
        if rule is None or layout in seen:
            continue
        seen.add(layout)
        tile = rule[0]
        for group in (1, 2, 4, 8):
            for lse in lse_flags:
                q = torch.randn(2, heads * group, d, dtype=dtype, device=device)
                if group <= 2:
                    calls.append(functools.partial(decode, q, kv, kv, cu, num_splits=1,
                                                   return_lse=lse, _config=tile))
                split = functools.partial(decode, q, kv, kv, cu, num_splits=2, return_lse=lse,
                                          _config=tile)
                calls.append(split)
                merges.append(split)
    return calls


def _split_decodes(d: int, dtype: torch.dtype, device: torch.device,
                   lse_flags: tuple[bool, ...], merges: list[Callable[[], object]],
                   fn: Callable[..., object], *args: object,
                   **kwargs: object) -> list[Callable[[], object]]:
    """The calls ``fn(q, *args, num_splits=2, return_lse=..., **kwargs)`` (two sequences) for
    the common GQA ratios (the merge has one tile row per query head of a group: a variant per
    ratio) and lse flags; also added to ``merges``, to run again for CUDA graphs."""
    calls: list[Callable[[], object]] = []
    for group in (1, 2, 4, 8):
        qg = torch.randn(2, 2 * group, d, dtype=dtype, device=device)
        for lse in lse_flags:
            calls.append(functools.partial(fn, qg, *args, num_splits=2, return_lse=lse,
                                           **kwargs))
    merges += calls
    return calls
