"""Tiny launches that compile and exercise the serving paths before traffic arrives."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from typing import NoReturn, Protocol

import torch

from attention_service.engine.dtypes import WIRE_DTYPES
from attention_service.engine.jobs import BatchPlan, Job, PendingLaunch
from attention_service.engine.kv_caches import CacheRegistry
from attention_service.engine.kv_pool import SERVER_OWNER_PREFIX
from attention_service.errors import RequestError
from attention_service.params import Op, kv_dtype_allowed, make_params
from attention_wire.pb import attention_pb2 as pb

log = logging.getLogger("attention_service")
# No token can be this: caches of its own namespace, outside the per-caller quota.
_WARMUP_OWNER = SERVER_OWNER_PREFIX + "warmup"


class WarmupBackend(Protocol):
    """What the warm-up uses of a backend (``backends.Backend`` has it): declared here, since
    the backends import this module for their own warm-up."""

    def alloc_host(self, nbytes: int) -> torch.Tensor: ...
    def launch(self, plan: BatchPlan) -> PendingLaunch: ...


def exit_during_warmup(rc: int) -> NoReturn:
    """End the process now, everything but the warm-up closed: a signal came while the
    warm-up thread is inside Triton or CUDA. Finalizing the interpreter under that thread
    aborted the process group ("terminate called without an active exception"), and
    ``asyncio.run`` would first wait for it (a cold warm-up: ~60 s on an H100, 2026-11-25)."""
    log.info("warm-up cut short by the shutdown")
    logging.shutdown()
    os._exit(rc)


def tiny_job(
    backend: WarmupBackend, op: Op, dtype: torch.dtype, seed: int = 0,
    cache_ids: tuple[str, ...] = (), fp8: bool = False,
) -> Job:
    """Two short sequences, two heads over one kv head, head_dim 64, with lse (a cached op:
    on ``cache_ids``, its k/v the new tokens). ``fp8``: k/v in float8_e4m3fn (a stateless
    op with unit scales; a cached op's caches must be FP8)."""
    g = torch.Generator().manual_seed(seed)
    if cache_ids:  # one sequence per cache
        cu_k = (0, 2)
        rows, cu_q = (1, None) if op.decode_like else (2, (0, 2))
    else:
        cu_k = (0, 2, 4)
        rows, cu_q = (2, None) if op.decode_like else (4, (0, 2, 4))
    if not op.queries:  # AppendKV
        rows, cu_q = 0, (0, 0)
    kv_dtype = torch.float8_e4m3fn if fp8 else dtype
    params = make_params(
        op, WIRE_DTYPES[dtype if op.queries else kv_dtype],
        (rows, 2 if rows else 1, 64), (cu_k[-1], 1, 64), cu_k, cu_q,
        causal=not op.decode_like, return_lse=op.queries, cache_ids=cache_ids,
        store=True, kv_dtype=WIRE_DTYPES[kv_dtype],
        kv_scales=((1.0,), (1.0,)) if fp8 and not cache_ids else None,
    )

    def host(t: torch.Tensor) -> torch.Tensor:
        buf = backend.alloc_host(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
        return buf.copy_(t)

    q = host(torch.randn(params.q_shape, generator=g).to(dtype))
    k = host(torch.randn(params.k_shape, generator=g).to(kv_dtype))
    v = host(torch.randn(params.k_shape, generator=g).to(kv_dtype))
    out = host(torch.empty(params.q_shape, dtype=dtype))
    lse = host(torch.empty(params.lse_shape or (0,), dtype=torch.float32))
    return Job(params, q, k, v, out, lse)


def tiny_plans(backend: WarmupBackend, dtypes: Iterable[torch.dtype]) -> Iterator[BatchPlan]:
    """Per dtype (and FP8 k/v beside bf16/fp16) and stateless op: one job alone, then two
    merged (the batched path)."""
    for dtype, fp8 in _variants(dtypes):
        for op in (Op.PREFILL, Op.DECODE):
            yield BatchPlan([tiny_job(backend, op, dtype, fp8=fp8)])
            yield BatchPlan([tiny_job(backend, op, dtype, 1, fp8=fp8),
                             tiny_job(backend, op, dtype, 2, fp8=fp8)])


def _variants(dtypes: Iterable[torch.dtype]) -> list[tuple[torch.dtype, bool]]:
    """Each dtype, then FP8 k/v beside those that take them (separate compilations)."""
    dtypes = list(dtypes)
    return [(d, False) for d in dtypes] + [
        (d, True) for d in dtypes if kv_dtype_allowed(WIRE_DTYPES[d], pb.FLOAT8_E4M3)]


def warm_caches(backend: WarmupBackend, caches: CacheRegistry,
                dtypes: Iterable[torch.dtype]) -> None:
    """Compile and run the paged paths (store, paged prefill, paged decode; alone and merged)
    on two caches of a private owner, released afterwards. Only AppendKV keeps its tokens, so
    a pool of 2 pages is enough; a smaller one skips this (and says so)."""
    if not caches.enabled:
        return
    for dtype, fp8 in _variants(dtypes):
        ids = ("a", "b")
        layout = pb.CacheLayout(dtype=WIRE_DTYPES[dtype], num_kv_heads=1, head_dim=64)
        if fp8:
            layout.kv_dtype = pb.FLOAT8_E4M3
            layout.kv_scales.CopyFrom(pb.KvScales(k=[1.0], v=[1.0]))
        try:  # a page too small for this layout refuses it here (--kv-page-bytes)
            caches.call("CreateCaches", pb.CreateCachesRequest(cache_ids=ids, layout=layout),
                        _WARMUP_OWNER)
        except RequestError as exc:
            log.warning("kv cache warmup skipped: %s", exc.details)
            return
        try:
            for op in (Op.APPEND_KV, Op.CACHE_PREFILL, Op.CACHE_DECODE):
                jobs = [tiny_job(backend, op, dtype, i, ids[i : i + 1], fp8) for i in (0, 1)]
                for group in ([jobs[0]], jobs):
                    begun = []  # finished however the group ends, or a busy cache leaks
                    try:
                        for j in group:
                            j.cache = caches.begin(j.params, _WARMUP_OWNER)
                            begun.append(j.cache)
                        backend.launch(BatchPlan(group)).wait()
                    finally:
                        for work in begun:
                            work.finish(not op.queries)  # only AppendKV keeps its tokens
        except RequestError as exc:  # a pool too small for even this
            log.warning("kv cache warmup skipped: %s", exc.details)
            return
        finally:
            caches.call("ReleaseCaches", pb.ReleaseCachesRequest(all=True), _WARMUP_OWNER)
