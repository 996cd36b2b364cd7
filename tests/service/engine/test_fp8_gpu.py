"""FP8 keys and values through the cuda backend (the kernels' KV_FP8 paths behind the
service): stateless Prefill/Decode, FP8 caches, and the FP8 warm-up; skipped without a GPU."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from attention_service.params import Op

from ..batch_helpers import held_gpu_server, start_all
from ..svc_helpers import ServerHandle, collect, make_config, wait_until
from .test_service_fp8 import (
    fp8_cache_session,
    fp8_decode_req,
    fp8_mixed_scales_case,
    fp8_per_sequence_prefill,
    fp8_prefill_req,
    fp8q_decode_req,
    fp8q_prefill_req,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
# Relative-norm bounds vs float64 on the dequantized K/V (test_service_gpu's, per q dtype).
REL_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# FP8 queries on Hopper: P is e4m3 too (tests/kernels/test_prefill_hopper.py's FP8_P_TOL).
FP8_QUERIES_TOL = 0.04


@pytest.fixture(scope="module")
def gpu_server():  # type: ignore[no-untyped-def]
    handle = ServerHandle(make_config(device="cuda", metrics_port=0))  # warm-up included
    yield handle
    handle.close()


def _close(got: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype,
           tol: float | None = None) -> None:
    got = got.double()
    assert torch.isfinite(got).all(), "non-finite output"
    err = ((got - exact).norm() / exact.norm().clamp_min(1e-30)).item()
    tol = tol or REL_TOL[dtype]
    assert err < tol, f"relative error {err:.3g} >= {tol:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp8_prefill_on_gpu(gpu_server, dtype) -> None:  # type: ignore[no-untyped-def]
    req = fp8_prefill_req(1, [3, 40, 1, 130], [9, 40, 0, 200], dtype=dtype, dim=128, lse=True)
    resp = collect(gpu_server.stub().Prefill(iter(req.messages), timeout=120))
    _close(resp.out, req.out, dtype)


@pytest.mark.parametrize("num_splits", [0, 1, 4])
def test_fp8_decode_on_gpu(gpu_server, num_splits) -> None:  # type: ignore[no-untyped-def]
    req = fp8_decode_req(2, [0, 1, 77, 3000], num_splits=num_splits, dim=128)
    resp = collect(gpu_server.stub().Decode(iter(req.messages), timeout=120))
    _close(resp.out, req.out, torch.float16)


@pytest.mark.parametrize("fp8_queries", [False, True])
def test_fp8_prefill_with_a_row_of_scales_per_sequence_on_gpu(gpu_server, fp8_queries) -> None:  # type: ignore[no-untyped-def]
    """KvScales with a row per sequence ([batch, H_kv], the queries' too) at D 128 with
    sequences long enough for the FP8 builds (mean over 128 keys): each sequence right against
    float64 with its own row, and measurably not what one shared row would give."""
    cu = [0, 150, 420, 600]
    # It checks that one shared row for the keys gets the sequences after the first wrong.
    resp, out, _, _ = fp8_per_sequence_prefill(gpu_server.stub(), fp8_queries, cu, 8, 2, 128,
                                               seed=24)
    _close(resp.out, out, torch.bfloat16, FP8_QUERIES_TOL if fp8_queries else None)


def test_fp8_cache_session_on_gpu(gpu_server) -> None:  # type: ignore[no-untyped-def]
    fp8_cache_session(gpu_server.stub(), "gpu",
                      lambda got, exact: _close(got, exact, torch.bfloat16),
                      stateless_bitwise=False)


def test_fp8_caches_of_different_scales_in_one_request_on_gpu(gpu_server) -> None:  # type: ignore[no-untyped-def]
    """The general launch path with [batch, H_kv] scales: prompts quantized per row on
    AppendKV, then one CacheDecode over caches of scales 40x apart."""
    fp8_mixed_scales_case(gpu_server.stub(), "gpu",
                          lambda got, exact: _close(got, exact, torch.bfloat16), bitwise=False)


def test_fp8_requests_of_different_scales_merge_on_gpu() -> None:
    """Stateless FP8 Prefill and Decode requests with scales of their own, held until all
    queue: one launch per op, each caller right against its own float64 answer."""
    with held_gpu_server() as (srv, backend):
        reqs = [fp8_prefill_req(i, [9 + 7 * i, 30], dim=128) for i in range(4)]
        reqs += [fp8_decode_req(10 + i, [1 + 500 * i, 0, 70], dim=128) for i in range(3)]
        with ThreadPoolExecutor(len(reqs) + 1) as pool:
            blocker = start_all(pool, srv, [fp8_prefill_req(99, [4], dim=128)])[0]
            assert backend.wait_launches(1)
            futures = start_all(pool, srv, reqs)
            ex = srv.server.executor
            assert wait_until(lambda: ex.queue_depth(Op.PREFILL) + ex.queue_depth(Op.DECODE)
                              == len(reqs))
            backend.open_all()
            responses = [f.result(120) for f in futures]
            blocker.result(120)
        assert sorted(backend.batch_sizes()[1:]) == [3, 4]
        for req, resp in zip(reqs, responses, strict=True):
            _close(resp.out, req.out, req.dtype)


def _alone_and_merged(lone: Any, reqs: list[Any], op: Op, tol: float | None = None) -> None:
    """``lone`` through the cuda backend by itself, then ``reqs`` held until all queue and
    merged into one launch; each answer bf16 and right against its own float64 one."""
    with held_gpu_server() as (srv, backend):
        with ThreadPoolExecutor(len(reqs) + 1) as pool:
            first = start_all(pool, srv, [lone])[0]
            assert backend.wait_launches(1)
            futures = start_all(pool, srv, reqs)
            assert wait_until(lambda: srv.server.executor.queue_depth(op) == len(reqs))
            backend.open_all()
            responses = [f.result(120) for f in futures]
            lone_resp = first.result(120)
        assert sorted(backend.batch_sizes()) == [1, len(reqs)]
        for req, resp in zip([lone, *reqs], [lone_resp, *responses], strict=True):
            assert resp.out.dtype == torch.bfloat16
            _close(resp.out, req.out, torch.bfloat16, tol)


def test_fp8_queries_on_gpu_alone_and_merged() -> None:
    """FP8 q, k and v through the cuda backend: one request alone, then four merged into one
    launch (a packed bf16 output beside one-byte queries)."""
    _alone_and_merged(fp8q_prefill_req(30, [300, 77], dim=128),
                      [fp8q_prefill_req(31 + i, [129 + 40 * i, 200], dim=128) for i in range(4)],
                      Op.PREFILL, FP8_QUERIES_TOL)


def test_fp8_queries_decode_on_gpu_alone_and_merged() -> None:
    """FP8 q, k and v in Decodes (the kernel widens the queries and folds their scales into
    the keys'): one alone, then three merged, per kv head and with a row of scales per
    sequence."""
    _alone_and_merged(fp8q_decode_req(40, [0, 1, 77, 3000], dim=128),
                      [fp8q_decode_req(41 + i, [5 + 40 * i, 200, 1], per_seq=i % 2 == 1,
                                       dim=128) for i in range(3)], Op.DECODE)
