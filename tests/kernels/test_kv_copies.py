"""``kv_copies``: FP8 K/V widened to bf16/fp16 for the Gluon prefill, bitwise what
torch's conversion gives (every e4m3 value is exact in both); rows padded with zeros."""

from __future__ import annotations

import pytest
import torch

from attention_kernels.fp8 import FP8_DTYPE, FP8_MAX
from attention_kernels.kv_copies import pad_rows, widen_kv
from tests.kernels.conftest import DEVICE, randn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("total, kv_heads, dim", [(0, 2, 64), (1, 1, 128), (70, 3, 40),
                                                  (129, 2, 72)])
def test_bitwise_torch_conversion(total: int, kv_heads: int, dim: int,
                                  dtype: torch.dtype) -> None:
    # K: every head a view with a gap after it (strided heads); V packed. Values over e4m3's
    # whole range, its subnormals, zeros of both signs and the largest finite value.
    k = (randn(total, kv_heads + 1, dim, dtype=torch.float32)[:, 1:] * 64).clamp(-FP8_MAX,
                                                                                  FP8_MAX)
    v = randn(total, kv_heads, dim, dtype=torch.float32) / 256
    if total:
        k[0, 0, :4] = torch.tensor([FP8_MAX, -FP8_MAX, 0.0, -0.0])
        v[-1, -1, :2] = torch.tensor([2.0 ** -9, -(2.0 ** -7)])
    k8, v8 = k.to(FP8_DTYPE), v.to(FP8_DTYPE)
    k_out, v_out = widen_kv(k8, v8, dtype)
    assert k_out.dtype == v_out.dtype == dtype and k_out.is_contiguous() and v_out.is_contiguous()
    assert k_out.shape == v_out.shape == (total, kv_heads, dim)
    assert torch.equal(k_out.view(torch.int16), k8.to(dtype).view(torch.int16))
    assert torch.equal(v_out.view(torch.int16), v8.to(dtype).view(torch.int16))
    assert str(k_out.device).startswith(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_DTYPE], ids=str)
@pytest.mark.parametrize("total, heads, dim, row", [(0, 2, 59, 64), (1, 1, 40, 64),
                                                    (70, 3, 59, 64), (33, 5, 111, 128)])
def test_rows_padded(total: int, heads: int, dim: int, row: int, dtype: torch.dtype,
                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``pad_rows``: a fresh contiguous copy with rows of ``row`` columns, zeros past D (its
    memory poisoned with NaN first), from a source with a token stride that is not its
    packed one (a slice of a packed qkv), 16-bit or FP8 (the prefill's K/V copies at D 59)."""
    src = randn(total, heads + 2, dim, dtype=torch.float32)[:, 1:-1].to(dtype)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    padded = pad_rows(src, row)
    monkeypatch.undo()
    assert padded.shape == (total, heads, row) and padded.is_contiguous()
    assert padded.dtype == dtype
    assert torch.equal(padded[..., :dim].float(), src.float())
    assert (padded[..., dim:].float() == 0).all()
    with pytest.raises(ValueError, match="row >= D"):
        pad_rows(src, dim - 1)
