"""Shared helpers for kernel tests: device choice, random packed inputs, error metric.

Without a GPU the kernels run under TRITON_INTERPRET=1 on small shapes; with one, the same tests
run on CUDA and ``FULL`` shapes add the long sequences.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if ON_GPU else "cpu"
# Relative-norm error bounds vs the float64 reference. bf16 keeps 8 mantissa bits (~4e-3 per
# rounding); P is rounded to the input dtype before the PV dot. fp32 dots run in TF32 on a GPU.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-3 if ON_GPU else 1e-5}
DTYPES = list(TOL)  # every dtype the kernels take

if not ON_GPU and not INTERPRET:
    pytest.skip("kernel tests need a GPU or TRITON_INTERPRET=1", allow_module_level=True)


@pytest.fixture
def sm90_stand_in(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """CPU tensors standing for an sm_90 device in the prefill's routing (compiled, on CUDA,
    capability 9.0), for tests of its decisions without a GPU. Returns the capability as a
    one-item list a test may change."""
    from attention_kernels import prefill_kernel

    capability = [(9, 0)]
    monkeypatch.setattr(prefill_kernel, "_capability", lambda index: capability[0])
    monkeypatch.setattr(prefill_kernel, "interpreting", lambda: False)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    return capability


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out64).any(), "NaN in kernel output"
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / max(denom, 1e-30)


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=DEVICE)


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


def poison_(t: torch.Tensor) -> None:
    t.fill_(float("nan"))


# Absolute error bound on finite lse values (natural log units). lse never sees the rounding of
# P, only that of q.k: fp32 accumulation for 16-bit inputs, TF32 products for fp32 inputs on GPU.
LSE_TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-3, torch.float32: 2e-2 if ON_GPU else 1e-4}


def check_lse(lse: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    lse, ref = lse.double().cpu(), ref.double().cpu()
    assert not torch.isnan(lse).any(), "NaN in lse"
    ref_empty = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(lse), ref_empty), "lse = -inf exactly where no key is seen"
    if (~ref_empty).any():
        err = (lse[~ref_empty] - ref[~ref_empty]).abs().max().item()
        assert err < LSE_TOL[dtype], f"lse max abs error {err:.3g} >= {LSE_TOL[dtype]:.3g}"
