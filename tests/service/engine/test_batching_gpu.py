"""The cuda launch path (engine/cuda_launch.py): merged launches on two streams, each caller's
rows against the float64 reference; skipped without a GPU."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from attention_service.params import Op

from ..batch_helpers import decode_req, prefill_req, start_all
from ..batch_helpers import held_gpu_server as held_gpu_server_of
from ..svc_helpers import (
    ServerHandle,
    make_config,
    prefill_oracle,
    random_qkv,
    sample,
    wait_until,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
BF16_TOL = 3.2e-2  # twice the cpu tolerance: a different float32 summation order


@pytest.fixture
def held_gpu_server():  # type: ignore[no-untyped-def]
    with held_gpu_server_of() as held:
        yield held


def test_merged_gpu_launch_gives_each_caller_its_rows(held_gpu_server) -> None:  # type: ignore[no-untyped-def]
    srv, backend = held_gpu_server
    kw = dict(heads=16, kv_heads=8, dim=128, dtype=torch.bfloat16)
    reqs = [prefill_req(i, [17 + 31 * i, 5 + i], lse=i % 2 == 0, **kw)  # type: ignore[arg-type]
            for i in range(12)]
    reqs += [prefill_req(50, [7, 9], k_lengths=[40, 0], lse=True, **kw)]  # type: ignore[arg-type]
    reqs += [decode_req(60 + i, [100 * i + 1, 0, 7], lse=i % 2 == 1, **kw)  # type: ignore[arg-type]
             for i in range(5)]
    before = srv.scrape()
    with ThreadPoolExecutor(len(reqs) + 1) as pool:
        blocker = start_all(pool, srv, [prefill_req(99, [8], **kw)])[0]  # type: ignore[arg-type]
        assert backend.wait_launches(1)
        futures = start_all(pool, srv, reqs)
        executor = srv.server.executor
        assert wait_until(lambda: executor.queue_depth(Op.PREFILL) + executor.queue_depth(
            Op.DECODE) == len(reqs))
        backend.open_all()
        responses = [f.result(120) for f in futures]
        blocker.result(120)
    assert backend.batch_sizes() == [1, 13, 5]
    for req, resp in zip(reqs, responses, strict=True):
        tol = BF16_TOL
        torch.testing.assert_close(resp.out.double(), req.out, atol=tol, rtol=tol)
        if req.lse is None:
            assert resp.lse is None
        else:
            torch.testing.assert_close(resp.lse.double(), req.lse.double(), atol=1e-3,
                                       rtol=1e-3)
        s = resp.stats
        assert s.kernel_seconds > 0 and s.h2d_seconds > 0 and s.d2h_seconds > 0
    after = srv.scrape()
    launches = sample(after, "attention_batches", "attention_batches_total") - sample(
        before, "attention_batches", "attention_batches_total")
    assert launches == 3


def test_batches_in_flight_match_single_launches() -> None:
    """Two batches issued back to back (two streams, no wait in between) write each job the
    same rows as that job launched alone."""
    from attention_service.engine.backends import CudaBackend
    from attention_service.engine.dtypes import WIRE_DTYPES
    from attention_service.engine.jobs import BatchPlan, Job
    from attention_service.params import make_params

    backend = CudaBackend()

    def job(seed: int, lens: list[int]) -> Job:
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        q, k, v = (t.pin_memory() for t in random_qkv(cu[-1], cu[-1], 16, 8, 128,
                                                         torch.float16, seed=seed))
        params = make_params(Op.PREFILL, WIRE_DTYPES[q.dtype], tuple(q.shape), tuple(k.shape),
                             cu, cu, causal=True, return_lse=True)
        out = torch.full(q.shape, float("nan"), dtype=q.dtype).pin_memory()
        lse = torch.full(params.lse_shape, float("nan")).pin_memory()
        return Job(params, q, k, v, out, lse)

    batches = [[job(10 * b + i, [64 * (i + 1), 300, 5]) for i in range(8)] for b in range(2)]
    plans = [BatchPlan(jobs) for jobs in batches]
    pending = [backend.launch(p) for p in plans]  # both in flight
    times = [p.wait() for p in pending]
    for jobs, t in zip(batches, times, strict=True):
        assert t.h2d_seconds > 0 and t.kernel_seconds > 0 and t.d2h_seconds > 0
        for j in jobs:
            alone = Job(j.params, j.q, j.k, j.v, torch.full_like(j.out, float("nan")),
                        torch.full_like(j.lse, float("nan")))
            backend.launch(BatchPlan([alone])).wait()
            torch.testing.assert_close(j.out, alone.out, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(j.lse, alone.lse, atol=1e-4, rtol=1e-4)


def test_lone_device_job_runs_in_place() -> None:
    """A job whose tensors already live on the GPU (a CUDA region) is read and written in
    place: the kernel's output is the job's own destination."""
    from attention_service.engine.backends import CudaBackend
    from attention_service.engine.dtypes import WIRE_DTYPES
    from attention_service.engine.jobs import BatchPlan, Job
    from attention_service.params import make_params

    backend = CudaBackend()
    cu = [0, 100, 130]
    q, k, v = (t.cuda() for t in random_qkv(130, 130, 8, 2, 64, torch.bfloat16, seed=3))
    params = make_params(Op.PREFILL, WIRE_DTYPES[q.dtype], tuple(q.shape), tuple(k.shape),
                         cu, cu, causal=True, return_lse=True)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(params.lse_shape, float("nan"), device="cuda")
    job = Job(params, q, k, v, out, lse)
    backend.launch(BatchPlan([job])).wait()
    ref, ref_lse = prefill_oracle(q.cpu(), k.cpu(), v.cpu(), cu, cu, causal=True)
    torch.testing.assert_close(out.cpu().double(), ref, atol=BF16_TOL, rtol=BF16_TOL)
    torch.testing.assert_close(lse.cpu().double(), ref_lse.double(), atol=2e-3, rtol=0)


def test_gpu_batching_server_under_concurrency() -> None:
    """No gate: 32 concurrent callers on the real cuda backend all get correct rows and
    share launches."""
    handle = ServerHandle(make_config(device="cuda", batching=True, metrics_port=0))
    try:
        kw = dict(heads=8, kv_heads=2, dim=64, dtype=torch.bfloat16)
        reqs = [prefill_req(i, [1 + (37 * i) % 200, 1 + (11 * i) % 50], lse=i % 3 == 0,
                            **kw) for i in range(64)]  # type: ignore[arg-type]
        with ThreadPoolExecutor(32) as pool:
            responses = [f.result(120) for f in start_all(pool, handle, reqs)]
        for req, resp in zip(reqs, responses, strict=True):
            torch.testing.assert_close(resp.out.double(), req.out, atol=BF16_TOL, rtol=BF16_TOL)
        m = handle.scrape()
        assert sample(m, "attention_batch_requests", "attention_batch_requests_sum",
                      rpc="Prefill") == 64
        print("launches for 64 requests:",
              sample(m, "attention_batches", "attention_batches_total", rpc="Prefill"))
    finally:
        handle.close()
