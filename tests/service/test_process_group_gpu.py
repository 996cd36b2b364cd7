"""The process group on the GPU (``--frontends 2 --device cuda``): KV-cache decode steps of
many sessions at once through both front-end processes, checked against the float64 oracle.
This is the path the benchmarks load (pinned arenas, lazily typed spans, numpy-packed staging,
CUDA-graph steps issued from the engine's channel readers, corked answers); the cpu group
tests never reach its cuda half."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from attention_wire.pb import attention_pb2 as pb
from attention_wire.pb import attention_pb2_grpc as pb_grpc

from .group_helpers import Group, connect_to
from .kv_helpers import Model, append_messages, cache_decode_messages, layout
from .svc_helpers import TOLERANCE, collect, decode_oracle, random_qkv

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]
H, HKV, D = 8, 2, 64


@pytest.fixture(scope="module")
def group() -> Iterator[Group]:
    g = Group(2, device="cuda", timeout=240)
    yield g
    assert g.stop() == 0


def _session(stub: pb_grpc.AttentionServiceStub, sid: str, seed: int, steps: int) -> list[int]:
    """One client's session: create, append a prompt, ``steps`` stored decode steps, each
    checked; returns the batch sizes its steps ran in."""
    dtype = torch.bfloat16
    stub.CreateCaches(pb.CreateCachesRequest(cache_ids=[sid], layout=layout(dtype, HKV, D)),
                      timeout=30)
    model = Model(HKV, D, dtype)
    model.create([sid])
    prompt = 37 + 29 * seed  # odd lengths: partial last pages
    _, k, v = random_qkv(0, prompt, H, HKV, D, dtype, seed=seed)
    collect(stub.AppendKV(append_messages([sid], k, v, [prompt]), timeout=60))
    model.append([sid], k, v, [prompt])
    batches = []
    for step in range(steps):
        q, kn, vn = random_qkv(1, 1, H, HKV, D, dtype, seed=1000 * seed + step)
        r = collect(stub.CacheDecode(cache_decode_messages([sid], q, kn, vn), timeout=60))
        model.append([sid], kn, vn, [1])
        kk, vv, cu = model.packed([sid])
        ref = decode_oracle(q, kk, vv, cu)[0]
        assert not torch.isnan(r.out).any()
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(r.out.double(), ref, atol=tol, rtol=tol)
        assert list(r.stats.cache_lengths) == [prompt + step + 1]
        batches.append(r.stats.batch_requests)
    assert stub.ReleaseCaches(pb.ReleaseCachesRequest(cache_ids=[sid]),
                              timeout=30).released == 1
    return batches


def test_concurrent_sessions_through_both_frontends_match_the_oracle(group: Group) -> None:
    stubs = [pb_grpc.AttentionServiceStub(connect_to(group, pid))
             for _, pid in sorted(group.frontend_pids().items())]
    n = 16
    with ThreadPoolExecutor(n) as pool:
        runs = [pool.submit(_session, stubs[i % 2], f"s{i}", i, 12) for i in range(n)]
        batches = [b for f in runs for b in f.result(240)]
    assert len(batches) == n * 12
    assert max(batches) > 1  # steps of different sessions (and front ends) shared launches
