"""One batched launch on the GPU: jobs' pinned host tensors straight into slices of packed
device tensors, one kernel call over the merged cu_seqlens, packed output back into pinned
host memory. Everything is queued on one stream and timed with CUDA events; the caller gets
a ``PendingLaunch`` at once, so it can issue the next batch on another stream while this
one's kernel runs (copy engines and SMs work in parallel).
"""

from __future__ import annotations

from types import ModuleType

import torch

from attention_service.backends import DoneLaunch, LaunchOutput, PendingLaunch
from attention_service.batch_plan import BatchPlan

_ALIGN = 4  # int32 entries: keep the cu_seqlens_q view 16-byte aligned like a fresh tensor


def _no_keys(plan: BatchPlan) -> LaunchOutput:
    """No key in the whole batch: zeros and lse -inf, known without touching the GPU."""
    key = plan.key
    out = torch.zeros((plan.total_q, key.num_heads, key.head_dim), dtype=key.dtype)
    lse = None
    if plan.return_lse:
        shape = (key.num_heads, plan.total_q) if plan.rpc == "Prefill" else (
            plan.total_q, key.num_heads)
        lse = torch.full(shape, float("-inf"))
    return LaunchOutput(out=out, lse=lse)


def _copy_rows(dst: torch.Tensor, start: int, src: torch.Tensor) -> None:
    if src.shape[0]:
        # Pinned source + non_blocking: an async DMA on the current stream; torch's host
        # allocator records it, so the pinned block is not reused before the copy ends.
        dst[start : start + src.shape[0]].copy_(src, non_blocking=True)


def _cu_seqlens(
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
    """Holds every buffer of an issued batch until its last event has completed."""

    def __init__(
        self, events: list[torch.cuda.Event], out: torch.Tensor, lse: torch.Tensor | None,
        keep: tuple[object, ...],
    ) -> None:
        self._events = events
        self._out, self._lse = out, lse
        self._keep: tuple[object, ...] | None = keep

    def wait(self) -> LaunchOutput:
        e = self._events
        e[3].synchronize()  # releases the GIL while the GPU finishes
        self._keep = None  # device buffers go back to their stream's pool
        return LaunchOutput(
            out=self._out, lse=self._lse,
            h2d_seconds=e[0].elapsed_time(e[1]) / 1e3,
            kernel_seconds=e[1].elapsed_time(e[2]) / 1e3,
            d2h_seconds=e[2].elapsed_time(e[3]) / 1e3,
        )


def launch_on_stream(
    kernels: ModuleType, plan: BatchPlan, device: torch.device, stream: torch.cuda.Stream
) -> PendingLaunch:
    """Queue h2d copies, the kernel and the d2h copy of ``plan`` on ``stream``; don't wait.

    Device tensors are allocated while ``stream`` is current and used on it alone, so the
    caching allocator never hands their memory to another stream while they are in use.
    """
    if plan.total_k == 0:
        return DoneLaunch(_no_keys(plan))
    key = plan.key
    with torch.cuda.device(device), torch.cuda.stream(stream):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        events[0].record()
        q = torch.empty((plan.total_q, key.num_heads, key.head_dim), dtype=key.dtype,
                        device=device)
        k = torch.empty((plan.total_k, key.num_kv_heads, key.head_dim), dtype=key.dtype,
                        device=device)
        v = torch.empty_like(k)
        for i, job in enumerate(plan.jobs):
            _copy_rows(q, plan.q_offsets[i], job.q)
            _copy_rows(k, plan.k_offsets[i], job.k)
            _copy_rows(v, plan.k_offsets[i], job.v)
        cu_host, cu_k, cu_q = _cu_seqlens(plan, device)
        events[1].record()
        if plan.rpc == "Prefill":
            res = kernels.prefill(
                q, k, v, cu_q, cu_k, max_seqlen_q=plan.max_seqlen_q,
                max_seqlen_k=plan.max_seqlen_k, causal=key.causal,
                softmax_scale=key.softmax_scale, return_lse=plan.return_lse,
            )
        else:
            res = kernels.decode(
                q, k, v, cu_k, max_seqlen_k=plan.max_seqlen_k, softmax_scale=key.softmax_scale,
                num_splits=key.num_splits, return_lse=plan.return_lse,
            )
        out, lse = res if plan.return_lse else (res, None)
        events[2].record()
        out_h = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        out_h.copy_(out, non_blocking=True)
        lse_h = None
        if lse is not None:
            lse_h = torch.empty(lse.shape, dtype=lse.dtype, pin_memory=True)
            lse_h.copy_(lse, non_blocking=True)
        events[3].record()
    return _CudaLaunch(events, out_h, lse_h, keep=(q, k, v, cu_host, cu_k, out, lse, plan))
