"""Merging jobs into one packed varlen launch (pure host-side bookkeeping, no device work):
which jobs may share a launch (``jobs.batch_key``: their params' ``BatchKey``) and ``BatchPlan``,
the merged ``cu_seqlens``, row offsets and launch parameters of a list of jobs with one key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attention_service.engine.jobs import Job, batch_key
from attention_service.params import BatchKey, KvScales, lengths
from attention_wire.pb import attention_pb2 as pb


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
        merged.extend(x + start for x in cu[1:])
    return merged


class BatchPlan:
    """One launch serving ``jobs`` (all with the same ``BatchKey``), packed in their order.

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
        self.op = self.key.op
        self.q_offsets = _offsets([p.rows for p in params])
        self.k_offsets = _offsets([p.total_k for p in params])
        self.cu_seqlens_k = _merge_cu([p.cu_seqlens_k for p in params], self.k_offsets)
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
        if self.key.alibi:
            h = self.key.num_heads
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
        self.seq_lens: list[int] = []
        self.slot_pages: list[int] = []
        self.slot_offsets: list[int] = []
        if self.op.cached:
            for j in self.jobs:
                work = j.cache
                assert work is not None, "a cached op's job carries its cache work"
                self.block_table += work.block_table
                self.seq_lens += work.seq_lens
                self.slot_pages += work.slot_pages
                self.slot_offsets += work.slot_offsets
            self.max_seqlen_k = max(self.seq_lens, default=0)
        # FP8: every sequence's scales in launch order, and how many new k/v rows each
        # sequence brings (the rows a cached op's store quantizes with those scales).
        self.seq_scales: list[KvScales] = []
        self.seq_new_rows: list[int] = []
        if self.key.fp8:
            for j in self.jobs:
                lens = lengths(j.params.cu_seqlens_k)
                if j.cache is not None:
                    assert j.cache.seq_scales is not None
                    self.seq_scales += j.cache.seq_scales
                else:
                    self.seq_scales += j.params.sequence_scales
                self.seq_new_rows += lens
        # Block-table columns (at least one, so the table is never empty).
        self.table_width = max(1, max((len(r) for r in self.block_table), default=0))

    def score_kwargs(self, device: object = "cpu") -> dict[str, object]:
        """The kernels' (and the reference's) window_size / softcap / alibi_slopes arguments;
        empty when the launch uses none, so plain launches pass nothing new."""
        import torch

        key, out = self.key, {}
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
        if not self.key.fp8:
            return {}
        k, v = scale_rows(self.seq_scales, device)
        if self.key.dtype != pb.FLOAT8_E4M3:
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
        return self.op.lse_shape(self.total_q, self.key.num_heads)

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
