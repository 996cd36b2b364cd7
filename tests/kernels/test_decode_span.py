"""``decode``'s span route (``decode_span``: one program over adjacent kv heads, block-diagonal
q) against float64, outputs poisoned first, lse included, split and direct; a neighbour head's
inf keys and NaN values; and the rule that picks it (D 100 / 200 on Hopper, large calls)."""

from __future__ import annotations

import pytest
import torch

from attention_kernels import decode, decode_kernel, decode_ref, decode_span
from tests.kernels.conftest import DEVICE, TOL, check_lse, cu_seqlens, poison_, randn, rel_err


@pytest.fixture
def span_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """The span route wherever the layout allows it (the interpreter is not a Hopper GPU);
    plans made so go with the fixture."""
    monkeypatch.setattr(decode_span, "SPAN_MODE", "always")
    decode_kernel._PLANS.clear()
    yield
    decode_kernel._PLANS.clear()


def _is_span(plan: decode_kernel._DecodePlan) -> bool:
    return plan.launch.fn.fn.__name__ == "_decode_span_kernel"


def _span_plans() -> list[bool]:
    return [_is_span(p) for p in decode_kernel._PLANS._plans.values()]


# (head dim, kv heads): D 100 (4 heads a span) and 200 (2), the rule's dims; 20 (8 heads, rows
# padded 20 -> 32 columns each) and 59 (odd rows) test the gather and masks off the rule.
CASES = [(100, 8), (200, 4), (20, 8), (59, 4)]


@pytest.mark.parametrize(("head_dim", "kv_heads"), CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_seqlen", [130, 40])  # 2 splits (merge kernel) / 1 (direct)
def test_span_decode(span_always: None, head_dim: int, kv_heads: int, dtype: torch.dtype,
                     max_seqlen: int) -> None:
    lens = [max_seqlen, 5, 0, 33]
    q = randn(len(lens), 3 * kv_heads, head_dim, dtype=dtype)  # a group of 3: padded rows
    k, v = (randn(sum(lens), kv_heads, head_dim, dtype=dtype) for _ in "kv")
    cu = cu_seqlens(lens)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=DEVICE)
    poison_(out)
    poison_(lse)
    decode(q, k, v, cu, max_seqlen_k=max_seqlen, return_lse=True, out=out, lse_out=lse)
    ref, ref_lse = decode_ref(q.double(), k.double(), v.double(), cu, return_lse=True)
    assert _span_plans() == [True]
    assert rel_err(out, ref) < TOL[dtype]
    check_lse(lse, ref_lse, dtype)
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # no keys: zeros, lse -inf


@pytest.mark.parametrize("head_dim", [100, 20])
def test_neighbours_inf_keys_and_nan_values(span_always: None, head_dim: int) -> None:
    """An inf in kv head 2's keys and a NaN in its values, read by every program whose span
    holds head 2: no other head's output may change (their sums end NaN, so their keys are
    read again one head at a time; V's other columns are never kept)."""
    dtype = torch.bfloat16
    lens = [70, 3, 130]
    k, v = (randn(sum(lens), 8, head_dim, dtype=dtype) for _ in "kv")
    k[:, 2], v[:, 2] = float("inf"), float("nan")
    q, cu = randn(3, 16, head_dim, dtype=dtype), cu_seqlens(lens)
    got = decode(q, k, v, cu, max_seqlen_k=130)
    ref = decode_ref(q.double(), k.double(), v.double(), cu)
    ok = [h for h in range(16) if h // 2 != 2]
    assert _span_plans() == [True]
    assert not got[:, ok].isnan().any()
    assert rel_err(got[:, ok], ref[:, ok]) < TOL[dtype]


def _heads(head_dim: int, keys: int, dtype: torch.dtype = torch.bfloat16, kv_heads: int = 8,
           hopper: bool = True, offset: int = 0) -> int:
    q = torch.empty(1, 4 * kv_heads, head_dim, dtype=dtype)  # the rule reads no values
    k = torch.empty(offset + 64 * kv_heads * head_dim, dtype=dtype)[offset:].view(
        64, kv_heads, head_dim)
    return decode_span.span_heads(q, k, k, keys, hopper)


def test_the_rule() -> None:
    """Hopper, 16-bit, packed rows that are not whole 32-byte sectors in spans that are, 2 or
    4 heads a span, calls of at least ``SPAN_MIN_KEYS`` keys: D 100 four heads a program from
    16K keys, D 200 two from 32K; not rows of whole sectors (D 112, 128), odd ones (D 111:
    spans 8-byte aligned), small dims (D 40: 8 heads, measured no faster), fp32, off Hopper,
    or data off 16 bytes."""
    assert _heads(100, 16384) == 4
    assert _heads(100, 16383) == 0
    assert _heads(200, 32768) == 2
    assert _heads(200, 16384) == 0
    assert _heads(100, 1 << 20, torch.float16) == 4
    for d in (112, 128, 111, 59, 40):
        assert _heads(d, 1 << 20) == 0
    assert _heads(100, 1 << 20, torch.float32) == 0
    assert _heads(100, 1 << 20, hopper=False) == 0
    assert _heads(100, 1 << 20, offset=4) == 0  # the base 8 bytes past 16
    assert _heads(100, 1 << 20, kv_heads=1) == 0


def test_plans_take_the_span_only_where_decode_has_no_other_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a Hopper GPU (stood in for), a large D 100 call plans the span kernel, its splits
    merged by the merge kernel; a caller's split count or tile, a window, a softcap or ALiBi
    keep ``decode``'s own programs."""
    monkeypatch.setattr(decode_kernel, "_hopper", lambda device: True)
    monkeypatch.setattr(decode_kernel, "_shape_rule_sms", lambda device: 132)

    def plan(num_splits: int = 0, window: int = -1, softcap: float = 0.0,
             config: object = None) -> decode_kernel._DecodePlan:
        q = torch.empty(8, 32, 100, dtype=torch.bfloat16)
        k = torch.empty(8 * 8192, 8, 100, dtype=torch.bfloat16)
        return decode_kernel._plan(q, k, k, None, 8192, None, num_splits, False, config,
                                   "fused", (window, -1), softcap, None, None, None, None,
                                   None)

    span = plan()
    assert _is_span(span)
    # 8 sequences x 2 spans of 4 heads: 16 programs of 264 (2 per SM) -> 16 splits.
    assert span.launch.grid[:2] == (16, 16) and span.merge is not None
    assert span.launch.kwargs["HG"] == 4 and span.launch.kwargs["ALIGN"] == 16
    for other in (plan(num_splits=4), plan(window=100), plan(softcap=30.0),
                  plan(config=decode_kernel.DecodeConfig(32, 4, 2))):
        assert not _is_span(other)
