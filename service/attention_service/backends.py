"""Compute backends: ``cuda`` (our Triton kernels) and ``cpu`` (the torch reference).

A backend runs one launch synchronously on the caller's thread (the executor keeps it off the
event loop) and returns host tensors plus stage timings. ``cancel`` is checked wherever work can
still be skipped: before a GPU launch, and between sequence groups on the cpu backend.

``launch_batch`` (used by the batching executor) runs a merged ``BatchPlan`` as one launch and
returns a ``PendingLaunch``: the cuda backend returns as soon as the work is queued on one of
its streams, so the next batch's copies can be issued while this one computes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from attention_service.batch_plan import BatchPlan
    from attention_service.execution import Job


class Cancelled(Exception):
    """The call went away (cancel or deadline) before its compute finished."""


@dataclass
class LaunchOutput:
    out: torch.Tensor  # host, q's shape and dtype
    lse: torch.Tensor | None  # host float32, only when the job asked for it
    h2d_seconds: float = 0.0
    kernel_seconds: float = 0.0
    d2h_seconds: float = 0.0


class CancelFlag(Protocol):
    def is_set(self) -> bool: ...


class PendingLaunch(Protocol):
    """An issued launch; ``wait`` blocks until its output is in host memory."""

    def wait(self) -> LaunchOutput: ...


class DoneLaunch:
    """A launch that finished while it was issued (cpu backend, batches without keys)."""

    def __init__(self, output: LaunchOutput) -> None:
        self._output = output

    def wait(self) -> LaunchOutput:
        return self._output


class Backend(Protocol):
    name: str  # "cuda" | "cpu"
    device_name: str  # GPU name or "cpu"
    max_inflight: int  # launch_batch results the executor may hold un-waited at once

    def alloc_host(self, nbytes: int) -> torch.Tensor: ...
    def warmup(self) -> None: ...
    def prefill(self, job: Job, cancel: threading.Event) -> LaunchOutput: ...
    def decode(self, job: Job, cancel: threading.Event) -> LaunchOutput: ...
    def launch_batch(self, plan: BatchPlan, cancel: CancelFlag) -> PendingLaunch: ...
    def memory(self) -> tuple[int, int]: ...  # (allocated, reserved) device bytes


def _lse_shape(job: Job) -> tuple[int, int]:
    if job.rpc == "Prefill":
        return (job.q.shape[1], job.q.shape[0])
    return (job.q.shape[0], job.q.shape[1])


def _no_keys(job: Job) -> LaunchOutput:
    """total_k == 0: every query sees no key, so the answer is known without a launch."""
    lse = torch.full(_lse_shape(job), float("-inf")) if job.return_lse else None
    return LaunchOutput(out=torch.zeros_like(job.q), lse=lse)


def _packed(plan: BatchPlan) -> Job:
    """The batch as one Job over host tensors packed with torch.cat (cpu path only)."""
    q, k, v = (torch.cat([getattr(j, name) for j in plan.jobs]) for name in ("q", "k", "v"))
    return plan.merged_job(q, k, v)


def _rebased(cu: list[int], b0: int, b1: int) -> torch.Tensor:
    """cu_seqlens of sequences b0..b1-1 alone, starting at 0."""
    return torch.tensor([x - cu[b0] for x in cu[b0 : b1 + 1]], dtype=torch.int32)


def _tiny_job(rpc: str, dtype: torch.dtype) -> Job:
    from attention_service.execution import Job

    g = torch.Generator().manual_seed(0)
    q = torch.randn(4 if rpc == "Prefill" else 2, 2, 64, generator=g).to(dtype)
    k = torch.randn(4, 1, 64, generator=g).to(dtype)
    return Job(
        rpc=rpc, q=q, k=k, v=k.clone(), cu_seqlens_q=[0, 2, 4] if rpc == "Prefill" else None,
        cu_seqlens_k=[0, 2, 4], max_seqlen_q=2, max_seqlen_k=2, causal=rpc == "Prefill",
        softmax_scale=None, return_lse=True, num_splits=0, flops=0, tokens=4,
    )


class CpuBackend:
    """The torch reference; slow but runs anywhere. Work goes in sequence groups so a cancelled
    call stops after at most one group (about ``group_work`` multiply-adds)."""

    name = "cpu"
    device_name = "cpu"
    max_inflight = 1  # launches finish while issued

    def __init__(self, group_work: int = 1 << 25) -> None:
        self.group_work = group_work

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def memory(self) -> tuple[int, int]:
        return (0, 0)

    def warmup(self) -> None:
        self.prefill(_tiny_job("Prefill", torch.float32), threading.Event())
        self.decode(_tiny_job("Decode", torch.float32), threading.Event())

    def _groups(self, cu_q: list[int], cu_k: list[int], row_work: int) -> list[tuple[int, int]]:
        groups, start, work = [], 0, 0
        for b in range(len(cu_k) - 1):
            work += (cu_q[b + 1] - cu_q[b]) * (cu_k[b + 1] - cu_k[b] + 1) * row_work
            if work >= self.group_work:
                groups.append((start, b + 1))
                start, work = b + 1, 0
        if start < len(cu_k) - 1:
            groups.append((start, len(cu_k) - 1))
        return groups

    def _run(self, job: Job, cancel: CancelFlag) -> LaunchOutput:
        from attention_kernels import prefill_ref

        if job.k.shape[0] == 0:
            return _no_keys(job)
        t0 = time.perf_counter()
        decode = job.rpc == "Decode"
        cu_k = job.cu_seqlens_k
        cu_q = list(range(len(cu_k))) if decode else job.cu_seqlens_q
        assert cu_q is not None
        out = torch.empty_like(job.q)
        lse = torch.empty(job.q.shape[1], job.q.shape[0]) if job.return_lse else None
        for b0, b1 in self._groups(cu_q, cu_k, job.q.shape[1] * job.q.shape[2]):
            if cancel.is_set():
                raise Cancelled()
            q0, q1, k0, k1 = cu_q[b0], cu_q[b1], cu_k[b0], cu_k[b1]
            o, lse_b = prefill_ref(
                job.q[q0:q1], job.k[k0:k1], job.v[k0:k1],
                _rebased(cu_q, b0, b1), _rebased(cu_k, b0, b1),
                causal=job.causal, softmax_scale=job.softmax_scale, return_lse=True,
            )
            out[q0:q1] = o
            if lse is not None:
                lse[:, q0:q1] = lse_b
        if lse is not None and decode:
            lse = lse.t().contiguous()  # decode lse is [batch, heads]
        return LaunchOutput(out=out, lse=lse, kernel_seconds=time.perf_counter() - t0)

    def prefill(self, job: Job, cancel: threading.Event) -> LaunchOutput:
        return self._run(job, cancel)

    def decode(self, job: Job, cancel: threading.Event) -> LaunchOutput:
        # A decode step is a prefill with one query per sequence and no mask.
        return self._run(job, cancel)

    def launch_batch(self, plan: BatchPlan, cancel: CancelFlag) -> PendingLaunch:
        # The reference over the packed batch: the same merge/split path as the GPU's.
        return DoneLaunch(self._run(_packed(plan), cancel))


class CudaBackend:
    """Our Triton kernels on the current CUDA device, timed with CUDA events.

    Single launches use ``stream``; batches alternate over ``batch_streams`` so that one
    batch's copies run while the previous batch's kernel does (see cuda_batch.py).
    """

    name = "cuda"
    max_inflight = 2  # one batch computing while the next one's copies go in

    def __init__(self) -> None:
        import attention_kernels  # the Triton modules load lazily, only on this backend

        self._kernels = attention_kernels
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.device_name = torch.cuda.get_device_name(self.device)
        self.stream = torch.cuda.Stream(self.device)
        self.batch_streams = [torch.cuda.Stream(self.device) for _ in range(self.max_inflight)]
        self._next_stream = 0

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        # Pinned, so the h2d copy is a true async DMA (torch caches pinned blocks).
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def memory(self) -> tuple[int, int]:
        return (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device))

    def warmup(self) -> None:
        self._kernels.warmup(device=str(self.device))
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for rpc in ("Prefill", "Decode"):
                job = _tiny_job(rpc, dtype)
                job.q, job.k, job.v = (t.pin_memory() for t in (job.q, job.k, job.v))
                self._launch(job, threading.Event())
                self._warm_batch(job)

    def _warm_batch(self, job: Job) -> None:
        """Run the batched path once (two copies of ``job`` merged) before traffic arrives."""
        from attention_service.batch_plan import BatchPlan

        plan = BatchPlan([job, dataclasses.replace(job, cancel=threading.Event())])
        self.launch_batch(plan, threading.Event()).wait()

    def _launch(self, job: Job, cancel: threading.Event) -> LaunchOutput:
        if cancel.is_set():
            raise Cancelled()
        if job.k.shape[0] == 0:
            return _no_keys(job)
        dev = self.device
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        with torch.cuda.device(dev), torch.cuda.stream(self.stream):
            events[0].record()
            q, k, v = (t.to(dev, non_blocking=True) for t in (job.q, job.k, job.v))
            cu_k = torch.tensor(job.cu_seqlens_k, dtype=torch.int32).pin_memory()
            cu_k = cu_k.to(dev, non_blocking=True)
            events[1].record()
            if job.rpc == "Prefill":
                assert job.cu_seqlens_q is not None
                cu_q = torch.tensor(job.cu_seqlens_q, dtype=torch.int32).pin_memory()
                cu_q = cu_q.to(dev, non_blocking=True)
                res = self._kernels.prefill(
                    q, k, v, cu_q, cu_k, max_seqlen_q=job.max_seqlen_q,
                    max_seqlen_k=job.max_seqlen_k, causal=job.causal,
                    softmax_scale=job.softmax_scale, return_lse=job.return_lse,
                )
            else:
                res = self._kernels.decode(
                    q, k, v, cu_k, max_seqlen_k=job.max_seqlen_k,
                    softmax_scale=job.softmax_scale, num_splits=job.num_splits,
                    return_lse=job.return_lse,
                )
            out, lse = res if job.return_lse else (res, None)
            events[2].record()
            out_h = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            out_h.copy_(out, non_blocking=True)
            lse_h = None
            if lse is not None:
                lse_h = torch.empty(lse.shape, dtype=lse.dtype, pin_memory=True)
                lse_h.copy_(lse, non_blocking=True)
            events[3].record()
        events[3].synchronize()
        return LaunchOutput(
            out=out_h, lse=lse_h,
            h2d_seconds=events[0].elapsed_time(events[1]) / 1e3,
            kernel_seconds=events[1].elapsed_time(events[2]) / 1e3,
            d2h_seconds=events[2].elapsed_time(events[3]) / 1e3,
        )

    def prefill(self, job: Job, cancel: threading.Event) -> LaunchOutput:
        return self._launch(job, cancel)

    def decode(self, job: Job, cancel: threading.Event) -> LaunchOutput:
        return self._launch(job, cancel)

    def launch_batch(self, plan: BatchPlan, cancel: CancelFlag) -> PendingLaunch:
        """Issue the batch on the next batch stream and return without waiting for the GPU.
        Called from one thread only (the executor's dispatcher); round-robin streams let
        consecutive batches overlap, and a reused stream simply orders its batches."""
        from attention_service.cuda_batch import launch_on_stream

        if cancel.is_set():
            raise Cancelled()
        stream = self.batch_streams[self._next_stream]
        self._next_stream = (self._next_stream + 1) % len(self.batch_streams)
        return launch_on_stream(self._kernels, plan, self.device, stream)


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but torch sees no CUDA device")
    return device


def make_backend(device: str) -> Backend:
    return CudaBackend() if resolve_device(device) == "cuda" else CpuBackend()
