"""Server-side KV caches on the cuda backend (paged Triton kernels, pool in device memory):
steps, a cached prefill, a fork and a merged launch, each against the float64 reference."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from attention_wire.pb import attention_pb2 as pb

from ..kv_helpers import cache_prefill_messages, decode_step, rand, session
from ..svc_helpers import ServerHandle, collect, make_config, prefill_oracle

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


# The kernels' GPU tolerances (tests/kernels/conftest.py): float32 dots run in TF32.
GPU_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-3}
GPU_LSE_TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-3, torch.float32: 2e-2}


@pytest.fixture(scope="module")
def srv() -> Any:
    # The default 256 KiB pages: 64 tokens of 8 x 128 bf16.
    handle = ServerHandle(make_config(device="cuda", kv_cache_bytes=256 << 20, batching=True,
                                      max_queue_delay_ms=20.0))
    yield handle
    handle.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_steps_on_the_gpu_match_the_reference(srv: ServerHandle, dtype: Any) -> None:
    stub = srv.stub()
    # 0 and 64 (bf16/fp16's 64-token pages), 32 (fp32's): a step that starts a fresh page past
    # its row (``CacheWork.new_pages``), over an empty row and a full one.
    ids, model = session(stub, f"g-{dtype}-", [0, 1, 16, 32, 64, 300, 1025], dtype=dtype,
                          heads=32, kv_heads=8, dim=128)
    for i in range(3):
        decode_step(stub, ids, model, heads=32, seed=10 + i, tol=GPU_TOL[dtype],
                    lse_tol=GPU_LSE_TOL[dtype])
    stub.ReleaseCaches(pb.ReleaseCachesRequest(cache_ids=ids), timeout=10)


def test_a_step_past_the_step_graphs_batch_on_the_gpu(srv: ServerHandle) -> None:
    """A step of 300 sequences (past ``decode_steps.MAX_BATCH``: the general launch path, its
    block table from ``paged_store``), some on a page boundary (a fresh page past the row),
    stored and not, matches the reference."""
    stub = srv.stub()
    lens = [(7 * i) % 130 for i in range(300)]  # 0, 64 and 128 among them
    ids, model = session(stub, "big-", lens, dtype=torch.bfloat16, heads=8, kv_heads=8,
                          dim=128)
    for i, store in enumerate((True, False, True)):
        decode_step(stub, ids, model, heads=8, seed=40 + i, store=store,
                    tol=GPU_TOL[torch.bfloat16], lse_tol=GPU_LSE_TOL[torch.bfloat16])
    stub.ReleaseCaches(pb.ReleaseCachesRequest(cache_ids=ids), timeout=10)


def test_cached_prefill_and_fork_on_the_gpu(srv: ServerHandle) -> None:
    stub = srv.stub()
    ids, model = session(stub, "gp-", [100, 0, 77], dtype=torch.bfloat16, heads=16,
                          kv_heads=2, dim=96)
    q_lens = [33, 5, 1]
    q = rand(sum(q_lens), 16, 96, seed=3, dtype=torch.bfloat16)
    k = rand(sum(q_lens), 2, 96, seed=4, dtype=torch.bfloat16)
    v = rand(sum(q_lens), 2, 96, seed=5, dtype=torch.bfloat16)
    r = collect(stub.CachePrefill(cache_prefill_messages(ids, q, k, v, q_lens, q_lens),
                                  timeout=60))
    model.append(ids, k, v, q_lens)
    kk, vv, cu_k = model.packed(ids)
    out, _ = prefill_oracle(q, kk, vv, [0, 33, 38, 39], cu_k, causal=True)
    torch.testing.assert_close(r.out.double(), out, atol=1.6e-2, rtol=1.6e-2)
    stub.ForkCache(pb.ForkCacheRequest(source_id=ids[0], target_id="gp-child", length=70),
                   timeout=10)
    model.create(["gp-child"])
    model.k["gp-child"], model.v["gp-child"] = model.k[ids[0]][:70], model.v[ids[0]][:70]
    for i in range(2):
        decode_step(stub, [*ids, "gp-child"], model, heads=16, seed=20 + i,
                    lse_tol=GPU_LSE_TOL[torch.bfloat16])
    stub.ReleaseCaches(pb.ReleaseCachesRequest(all=True), timeout=10)


def test_concurrent_steps_merge_into_one_paged_launch(srv: ServerHandle) -> None:
    stub = srv.stub()
    sessions = [session(stub, f"m{i}-", [64 * i + 3], dtype=torch.bfloat16, heads=32,
                         kv_heads=8, dim=128, seed=i) for i in range(8)]

    def run(i: int) -> list[int]:
        ids, model = sessions[i]
        return [decode_step(stub, ids, model, heads=32, seed=100 * i + s,
                            lse_tol=GPU_LSE_TOL[torch.bfloat16]).stats.batch_requests
                for s in range(4)]

    with ThreadPoolExecutor(8) as pool:
        merged = [b for bs in pool.map(run, range(8)) for b in bs]
    assert max(merged) > 1
    stub.ReleaseCaches(pb.ReleaseCachesRequest(all=True), timeout=10)
