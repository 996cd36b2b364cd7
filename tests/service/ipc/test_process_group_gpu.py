"""The process group on the GPU (``--frontends 2 --device cuda``): KV-cache decode steps of
many sessions at once through both front-end processes, checked against the float64 oracle;
a front end killed while both stream prefills through their page-locked arenas.
This is the path the benchmarks load (pinned arenas, lazily typed spans, numpy-packed staging,
CUDA-graph steps issued from the engine's channel readers, corked answers); the cpu group
tests never reach its cuda half."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch

from attention_wire.pb import attention_pb2 as pb
from attention_wire.pb import attention_pb2_grpc as pb_grpc

from ..group_helpers import Group, connect_to
from ..kv_helpers import Model, append_messages, cache_decode_messages, layout
from ..svc_helpers import (
    TOLERANCE,
    collect,
    decode_oracle,
    prefill_messages,
    prefill_oracle,
    random_qkv,
    sample,
    wait_until,
)

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


def _prefills(n: int) -> list[tuple[list[Any], torch.Tensor]]:
    """``n`` bf16 causal prefills of 517 tokens (about 1 MB each way) and their answers."""
    out = []
    for seed in range(n):
        q, k, v = random_qkv(517, 517, H, HKV, D, torch.bfloat16, seed=seed)
        cu = [0, 200, 517]
        out.append((list(prefill_messages(q, k, v, cu, causal=True)),
                    prefill_oracle(q, k, v, cu, causal=True)[0]))
    return out


def test_a_front_end_killed_under_load_loses_only_its_own_calls() -> None:
    """kill -9 of one front end while both stream prefills through their page-locked arenas:
    its calls fail UNAVAILABLE; the other's are all answered correctly meanwhile; the engine
    restarts it once the dead arena is quiet (the copies it had queued on the GPU done), and
    both then answer correctly; SIGTERM still drains the group to exit 0."""
    g = Group(2, "--no-warmup", device="cuda", timeout=240)
    try:
        victim, other = g.frontend_pids()[0], g.frontend_pids()[1]
        work = _prefills(4)
        tol = TOLERANCE[torch.bfloat16]
        stop = threading.Event()
        done = {victim: 0, other: 0}

        def stream(pid: int) -> list[grpc.StatusCode]:
            stub = pb_grpc.AttentionServiceStub(connect_to(g, pid))
            i = 0
            while not stop.is_set():
                msgs, ref = work[i % len(work)]
                try:
                    r = collect(stub.Prefill(iter(msgs), timeout=60))
                except grpc.RpcError as err:
                    return [err.code()]
                torch.testing.assert_close(r.out.double(), ref, atol=tol, rtol=tol)
                done[pid] += 1
                i += 1
            return []

        with ThreadPoolExecutor(2) as pool:
            runs = {pid: pool.submit(stream, pid) for pid in (victim, other)}
            assert wait_until(lambda: min(done.values()) >= 20, timeout=120), done
            os.kill(victim, signal.SIGKILL)
            assert runs[victim].result(60) == [grpc.StatusCode.UNAVAILABLE]
            g.wait_for(r"front end 0 \(pid \d+\) exited with code -9", timeout=60)
            g.wait_for(r"front end 0 listening \(pid \d+\), restarted", timeout=60)
            before = done[other]
            assert wait_until(lambda: done[other] >= before + 20, timeout=60)
            stop.set()
            assert runs[other].result(60) == []  # never failed, every answer checked
        g.wait_until_serving()
        for pid in g.frontend_pids().values():
            stub = pb_grpc.AttentionServiceStub(connect_to(g, pid))
            for msgs, ref in work:
                r = collect(stub.Prefill(iter(msgs), timeout=60))
                torch.testing.assert_close(r.out.double(), ref, atol=tol, rtol=tol)
        assert sample(g.scrape(), "attention_frontend_restarts",
                      "attention_frontend_restarts_total") == 1
    finally:
        assert g.stop() == 0
