"""``decode``'s span route (``decode_span``: one program over adjacent kv heads, block-diagonal
q) against float64, outputs poisoned first, lse included, split and direct; a neighbour head's
inf keys and NaN values; and the rule that picks it (D 100 / 200 on Hopper, large calls)."""

from __future__ import annotations

import pytest
import torch

from attention_kernels import decode, decode_kernel, decode_ref, decode_span
from tests.kernels import sm90_build
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


# (head dim, kv heads, group): D 100 (4 heads a span) and 200 (2), the rule's dims; 20 (8
# heads, rows padded 20 -> 32 columns each) and 59 (odd rows) test the gather and masks off the
# rule; groups of 1, 3 (padded rows) and 8 (32 rows); 2 and 6 kv heads (spans of 2).
CASES = [(100, 8, 3), (200, 4, 3), (20, 8, 3), (59, 4, 3), (100, 8, 8), (100, 2, 1), (36, 6, 2)]


@pytest.mark.parametrize(("head_dim", "kv_heads", "group"), CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_seqlen", [130, 40])  # 2 splits (merge kernel) / 1 (direct)
def test_span_decode(span_always: None, head_dim: int, kv_heads: int, group: int,
                     dtype: torch.dtype, max_seqlen: int) -> None:
    lens = [max_seqlen, 5, 0, 33]
    q = randn(len(lens), group * kv_heads, head_dim, dtype=dtype)
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


def test_strided_keys_and_values(span_always: None) -> None:
    """K/V of other layouts: columns apart (decode copies them packed, and the launch must read
    the copies), and K and V as halves of one ``[T, 2 x H_kv, D]`` tensor (a token stride of
    twice the span's)."""
    dtype, lens = torch.bfloat16, [70, 3, 130]
    cu, q = cu_seqlens(lens), randn(3, 16, 100, dtype=dtype)
    k, v = (randn(sum(lens), 100, 8, dtype=dtype).transpose(1, 2) for _ in "kv")
    kv = randn(sum(lens), 16, 100, dtype=dtype)
    for keys, values in ((k, v), (kv[:, :8], kv[:, 8:])):
        decode_kernel._PLANS.clear()
        got = decode(q, keys, values, cu, max_seqlen_k=130)
        assert _span_plans() == [True]
        ref = decode_ref(q.double(), keys.double(), values.double(), cu)
        assert rel_err(got, ref) < TOL[dtype]


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
           hopper: bool = True, offset: int = 0, group: int = 4) -> int:
    q = torch.empty(1, group * kv_heads, head_dim, dtype=dtype)  # the rule reads no values
    k = torch.empty(offset + 64 * kv_heads * head_dim, dtype=dtype)[offset:].view(
        64, kv_heads, head_dim)
    return decode_span.span_heads(q, k, k, keys, hopper)


def test_the_rule() -> None:
    """Hopper, 16-bit, packed rows that are not whole 32-byte sectors in spans that are,
    D > 64 (2 or 4 heads a span), calls of at least ``SPAN_MIN_KEYS`` keys: D 100 four heads
    a program from 16K keys, D 200 two from 32K; not rows of whole sectors (D 112, 128), odd
    ones (D 111: spans 8-byte aligned), D <= 64 (D 40 in spans of 8 heads measured no
    faster), more than 16 query heads a span, fp32, off Hopper, or data off 16 bytes."""
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
    assert _heads(40, 1 << 20, kv_heads=4) == 0  # 4 heads a span, but D <= 64
    assert _heads(100, 1 << 20, group=8) == 0  # 32 rows a span: spills
    assert _heads(200, 1 << 20, group=8) == 2  # 16


def test_plans_take_the_span_only_where_decode_has_no_other_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a Hopper GPU (stood in for), a large D 100 call plans the span kernel, its splits
    merged by the merge kernel; a caller's split count or tile, a window, a softcap or ALiBi
    keep ``decode``'s own programs."""
    monkeypatch.setattr(decode_kernel, "_hopper", lambda device: True)
    monkeypatch.setattr(decode_kernel, "_shape_rule_sms", lambda device: 132)

    def plan(num_splits: int = 0, window: int = -1, softcap: float = 0.0,
             config: object = None, alibi: torch.Tensor | None = None
             ) -> decode_kernel._DecodePlan:
        q = torch.empty(8, 32, 100, dtype=torch.bfloat16)
        k = torch.empty(8 * 8192, 8, 100, dtype=torch.bfloat16)
        return decode_kernel._plan(q, k, k, None, 8192, None, num_splits, False, config,
                                   "fused", (window, -1), softcap, alibi, None, None, None,
                                   None)

    span = plan()
    assert _is_span(span)
    # 8 sequences x 2 spans of 4 heads: 16 programs of 264 (2 per SM) -> 16 splits.
    assert span.launch.grid[:2] == (16, 16) and span.merge is not None
    assert span.launch.kwargs["HG"] == 4 and span.launch.kwargs["ALIGN"] == 16
    for other in (plan(num_splits=4), plan(window=100), plan(softcap=30.0),
                  plan(config=decode_kernel.DecodeConfig(32, 4, 2)),
                  plan(alibi=torch.ones(32, dtype=torch.float32))):
        assert not _is_span(other)


# The span kernel as ``span_launch`` builds it (D 100 and 200, 32q/8kv bf16, split and direct)
# compiled for sm_90a without a GPU (Triton ships ptxas): async copies, no spills.
_COMPILE_SM90 = r"""
import json
import torch, triton
from attention_kernels.decode_span import span_launch
from tests.kernels.sm90_build import build

got = []
for d, hg, splits in ((100, 4, 16), (100, 4, 1), (200, 2, 8)):
    q = torch.empty(8, 32, d, dtype=torch.bfloat16)
    k = torch.empty(64, 8, d, dtype=torch.bfloat16)
    launch = span_launch(q, k, k, hg, splits, triton.next_power_of_2(d), False, splits > 1,
                         False)
    const = {n: v for n, v in launch.kwargs.items() if n not in ("num_warps", "num_stages")}
    const.update(dict.fromkeys(("Lse", "Counter", "Table", "Alibi", "stride_ab", "KScale",
                                "VScale", "stride_sb")))
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "OutPart": "*fp32",
            "LsePart": "*fp32", "cu_k": "*i32"}
    ints = dict(stride_kt=8 * d, stride_vt=8 * d, stride_qb=32 * d, stride_qh=d,
                stride_ob=32 * d, stride_oh=d)
    got.append(build(launch.fn, const, ptrs, ints, launch.kwargs["num_warps"],
                     launch.kwargs["num_stages"]))
print(json.dumps(got))
"""


@pytest.mark.timeout(300)
def test_span_kernel_compiles_to_async_copies_without_spills_for_sm90() -> None:
    """As launched at D 100 (4 heads a span) and 200 (2), split and direct: 16-byte async
    copies of the spans, and no spills. The NaN re-read inside the span's own 512-column loop
    took 255 registers and spilled 56-164 bytes; one head's tiles fit (211-217 registers)."""
    got = sm90_build.run(_COMPILE_SM90)
    assert len(got) == 3, got
    for built in got:
        assert built["async_copies"] > 0 and built["spill_bytes"] == 0, got


def test_warmup_calls_take_the_span_route(span_always: None) -> None:
    """``warmup``'s span calls (D 100: groups 1-8, lse or not, two sequences and more than one
    per SM) run and each plans the span kernel; on Hopper the second of each pair is direct."""
    from attention_kernels import kernel_warmup

    merges: list = []
    calls = kernel_warmup._span_decodes(100, torch.bfloat16, torch.device(DEVICE),
                                        (False, True), merges)
    assert len(calls) == 16 and merges == calls[::2]
    for call in calls:
        call()
    plans = list(decode_kernel._PLANS._plans.values())
    assert len(plans) == 16 and all(_is_span(p) for p in plans)
    if DEVICE == "cuda" and decode_kernel._hopper(torch.device(DEVICE)):
        assert [p.direct for p in plans] == [False, True] * 8
