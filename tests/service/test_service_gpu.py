"""The cuda backend end to end (Triton kernels); skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from attention_wire.pb import attention_pb2 as pb

from .svc_helpers import (
    ServerHandle,
    collect,
    cu_from_lengths,
    decode_messages,
    decode_oracle,
    make_config,
    prefill_messages,
    prefill_oracle,
    random_qkv,
    sample,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def gpu_server():  # type: ignore[no-untyped-def]
    handle = ServerHandle(make_config(device="cuda", metrics_port=0))
    yield handle
    handle.close()


# Relative-norm error bounds vs the float64 oracle, as in tests/kernels: the kernels round P to
# the input dtype before the PV dot, and fp32 inputs use TF32 tensor-core dots (10-bit mantissa).
GPU_REL_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-3}
# lse sees only the q.k rounding: fp32 accumulation for 16-bit inputs, TF32 products for fp32.
GPU_LSE_ATOL = {torch.float16: 2e-3, torch.bfloat16: 2e-3, torch.float32: 2e-2}


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    actual = actual.double()
    assert torch.isfinite(actual).all(), "non-finite output"
    err = ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()
    assert err < GPU_REL_TOL[dtype], f"relative error {err:.3g} >= {GPU_REL_TOL[dtype]:.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_prefill_on_gpu(gpu_server, dtype) -> None:  # type: ignore[no-untyped-def]
    len_q, len_k = [3, 40, 1, 17], [9, 40, 0, 30]
    cu_q, cu_k = cu_from_lengths(len_q), cu_from_lengths(len_k)
    q, k, v = random_qkv(cu_q[-1], cu_k[-1], 8, 2, 128, dtype)
    resp = collect(gpu_server.stub().Prefill(
        prefill_messages(q, k, v, cu_q, cu_k, causal=True, return_lse=True), timeout=120))
    out_ref, lse_ref = prefill_oracle(q, k, v, cu_q, cu_k, causal=True)
    _close(resp.out, out_ref, dtype)
    assert resp.lse is not None
    tol = GPU_LSE_ATOL[dtype]
    torch.testing.assert_close(resp.lse.double(), lse_ref.double(), atol=tol, rtol=0)
    s = resp.stats
    assert s.kernel_seconds > 0 and s.h2d_seconds > 0 and s.d2h_seconds > 0


@pytest.mark.parametrize("num_splits", [0, 1, 4])
def test_decode_on_gpu(gpu_server, num_splits) -> None:  # type: ignore[no-untyped-def]
    len_k = [100, 0, 513, 7]
    cu_k = cu_from_lengths(len_k)
    q, k, v = random_qkv(len(len_k), cu_k[-1], 16, 4, 64, torch.bfloat16)
    resp = collect(gpu_server.stub().Decode(
        decode_messages(q, k, v, cu_k, num_splits=num_splits, return_lse=True), timeout=120))
    out_ref, lse_ref = decode_oracle(q, k, v, cu_k)
    _close(resp.out, out_ref, torch.bfloat16)
    assert resp.lse is not None
    torch.testing.assert_close(resp.lse.double(), lse_ref.double(), atol=1e-3, rtol=1e-3)


def test_gpu_server_info_and_metrics(gpu_server) -> None:  # type: ignore[no-untyped-def]
    info = gpu_server.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info.backend == "cuda" and info.device == torch.cuda.get_device_name()
    assert info.cuda_version == torch.version.cuda and info.triton_version
    families = gpu_server.scrape()
    reserved = "attention_gpu_memory_reserved_bytes"
    assert sample(families, reserved, reserved) > 0
    assert families["attention_device_info"].samples[0].labels["backend"] == "cuda"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_client_with_cuda_tensors(gpu_server, dtype) -> None:  # type: ignore[no-untyped-def]
    """The client's cuda path (pinned staging): inputs on the GPU, one of them a
    non-contiguous view; the answer comes back on the same device, equal to the oracle."""
    from attention_client import AttentionClient

    len_q = [5, 300, 1]
    cu_q = cu_from_lengths(len_q)
    q, k, v = random_qkv(cu_q[-1], cu_q[-1], 8, 2, 64, dtype)
    k_wide = torch.cat([k, torch.full_like(k, float("nan"))], dim=1).cuda()  # [T, 4, 64]
    k_view = k_wide[:, :2]  # non-contiguous, NaN beside it
    with AttentionClient(gpu_server.target, timeout=120) as client:
        out = client.attention(q.cuda(), k_view, v.cuda(), torch.tensor(cu_q), causal=True)
    assert out.is_cuda and out.dtype == dtype and out.shape == q.shape
    out_ref, _ = prefill_oracle(q, k, v, cu_q, cu_q, causal=True)
    _close(out.cpu(), out_ref, dtype)


def test_an_empty_batch_from_cuda_tensors(gpu_server) -> None:  # type: ignore[no-untyped-def]
    """An empty batch of cuda tensors (the client's cuda path): empty results on the device,
    and the server goes on serving a real call after it."""
    from attention_client import AttentionClient

    empty = torch.zeros(0, 8, 128, dtype=torch.bfloat16, device="cuda")
    with AttentionClient(gpu_server.target, timeout=120) as client:
        out, lse = client.attention(empty, empty[:, :2], empty[:, :2], causal=True,
                                    return_lse=True)
        assert out.is_cuda and out.shape == (0, 8, 128) and lse.shape == (8, 0)
        out = client.decode(empty, empty[:, :2], empty[:, :2], [0])
        assert out.is_cuda and out.shape == (0, 8, 128)
        q, k, v = random_qkv(7, 7, 8, 2, 128, torch.bfloat16)
        out = client.attention(q.cuda(), k.cuda(), v.cuda(), causal=True)
    _close(out.cpu(), prefill_oracle(q, k, v, [0, 7], [0, 7], causal=True)[0], torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_score_options_on_gpu(gpu_server, dtype) -> None:  # type: ignore[no-untyped-def]
    # Window, softcap and per-sequence ALiBi through the cuda backend's kernels (prefill and
    # decode), against the float64 reference.
    len_q, len_k = [37, 1, 70], [90, 5, 70]
    cu_q, cu_k = cu_from_lengths(len_q), cu_from_lengths(len_k)
    q, k, v = random_qkv(cu_q[-1], cu_k[-1], 8, 2, 128, dtype, seed=11)
    slopes = torch.rand(3, 8, generator=torch.Generator().manual_seed(1))
    msgs = list(prefill_messages(q, k, v, cu_q, cu_k, causal=True, return_lse=True))
    score = msgs[0].header.score
    score.window_left, score.softcap = 24, 30.0
    score.alibi_slopes.extend(slopes.flatten().tolist())
    resp = collect(gpu_server.stub().Prefill(iter(msgs), timeout=120))
    want, want_lse = prefill_oracle(q, k, v, cu_q, cu_k, causal=True, window_size=(24, -1),
                                    softcap=30.0, alibi_slopes=slopes)
    _close(resp.out, want, dtype)
    torch.testing.assert_close(resp.lse.double(), want_lse.double(),
                               atol=GPU_LSE_ATOL[dtype], rtol=0)
    qd = q[:3].contiguous()
    msgs = list(decode_messages(qd, k, v, cu_k))
    msgs[0].header.score.window_left = 40
    msgs[0].header.score.alibi_slopes.extend(slopes[0].tolist())
    resp = collect(gpu_server.stub().Decode(iter(msgs), timeout=120))
    want, _ = decode_oracle(qd, k, v, cu_k, window_size=(40, -1), alibi_slopes=slopes[0])
    _close(resp.out, want, dtype)


def test_same_lengths_reuse_their_device_cu_seqlens(gpu_server) -> None:  # type: ignore[no-untyped-def]
    """cu_seqlens go up once per distinct lengths (``cuda_launch._CU_MEMO``): other splits of
    the same totals get their own copy, a repeat reuses it, and every answer (fresh values each
    call) matches the float64 oracle."""
    from attention_service.engine import cuda_launch

    cases = [([5, 7], [9, 3]), ([7, 5], [9, 3]), ([5, 7], [9, 3]), ([5, 7], [3, 9])]
    for seed, (len_q, len_k) in enumerate(cases):
        cu_q, cu_k = cu_from_lengths(len_q), cu_from_lengths(len_k)
        q, k, v = random_qkv(cu_q[-1], cu_k[-1], 4, 2, 64, torch.float16, seed=100 + seed)
        resp = collect(gpu_server.stub().Prefill(
            prefill_messages(q, k, v, cu_q, cu_k, causal=True), timeout=120))
        _close(resp.out, prefill_oracle(q, k, v, cu_q, cu_k, causal=True)[0], torch.float16)
    kept = {(key[1], key[2]) for key in cuda_launch._CU_MEMO}
    assert {((0, 9, 12), (0, 5, 12)), ((0, 9, 12), (0, 7, 12)),
            ((0, 3, 12), (0, 5, 12))} <= kept
