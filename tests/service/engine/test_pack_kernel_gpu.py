"""One-launch packing on the GPU (cuda_launch._by_segments + attention_kernels.copy_segments):
a batch whose tensors lie in page-locked host memory is read and answered in place by two
copy kernels; each job's output against the float64 reference and bit for bit against the
packing with a copy per tensor. Skipped without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

import attention_kernels
from attention_service.engine import cuda_launch
from attention_service.engine.jobs import PINNED, BatchPlan
from attention_service.engine.regions import pin

from ..svc_helpers import cu_from_lengths, decode_oracle, prefill_oracle, span_jobs

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

BF16_TOL = 3.2e-2
LENGTHS = [([17, 1], [40, 1]), ([0], [0]), ([1], [1]), ([130], [130]), ([5, 0, 64], [5, 3, 64])]


def _outputs(jobs: list) -> list[torch.Tensor]:  # type: ignore[type-arg]
    return [job.out.clone() for job in jobs]


# Segments past PACK_MAX_SEGMENT_BYTES go by DMA: none by default, all with 0, and with 64 KiB
# this batch's long segments (130 rows of 4 KiB) while its short ones go through the kernel.
@pytest.mark.parametrize("max_segment", [None, 0, 64 << 10], ids=["default", "all-dma", "mixed"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "decode"),
                         [(16, 8, 128, False), (6, 3, 64, False), (16, 2, 128, True)])
def test_a_batch_in_pinned_memory_is_packed_by_one_kernel(
    monkeypatch: pytest.MonkeyPatch, heads: int, kv_heads: int, dim: int, decode: bool,
    max_segment: int | None,
) -> None:
    from attention_kernels.copy_segments import can_use_host_pointers

    if max_segment is not None:
        monkeypatch.setattr(cuda_launch, "PACK_MAX_SEGMENT_BYTES", max_segment)

    device = torch.device("cuda", torch.cuda.current_device())
    if not can_use_host_pointers(device.index):
        pytest.skip("this device cannot use host pointers of page-locked memory")
    u8 = torch.zeros(16 << 20, dtype=torch.uint8)
    unpin = pin(u8, u8.numel())
    try:
        jobs, inputs = span_jobs(u8, LENGTHS, heads, kv_heads, dim, torch.bfloat16, seed=dim,
                                 decode=decode)
        taken = []
        by_segments = cuda_launch._by_segments
        monkeypatch.setattr(cuda_launch, "_by_segments",
                            lambda plan, dev: taken.append(by_segments(plan, dev)) or taken[-1])
        stream = torch.cuda.Stream(device)
        cuda_launch.launch_on_stream(attention_kernels, BatchPlan(jobs), device, stream).wait()
        assert taken and taken[0] is not None  # the batch went through the copy kernels
        packed = _outputs(jobs)
        for (q, k, v), job, (len_q, len_k) in zip(inputs, jobs, LENGTHS, strict=True):
            if decode:
                ref, _ = decode_oracle(q, k, v, cu_from_lengths(len_k))
            else:
                ref, _ = prefill_oracle(q, k, v, cu_from_lengths(len_q),
                                        cu_from_lengths(len_k), causal=True)
            assert not torch.isnan(job.out).any()
            torch.testing.assert_close(job.out.double(), ref, atol=BF16_TOL, rtol=BF16_TOL)
        # The same batch packed with a copy per tensor: the same kernel on the same bytes.
        for job in jobs:
            job.out.fill_(math.nan)
        monkeypatch.setattr(cuda_launch, "PACK_KERNEL", False)
        cuda_launch.launch_on_stream(attention_kernels, BatchPlan(jobs), device, stream).wait()
        assert taken[-1] is None
        for a, b in zip(packed, _outputs(jobs), strict=True):
            assert torch.equal(a, b)
    finally:
        unpin()
    assert u8.data_ptr() not in PINNED  # unpinned: no kernel is handed its addresses again
