"""The Gluon Hopper prefill (``prefill_hopper``): what it compiles to (any machine: Triton
compiles for sm_90a without a GPU and ships ptxas), when ``prefill`` takes it, and on an
sm_90 GPU its results against the float64 reference."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attention_kernels import prefill, prefill_kernel, prefill_ref
from attention_kernels.prefill_hopper import hopper_prefill_ws
from tests.kernels.conftest import DEVICE, ON_GPU, TOL, check_lse, cu_seqlens, poison_, randn

ON_SM90 = ON_GPU and torch.cuda.get_device_capability()[0] == 9
LOG2E = 1.4426950408889634


def _compile_sm90(causal: bool) -> dict:
    """``tune_hopper_prefill.py --compile-only`` in a process of its own: under
    TRITON_INTERPRET=1 (CI) this process's jit functions are the interpreter's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "tune_hopper_prefill.py"
    res = subprocess.run([sys.executable, str(script), "--compile-only"]
                         + (["--causal"] if causal else []),
                         capture_output=True, text=True, env=env, timeout=600)
    if res.returncode == 3:
        pytest.skip(res.stdout.strip())
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_compiles_for_sm90_without_spills(causal: bool) -> None:
    """The register split holds: consumers at 224, producer at 32, no local-memory spills
    (a spill in the consumers' loop cost more than the overlap wins), and the wgmma stay
    asynchronous (the order is the kernel's point)."""
    got = _compile_sm90(causal)
    assert got["spill_bytes"] == 0, got
    assert 224 in got["setmaxnreg_inc"], got
    assert got["wgmma_wait_1"] > 0, got  # S_j waited for with the PV in flight


def test_register_budget_is_checked() -> None:
    q = torch.empty(0, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="consumer_regs"):
        hopper_prefill_ws(q, q, q, torch.zeros(1, dtype=torch.int32),
                          torch.zeros(1, dtype=torch.int32), q, None, False, 1.0,
                          consumer_regs=240, producer_regs=32)


def test_prefill_takes_it_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_gluon_ok``: sm_90, D 128, a launch already on the descriptor path, no features."""
    q = torch.empty(8, 4, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(prefill_kernel, "_capability", lambda index: (9, 0))
    assert prefill_kernel._gluon_ok(q, q, True, True)
    assert not prefill_kernel._gluon_ok(q, q, False, True)  # small launch: no descriptors
    assert not prefill_kernel._gluon_ok(q, q, True, False)  # window / softcap / ALiBi / FP8
    q64 = torch.empty(8, 4, 64, dtype=torch.bfloat16)
    assert not prefill_kernel._gluon_ok(q64, q64, True, True)
    assert not prefill_kernel._gluon_ok(q[:, ::2], q, True, True)  # heads not packed
    monkeypatch.setenv("ATTENTION_KERNELS_GLUON", "0")
    assert not prefill_kernel._gluon_ok(q, q, True, True)
    monkeypatch.delenv("ATTENTION_KERNELS_GLUON")
    for cap in ((8, 0), (10, 0)):  # Ampere; Blackwell has no wgmma
        monkeypatch.setattr(prefill_kernel, "_capability", lambda index, cap=cap: cap)
        assert not prefill_kernel._gluon_ok(q, q, True, True)


CASES = [  # lens_q, lens_k (None: the same), heads, kv heads
    ([1], None, 4, 4), ([17], None, 4, 2), ([127, 129], None, 4, 1), ([0, 1, 17], None, 4, 4),
    ([5, 0, 33, 0], None, 8, 2), ([78, 40, 130], None, 8, 8), ([1000], None, 16, 4),
    ([78, 40, 2050], None, 4, 4), ([300, 1], [700, 5], 4, 2), ([64, 200], [10, 600], 4, 4),
    ([4096], None, 16, 2),
]


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("tile", [(128, 2), (64, 3)], ids=["n128x2", "n64x3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[0]))[:24])
def test_against_reference(case: tuple, causal: bool, dtype: torch.dtype,
                           tile: tuple[int, int]) -> None:
    """Odd lengths (ragged last blocks, a value tile running into the next sequence), empty
    sequences, causal with q != k lengths (rows that see no key), GQA, poisoned outputs."""
    lens_q, lens_k, heads, kv_heads = case
    lens_k = lens_k or lens_q
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = randn(sum(lens_q), heads, 128, dtype=dtype)
    k = randn(sum(lens_k), kv_heads, 128, dtype=dtype)
    v = randn(sum(lens_k), kv_heads, 128, dtype=dtype)
    out = torch.empty_like(q)
    lse = torch.empty(heads, q.shape[0], dtype=torch.float32, device=DEVICE)
    poison_(out)
    poison_(lse)
    hopper_prefill_ws(q, k, v, cu_q, cu_k, out, lse, causal, LOG2E / math.sqrt(128),
                      block_n=tile[0], stages=tile[1])
    ref, ref_lse = prefill_ref(q.double(), k.double(), v.double(), cu_q, cu_k, causal=causal,
                               return_lse=True)
    assert torch.isfinite(out).all()
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < TOL[dtype], f"relative error {err:.3g}"
    assert (out[torch.isneginf(ref_lse).t()] == 0).all()  # rows that see no key
    check_lse(lse, ref_lse, dtype)


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel runs on sm_90 only")
def test_prefill_routes_long_plain_launches_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``prefill`` launches the Gluon kernel for a long D 128 bf16 prompt (and its result is
    right), and the portable kernel once a feature (a window) is asked for."""
    calls = []
    real = prefill_kernel.hopper_prefill_ws
    monkeypatch.setattr(prefill_kernel, "hopper_prefill_ws",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    lens = [4096, 77]
    cu = cu_seqlens(lens)
    q = randn(sum(lens), 16, 128, dtype=torch.bfloat16)
    kv = randn(sum(lens), 2, 128, dtype=torch.bfloat16)
    out = prefill(q, kv, kv, cu, causal=True)
    assert calls == [1]
    ref = prefill_ref(q.double(), kv.double(), kv.double(), cu, causal=True)
    assert ((out.double() - ref).norm() / ref.norm()).item() < TOL[torch.bfloat16]
    prefill(q, kv, kv, cu, causal=True, window_size=(256, 0))
    assert calls == [1]
