"""Compute backends: ``cuda`` (our Triton kernels) and ``cpu`` (tiled torch attention).

A backend does four things: host buffers (``alloc_host``, pinned on cuda), ``warmup``,
``launch`` of a ``BatchPlan`` (a single request is a batch of one) and ``memory``. ``launch``
writes every job's outputs into its own destination tensors and returns a ``PendingLaunch``:
the cuda backend returns as soon as the work is queued on one of its streams, so the next
batch's copies can be issued while this one computes; the cpu backend computes right away in
sequence groups and stops between groups once every job of the batch is cancelled.
"""

from __future__ import annotations

import os
import time
from typing import Protocol

import torch

from attention_kernels.fp8 import dequantize_kv
from attention_service.engine.cpu_attention import attend
from attention_service.engine.jobs import (
    BatchPlan,
    Cancelled,
    DoneLaunch,
    LaunchTimes,
    PendingLaunch,
)
from attention_service.engine.paged_store import block_table, store_new_tokens
from attention_service.engine.warmup import tiny_plans
from attention_service.errors import StartupError


class Backend(Protocol):
    name: str  # "cuda" | "cpu"
    device_name: str  # GPU name or "cpu"
    device: torch.device
    max_inflight: int  # launches the executor may hold issued and un-waited at once
    async_launch: bool  # launch only queues work: cheap enough for a request's thread

    warmup_dtypes: tuple[torch.dtype, ...]  # what warmup compiles

    def alloc_host(self, nbytes: int) -> torch.Tensor: ...
    def warmup(self) -> None: ...
    def launch(self, plan: BatchPlan) -> PendingLaunch: ...
    def memory(self) -> tuple[int, int]: ...  # (allocated, reserved) device bytes


def dequantized(plan: BatchPlan, k: torch.Tensor, v: torch.Tensor, cu_k: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 launch's keys and values (packed by ``cu_k``) as float32, each sequence with
    its scales (the cpu backend's arithmetic)."""
    if not plan.fp8:
        return k, v
    scales = plan.fp8_kwargs(k.device)
    cu = torch.tensor(cu_k)
    return (dequantize_kv(k, scales["k_scale"], torch.float32, cu),  # type: ignore[arg-type]
            dequantize_kv(v, scales["v_scale"], torch.float32, cu))  # type: ignore[arg-type]


def _packed(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


class CpuBackend:
    """Attention in torch over the packed batch (the same merge path as the GPU's); slow but
    runs anywhere. ``cpu_attention.attend`` works in bounded tiles and checks the cancel flag
    between them, so memory stays bounded and a cancelled batch stops within a tile."""

    name = "cpu"
    device_name = "cpu"
    device = torch.device("cpu")
    max_inflight = 1  # launches finish while issued
    async_launch = False  # it computes: only the dispatcher thread may take that time
    warmup_dtypes = (torch.float32,)

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def memory(self) -> tuple[int, int]:
        return (0, 0)

    def warmup(self) -> None:
        for plan in tiny_plans(self, self.warmup_dtypes):
            self.launch(plan).wait()

    def launch(self, plan: BatchPlan) -> PendingLaunch:
        if plan.cancelled():
            raise Cancelled()
        t0 = time.perf_counter()
        key = plan.shared
        q = _packed([j.q for j in plan.jobs])
        k = _packed([j.k for j in plan.jobs])
        v = _packed([j.v for j in plan.jobs])
        cu_k = plan.cu_seqlens_k
        if plan.op.cached:
            from attention_kernels.paged_reference import gather_pages

            slots = (torch.tensor(plan.slot_pages), torch.tensor(plan.slot_offsets))
            store_new_tokens(plan, k, v, slots)
            if not plan.op.queries or plan.sees_no_keys:
                plan.fill_no_keys()
                return DoneLaunch(LaunchTimes(kernel_seconds=time.perf_counter() - t0))
            work = plan.jobs[0].cache
            assert work is not None
            k, v, cu = gather_pages(work.k_pages, work.v_pages, block_table(plan),
                                    torch.tensor(plan.seq_lens, dtype=torch.int32))
            cu_k = cu.tolist()
        elif plan.sees_no_keys:
            plan.fill_no_keys()
            return DoneLaunch(LaunchTimes())
        k, v = dequantized(plan, k, v, cu_k)
        if q.dtype == torch.float8_e4m3fn:  # exact in bf16; their scales are folded into k's
            q = q.to(torch.bfloat16)
        # A decode step is a prefill with one query per sequence and no mask.
        cu_q = list(range(len(cu_k))) if plan.op.decode_like else plan.cu_seqlens_q
        assert cu_q is not None
        slopes = plan.score_kwargs().get("alibi_slopes")
        out, lse_all = attend(q, k, v, cu_q, cu_k, causal=key.causal, scale=key.softmax_scale,
                              cancelled=plan.cancelled, window=key.window, softcap=key.softcap,
                              alibi_slopes=slopes)  # type: ignore[arg-type]
        lse = lse_all if plan.return_lse else None
        if lse is not None and plan.op.decode_like:
            lse = lse.t()  # decode lse is [batch, heads]
        for i, job in enumerate(plan.jobs):
            r0, r1 = plan.rows(i)
            job.out.copy_(out[r0:r1])
            if job.lse is not None:
                assert lse is not None
                job.lse.copy_(plan.op.lse_rows(lse, r0, r1))
        return DoneLaunch(LaunchTimes(kernel_seconds=time.perf_counter() - t0))


def warmup_workers() -> int | None:
    """The kernel warm-up's compile workers (~1 GB of host memory each): None where
    ``ATTENTION_KERNELS_WARMUP_WORKERS`` is set (the kernels read it), else one per CPU the
    engine may use, its cgroup's CPU quota included (the kernels' own default counts its
    affinity only), at most the kernels' cap."""
    from attention_kernels.kernel_warmup import MAX_DEFAULT_WORKERS, WORKERS_ENV
    from attention_service.config import usable_cpus

    if os.environ.get(WORKERS_ENV, "").strip():
        return None
    return min(MAX_DEFAULT_WORKERS, usable_cpus())


class CudaBackend:
    """Our Triton kernels on the current CUDA device, timed with CUDA events. Launches
    alternate over ``max_inflight`` streams so that one batch's copies run while the previous
    batch's kernel does (see cuda_launch.py)."""

    name = "cuda"
    max_inflight = 2  # one batch computing while the next one's copies go in
    async_launch = True
    warmup_dtypes = (torch.bfloat16, torch.float16, torch.float32)

    def __init__(self, cuda_graphs: bool = True) -> None:
        import attention_kernels  # the Triton modules load lazily, only on this backend
        from attention_service.engine import cuda_launch  # imports Triton: this backend only
        from attention_service.engine.decode_steps import DecodeSteps

        self._kernels = attention_kernels
        # The module, not its function: looked up per launch, so a wrapper put on the
        # module's attribute (benchmarks' step trace) sees every call.
        self._cuda_launch = cuda_launch
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.device_name = torch.cuda.get_device_name(self.device)
        self.streams = [torch.cuda.Stream(self.device) for _ in range(self.max_inflight)]
        self._next_stream = 0
        self.steps = DecodeSteps(attention_kernels, self.device, self.streams, cuda_graphs)

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        # torch's caching host allocator: repeat sizes reuse pinned blocks (no page faults).
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def memory(self) -> tuple[int, int]:
        return (torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device))

    def warmup(self) -> None:
        from attention_kernels import copy_segments

        self._kernels.warmup(device=str(self.device), workers=warmup_workers())
        copy_segments.warm(self.device)  # the batches' one-launch packing (cuda_launch)
        for plan in tiny_plans(self, self.warmup_dtypes):
            self.launch(plan).wait()

    def launch(self, plan: BatchPlan) -> PendingLaunch:
        """Issue the batch on the next stream and return without waiting for the GPU. Called
        by one thread at a time (the executor's dispatcher, or a request's thread when the
        device is idle, under the executor's launch lock); round-robin streams let
        consecutive batches overlap, and a reused stream simply orders its batches."""
        if plan.cancelled():
            raise Cancelled()
        index = self._next_stream
        self._next_stream = (index + 1) % len(self.streams)
        where = self.steps.places(plan)  # None: not for the step graphs
        if where is not None:
            return self.steps.launch(plan, index, where)
        return self._cuda_launch.launch_on_stream(self._kernels, plan, self.device,
                                                  self.streams[index])


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise StartupError("--device cuda requested but torch sees no CUDA device")
    return device


def make_backend(device: str, cuda_graphs: bool = True) -> Backend:
    return CudaBackend(cuda_graphs) if resolve_device(device) == "cuda" else CpuBackend()
