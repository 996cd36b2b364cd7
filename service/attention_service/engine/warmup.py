"""Tiny launches that compile and exercise the serving paths before traffic arrives."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from attention_service.engine.backends import WIRE_DTYPES, Backend
from attention_service.engine.batch_plan import BatchPlan
from attention_service.engine.jobs import Job
from attention_service.params import Op, make_params


def tiny_job(backend: Backend, op: Op, dtype: torch.dtype, seed: int = 0) -> Job:
    """Two short sequences, two heads over one kv head, head_dim 64, with lse."""
    g = torch.Generator().manual_seed(seed)
    rows = 4 if op is Op.PREFILL else 2
    cu_q = (0, 2, 4) if op is Op.PREFILL else None
    params = make_params(
        op, WIRE_DTYPES[dtype], (rows, 2, 64), (4, 1, 64), (0, 2, 4), cu_q,
        causal=op is Op.PREFILL, return_lse=True,
    )

    def host(t: torch.Tensor) -> torch.Tensor:
        buf = backend.alloc_host(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
        return buf.copy_(t)

    q = host(torch.randn(params.q_shape, generator=g).to(dtype))
    k = host(torch.randn(params.k_shape, generator=g).to(dtype))
    v = host(torch.randn(params.k_shape, generator=g).to(dtype))
    out = host(torch.empty(params.q_shape, dtype=dtype))
    lse = host(torch.empty(params.lse_shape or (0,), dtype=torch.float32))
    return Job(params, q, k, v, out, lse)


def tiny_plans(backend: Backend, dtypes: Iterable[torch.dtype]) -> Iterator[BatchPlan]:
    """Per dtype and op: one job alone, then two merged (the batched path)."""
    for dtype in dtypes:
        for op in Op:
            yield BatchPlan([tiny_job(backend, op, dtype)])
            yield BatchPlan([tiny_job(backend, op, dtype, 1), tiny_job(backend, op, dtype, 2)])
