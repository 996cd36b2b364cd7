"""FP8 keys and values through the cuda backend (the kernels' KV_FP8 paths behind the
service): stateless Prefill/Decode, FP8 caches, and the FP8 warm-up; skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from .svc_helpers import ServerHandle, collect, make_config
from .test_service_fp8 import fp8_cache_session, fp8_decode_req, fp8_prefill_req

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
# Relative-norm bounds vs float64 on the dequantized K/V (test_service_gpu's, per q dtype).
REL_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module")
def gpu_server():  # type: ignore[no-untyped-def]
    handle = ServerHandle(make_config(device="cuda", metrics_port=0))  # warm-up included
    yield handle
    handle.close()


def _close(got: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> None:
    got = got.double()
    assert torch.isfinite(got).all(), "non-finite output"
    err = ((got - exact).norm() / exact.norm().clamp_min(1e-30)).item()
    assert err < REL_TOL[dtype], f"relative error {err:.3g} >= {REL_TOL[dtype]:.3g}"


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


def test_fp8_cache_session_on_gpu(gpu_server) -> None:  # type: ignore[no-untyped-def]
    fp8_cache_session(gpu_server.stub(), "gpu",
                      lambda got, exact: _close(got, exact, torch.bfloat16),
                      stateless_bitwise=False)
