"""Merging jobs into one packed varlen launch, and splitting its output back per job.

Pure host-side bookkeeping (no device work): which jobs may share a launch (``batch_key``),
how many tokens a job weighs against the budget (``budget_tokens``), and ``BatchPlan``, the
merged ``cu_seqlens``, row offsets and launch parameters of a list of jobs with one key.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from attention_service.execution import Job


@dataclass(frozen=True)
class BatchKey:
    """Jobs with equal keys run the same kernel with the same parameters, so they can merge."""

    rpc: str
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    softmax_scale: float
    # Decode only; kept in the key so an explicit split count is honoured exactly as asked.
    num_splits: int


def batch_key(job: Job) -> BatchKey:
    _, num_heads, head_dim = job.q.shape
    # None and an explicit 1/sqrt(D) are the same float in the kernel: let them merge.
    scale = job.softmax_scale if job.softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    return BatchKey(
        rpc=job.rpc, dtype=job.q.dtype, num_heads=num_heads, num_kv_heads=job.k.shape[1],
        head_dim=head_dim, causal=job.causal and job.rpc == "Prefill", softmax_scale=scale,
        num_splits=job.num_splits if job.rpc == "Decode" else 0,
    )


def budget_tokens(job: Job) -> int:
    """A job's weight against ``max_batch_tokens``: keys for decode; for prefill the larger of
    queries and keys, so a few queries over a long cached prefix still count as large."""
    if job.rpc == "Decode":
        return int(job.k.shape[0])
    return int(max(job.q.shape[0], job.k.shape[0]))


def _offsets(sizes: Sequence[int]) -> list[int]:
    acc = [0]
    for n in sizes:
        acc.append(acc[-1] + n)
    return acc


def _merge_cu(cus: Sequence[list[int]], starts: Sequence[int]) -> list[int]:
    """Concatenate per-job cu_seqlens, each shifted by where its tokens start."""
    merged = [0]
    for cu, start in zip(cus, starts, strict=False):
        merged.extend(x + start for x in cu[1:])
    return merged


class BatchPlan:
    """One launch serving ``jobs`` (all with the same ``BatchKey``), packed in their order.

    Job i owns query rows ``q_offsets[i]:q_offsets[i+1]`` (tokens for prefill, sequences for
    decode) and key rows ``k_offsets[i]:k_offsets[i+1]`` of the packed tensors.
    """

    def __init__(self, jobs: Sequence[Job]) -> None:
        if not jobs:
            raise ValueError("a batch needs at least one job")
        self.jobs = list(jobs)
        self.key = batch_key(self.jobs[0])
        if any(batch_key(j) != self.key for j in self.jobs[1:]):
            raise ValueError("jobs of different batch keys cannot share a launch")
        self.rpc = self.key.rpc
        self.q_offsets = _offsets([int(j.q.shape[0]) for j in self.jobs])
        self.k_offsets = _offsets([int(j.k.shape[0]) for j in self.jobs])
        self.cu_seqlens_k = _merge_cu([j.cu_seqlens_k for j in self.jobs], self.k_offsets)
        self.cu_seqlens_q: list[int] | None = None
        if self.rpc == "Prefill":
            cus = [j.cu_seqlens_q for j in self.jobs]
            assert all(cu is not None for cu in cus)
            self.cu_seqlens_q = _merge_cu(cus, self.q_offsets)  # type: ignore[arg-type]
        self.max_seqlen_q = max(j.max_seqlen_q for j in self.jobs)
        self.max_seqlen_k = max(j.max_seqlen_k for j in self.jobs)
        # The kernel computes lse for everyone or no one; it costs little, so any asker wins.
        self.return_lse = any(j.return_lse for j in self.jobs)
        self.tokens = sum(j.tokens for j in self.jobs)
        self.flops = sum(j.flops for j in self.jobs)
        self.kv_bytes = sum(j.k.nbytes + j.v.nbytes for j in self.jobs)

    @property
    def total_q(self) -> int:
        return self.q_offsets[-1]

    @property
    def total_k(self) -> int:
        return self.k_offsets[-1]

    def __len__(self) -> int:
        return len(self.jobs)

    def merged_job(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Job:
        """The whole batch as one Job over packed tensors (the cpu backend runs this)."""
        return Job(
            rpc=self.rpc, q=q, k=k, v=v, cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k, max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k, causal=self.key.causal,
            softmax_scale=self.key.softmax_scale,
            return_lse=self.return_lse, num_splits=self.key.num_splits, flops=self.flops,
            tokens=self.tokens,
        )

    def split(
        self, out: torch.Tensor, lse: torch.Tensor | None
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each job's own (out, lse) from the merged launch's host output.

        ``out`` rows are views (no copy). lse keeps the kernels' layouts: prefill
        ``[H, total_q]`` is sliced by columns (copied, to be contiguous), decode ``[batch, H]``
        by rows. A job that did not ask for lse gets None.
        """
        parts: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for i, job in enumerate(self.jobs):
            r0, r1 = self.q_offsets[i], self.q_offsets[i + 1]
            job_lse = None
            if job.return_lse:
                assert lse is not None, "the launch skipped lse that a job asked for"
                job_lse = lse[:, r0:r1].contiguous() if self.rpc == "Prefill" else lse[r0:r1]
            parts.append((out[r0:r1], job_lse))
        return parts
