"""prefill vs the float64 reference: odd lengths, head dims, GQA, causal alignment, dtypes."""

from __future__ import annotations

import pytest
import torch

from attention_kernels import _prefill_slots, configs, prefill, prefill_kernel, prefill_ref
from attention_kernels.configs import PrefillConfig
from tests.kernels.conftest import (
    DEVICE,
    DTYPES,
    ON_GPU,
    TOL,
    check_lse,
    cu_seqlens,
    poison_,
    randn,
    rel_err,
)


def run_case(
    lens_q: list[int],
    lens_k: list[int] | None,
    heads: int,
    kv_heads: int,
    head_dim: int,
    causal: bool,
    dtype: torch.dtype,
    config: PrefillConfig | None = None,
    softmax_scale: float | None = None,
) -> None:
    cu_q = cu_seqlens(lens_q)
    cu_k = cu_seqlens(lens_k) if lens_k is not None else None
    total_q, total_k = sum(lens_q), sum(lens_k if lens_k is not None else lens_q)
    q = randn(total_q, heads, head_dim, dtype=dtype)
    k = randn(total_k, kv_heads, head_dim, dtype=dtype)
    v = randn(total_k, kv_heads, head_dim, dtype=dtype)
    out = torch.empty_like(q)
    lse = torch.empty(heads, total_q, dtype=torch.float32, device=DEVICE)
    poison_(out)
    poison_(lse)
    got, got_lse = prefill(
        q, k, v, cu_q, cu_k, causal=causal, return_lse=True, out=out, lse_out=lse,
        softmax_scale=softmax_scale, _config=config,
    )
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    ref, ref_lse = prefill_ref(
        q.double(), k.double(), v.double(), cu_q, cu_k, causal=causal, return_lse=True,
        softmax_scale=softmax_scale,
    )
    if total_q:
        err = rel_err(got, ref)
        assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]:.3g}"
        # Rows that see no key must be exactly zero (a NaN or stale row fails here).
        empty_rows = torch.isneginf(ref_lse.cpu()).t()  # [total_q, H]
        assert (got.cpu()[empty_rows] == 0).all()
    check_lse(got_lse, ref_lse, dtype)


LENGTHS = [
    [1],
    [17],
    [127],
    [0, 1, 17],
    [5, 0, 33, 0],
    [78, 40, 130],  # skewed
]
if ON_GPU:
    LENGTHS += [[1000], [78, 40, 8192], [8192, 16, 16, 16, 16], [512] * 8]


@pytest.mark.parametrize("lens", LENGTHS, ids=lambda x: "-".join(map(str, x))[:40])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lengths(lens: list[int], causal: bool) -> None:
    run_case(lens, None, 4, 2, 64, causal, torch.float16)


def test_length_1000() -> None:
    run_case([1000], None, 2, 1, 32, True, torch.bfloat16)


@pytest.mark.parametrize("head_dim", [8, 40, 64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_dims_and_dtypes(head_dim: int, dtype: torch.dtype) -> None:
    run_case([17, 40], None, 2, 1, head_dim, True, dtype)


@pytest.mark.parametrize("kv_heads", [8, 4, 1], ids=["mha", "gqa2", "gqa8"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa(kv_heads: int, causal: bool) -> None:
    run_case([33, 20], None, 8, kv_heads, 64, causal, torch.bfloat16)


@pytest.mark.parametrize(
    ("lens_q", "lens_k"),
    [
        ([1, 5, 17], [40, 5, 60]),  # q shorter than k: decode-like rows see the whole prefix
        ([30, 9], [7, 2]),  # q longer than k: the first rows see no key under causal
        ([3, 0, 10], [0, 4, 10]),  # empty k with non-empty q, and the reverse
    ],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_q_and_k_lengths_differ(lens_q: list[int], lens_k: list[int], causal: bool) -> None:
    run_case(lens_q, lens_k, 4, 2, 64, causal, torch.float16)


@pytest.mark.parametrize(
    "config",
    [PrefillConfig(16, 32, 4, 1), PrefillConfig(64, 16, 4, 1), PrefillConfig(16, 16, 4, 1)],
    ids=["m16n32", "m64n16", "m16n16"],
)
def test_block_shapes_other_than_default(config: PrefillConfig) -> None:
    # The causal bounds must hold for BLOCK_M < BLOCK_N and BLOCK_M > BLOCK_N alike.
    run_case([50, 3, 70], [60, 3, 70], 2, 1, 64, True, torch.float16, config=config)


@pytest.mark.parametrize("slot_run", [1, 5, 0], ids=["heads-inner", "runs-of-5", "heads-outer"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_program_order_covers_every_tile(
    slot_run: int, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 12 slots in runs of 5 leave 3 spare programs in the last run (slot < 0): they must write
    # nothing.
    monkeypatch.setitem(_prefill_slots.SLOT_RUN, causal, slot_run)
    monkeypatch.setattr(prefill_kernel, "_PLANS", type(prefill_kernel._PLANS)())
    run_case([45, 0, 70, 1], None, 3, 1, 64, causal, torch.float16,
             config=PrefillConfig(16, 16, 4, 1))


def test_prefill_tiles_by_launch_size_and_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """On Hopper, 16-bit launches of many programs take the many-program tiles (bounded ones
    by the ``max_seqlen_q`` hint), fewer programs the table's but for short causal D 128;
    FP8, fp32 and other GPUs keep the table's (no GPU needed: the cached functions unwrapped)."""
    monkeypatch.setattr(configs, "_INTERPRETING", False)
    monkeypatch.setattr(configs, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(configs, "num_sms", lambda index: 132)
    gpu = torch.device("cuda", 0)
    cfg = configs.prefill_config.__wrapped__
    bucket = configs.short_rows_bucket
    assert [bucket(n) for n in (None, 0, 1, 2, 3, 512, 513, 4096, 4097)] == [
        None, 1, 1, 2, 4, 512, 1024, 4096, None]
    # 8192 queries in one sequence: 64 + 2 slots x 16 heads = 8 programs per SM of 132.
    assert configs.many_programs(8192, 1, 16, gpu)
    assert not configs.many_programs(8191, 1, 16, gpu)
    assert not configs.many_programs(10**6, 1, 16, torch.device("cpu"))
    table = configs.PrefillConfig(128, 128, 8, 3)
    wide, short64 = configs.PrefillConfig(128, 64, 4, 2), configs.PrefillConfig(64, 64, 4, 2)
    bf16 = torch.bfloat16
    # Many programs.
    assert cfg(128, bf16, False, gpu, False, None, True) == wide
    assert cfg(128, bf16, False, gpu, False, bucket(100), True) == wide
    assert cfg(128, bf16, True, gpu, False, None, True) == wide
    assert cfg(128, torch.float16, True, gpu, False, bucket(1024), True) == short64
    assert cfg(128, bf16, True, gpu, False, bucket(1025), True) == wide
    for causal in (False, True):
        assert cfg(64, bf16, causal, gpu, False, bucket(4096), True) == (
            configs.PrefillConfig(64, 64, 4, 3))
        assert cfg(64, bf16, causal, gpu, False, None, True) == cfg(64, bf16, causal, gpu)
    # Few programs: the table, but short causal D 128.
    assert cfg(128, bf16, False, gpu, False, bucket(100)) == table
    assert cfg(128, bf16, True, gpu, False, bucket(512)) == short64
    assert cfg(128, bf16, True, gpu, False, bucket(513)) == table
    assert cfg(64, bf16, True, gpu, False, bucket(100)) == cfg(64, bf16, True, gpu)
    # fp32 and pre-Hopper GPUs: the table's tile, adjusted.
    assert cfg(128, torch.float32, True, gpu, False, 512, True).block_m == 128
    monkeypatch.setattr(configs, "_capability", lambda index: (8, 0))
    assert cfg(128, bf16, False, gpu, False, None, True) == configs.PrefillConfig(128, 64, 8, 2)


def test_softmax_scale() -> None:
    run_case([20, 9], None, 2, 2, 64, True, torch.float32, softmax_scale=0.37)


def test_strided_inputs_are_handled() -> None:
    # q/k/v as views into one packed qkv projection [T, 3, H, D]: token stride 3*H*D.
    lens = [9, 23]
    cu = cu_seqlens(lens)
    qkv = randn(sum(lens), 3, 4, 64, dtype=torch.float16)
    q, k, v = qkv.unbind(1)
    got = prefill(q, k, v, cu, causal=True)
    ref = prefill_ref(q.double(), k.double(), v.double(), cu, causal=True)
    assert rel_err(got, ref) < TOL[torch.float16]
    # A transposed head dim (stride != 1) is copied, never read wrongly.
    qt = randn(sum(lens), 64, 4, dtype=torch.float16).transpose(1, 2)
    got = prefill(qt, k, v, cu)
    ref = prefill_ref(qt.double(), k.double(), v.double(), cu)
    assert rel_err(got, ref) < TOL[torch.float16]
    # K transposed, V in padded rows: both are copied at launch, and the plan takes the
    # copies' strides (it once kept V's padded ones and read the packed copy past its end).
    kt = randn(sum(lens), 64, 4, dtype=torch.float16).transpose(1, 2)
    vp = randn(sum(lens), 4, 80, dtype=torch.float16)[..., :64]
    out = torch.empty_like(q)
    poison_(out)
    got = prefill(q, kt, vp, cu, out=out)
    ref = prefill_ref(q.double(), kt.double(), vp.double(), cu)
    assert rel_err(got, ref) < TOL[torch.float16]


def test_empty_batch_and_no_tokens() -> None:
    q = randn(0, 2, 64, dtype=torch.float16)
    out, lse = prefill(q, q, q, cu_seqlens([0, 0]), return_lse=True)
    assert out.shape == (0, 2, 64) and lse.shape == (2, 0)


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        (((5, 4, 64), (5, 3, 64)), "multiple of num_kv_heads"),
        (((5, 4, 257), (5, 2, 257)), "head_dim 257"),
        (((5, 4, 264), (5, 2, 264)), "head_dim 264"),
        (((5, 4, 64), (5, 2, 32)), "head_dim of q"),
        (((5, 64), (5, 2, 64)), "q must be 3-D"),
    ],
)
def test_bad_shapes_raise(shapes: tuple, match: str) -> None:
    q = randn(*shapes[0], dtype=torch.float16)
    k = randn(*shapes[1], dtype=torch.float16)
    with pytest.raises(ValueError, match=match):
        prefill(q, k, k, cu_seqlens([5]))


def test_bad_dtypes_raise() -> None:
    q = randn(5, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="dtypes differ"):
        prefill(q, q.float(), q.float(), cu_seqlens([5]))
    with pytest.raises(ValueError, match="cu_seqlens_q must be int32"):
        prefill(q, q, q, cu_seqlens([5]).long())
    with pytest.raises(ValueError, match="sequences"):
        prefill(q, q, q, cu_seqlens([5]), cu_seqlens([2, 3]))


@pytest.mark.skipif(not ON_GPU, reason="needs > 2**31 elements: GPU only")
def test_int64_offsets() -> None:
    # total_q * H * D > 2**31: rows of the last sequence live past the int32 range.
    heads, head_dim, seqlen = 1, 128, 4096
    batch = (2**31 // (heads * head_dim)) // seqlen + 2
    lens = [seqlen] * batch
    q = randn(seqlen * batch, heads, head_dim, dtype=torch.bfloat16)
    assert q.numel() > 2**31
    out = prefill(q, q, q, cu_seqlens(lens), causal=True)
    last = slice(seqlen * (batch - 1), seqlen * batch)
    ql = q[last]
    ref = prefill_ref(ql.double(), ql.double(), ql.double(), cu_seqlens([seqlen]), causal=True)
    assert rel_err(out[last], ref) < TOL[torch.bfloat16]


# Head dim 128 in 16-bit takes the tensor-descriptor (TMA) path on Hopper once a launch has
# enough work (_TMA_MIN_WORK): long enough sequences that the unmasked key loop runs many
# blocks, with ends off the block grid, and 16 heads so 5525 rows clear the threshold. The
# interpreter has no TMA path and no threshold: 4 heads (GQA 2) there, as LEAK_HEADS below,
# a quarter of 16 heads' programs.
LONG_128 = [300, 1000, 129, 4096] if ON_GPU else [40, 70]
LONG_128_HEADS = 16 if ON_GPU else 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_head_dim_128_long_sequences(dtype: torch.dtype, causal: bool) -> None:
    run_case(LONG_128, None, LONG_128_HEADS, 2, 128, causal, dtype)


@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] < 9,
                    reason="TMA loads: Hopper or newer")
def test_tma_path_is_taken_where_the_tests_expect() -> None:
    """The TMA tests above (and the leak test below) must really run the descriptor path, and
    small launches must not pay for it."""
    from attention_kernels.prefill_kernel import _tma_ok

    big = randn(sum(LONG_128), LONG_128_HEADS, 128, dtype=torch.bfloat16)
    kv = randn(sum(LONG_128), 2, 128, dtype=torch.bfloat16)
    assert _tma_ok(big, kv, kv)
    n = sum(LEAK_LENS)
    leak_q = randn(n, LEAK_HEADS, 128, dtype=torch.bfloat16)
    assert _tma_ok(leak_q, kv[:n], kv[:n])
    small = randn(3072, 16, 128, dtype=torch.bfloat16)  # [1024] * 3: host-bound, no TMA
    assert not _tma_ok(small, kv[:3072], kv[:3072])


# On a GPU, long enough that the D128 case takes the TMA path (5077^2 x 16 heads of work).
LEAK_LENS = [2000, 77, 3000] if ON_GPU else [20, 7, 30]
LEAK_HEADS = 16 if ON_GPU else 4


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_neighbour_sequences_do_not_leak(head_dim: int, causal: bool) -> None:
    """inf/NaN in one sequence's K/V must not reach another sequence's rows: the service packs
    different callers' requests into one launch."""
    lens = LEAK_LENS
    cu = cu_seqlens(lens)
    q = randn(sum(lens), LEAK_HEADS, head_dim, dtype=torch.bfloat16)
    k = randn(sum(lens), 2, head_dim, dtype=torch.bfloat16)
    v = randn(sum(lens), 2, head_dim, dtype=torch.bfloat16)
    a, b = lens[0], lens[0] + lens[1]
    v[a:b] = float("inf")
    k[a:b, :, 0] = float("nan")
    out = prefill(q, k, v, cu, causal=causal)
    keep = torch.ones(sum(lens), dtype=torch.bool, device=DEVICE)
    keep[a:b] = False
    v[a:b] = 0
    k[a:b] = 0
    ref = prefill_ref(q.double(), k.double(), v.double(), cu, causal=causal)
    assert torch.isfinite(out[keep]).all(), "a neighbour's inf/NaN leaked"
    err = rel_err(out[keep], ref[keep])
    assert err < TOL[torch.bfloat16], f"relative error {err:.3g}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_more_sequences_than_one_search_block(causal: bool) -> None:
    """The sequence lookup scans cu_seqlens 64 entries at a time: cross that boundary, as a
    batching server's merged launches do (80 sequences: 16 past the first block)."""
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(0, 6, (80,), generator=g).tolist()
    run_case(lens, None, 2, 1, 64, causal, torch.float16)


@pytest.mark.skipif(not ON_GPU, reason="compiled variants exist on a GPU only")
def test_warmup_compiles_what_prefill_serves() -> None:
    """After ``warmup``, prefills of other lengths (a long prompt taking the descriptor loads
    at D 128 on Hopper, short ones with a ``max_seqlen_q`` hint taking the short tiles), GQA
    ratios and batch sizes (launches of few and of many programs) compile nothing new; nor
    does a long prompt with FP8 K/V (widened for the Gluon kernel on Hopper)."""
    from attention_kernels import quantize_kv, warmup
    from attention_kernels.kv_copies import _widen_kv_kernel
    from attention_kernels.prefill_hopper import _hopper_prefill_ws_kernel

    def variants() -> int:
        return sum(len(c[0]) for kernel in (prefill_kernel._prefill_kernel,
                                            _hopper_prefill_ws_kernel, _widen_kv_kernel)
                   for c in kernel.device_caches.values())

    warmup((64, 128), (torch.bfloat16,), DEVICE)
    before = variants()
    for d in (64, 128):
        for lens, heads, kv_heads, hint in (([8192], 16, 16, None), ([512] * 4, 32, 8, 512),
                                            ([1000, 3000], 16, 2, 3000), ([77, 5], 4, 4, None),
                                            ([512] * 32, 16, 16, 512), ([2048] * 8, 16, 4, 2048),
                                            ([300] * 40, 32, 8, None)):
            q = randn(sum(lens), heads, d, dtype=torch.bfloat16)
            kv = randn(sum(lens), kv_heads, d, dtype=torch.bfloat16)
            for causal in (False, True):
                for lse in (False, True):
                    prefill(q, kv, kv, cu_seqlens(lens), causal=causal, return_lse=lse,
                            max_seqlen_q=hint)
                    if lens == [8192]:
                        kv8, scale = quantize_kv(kv)
                        prefill(q, kv8, kv8, cu_seqlens(lens), causal=causal, return_lse=lse,
                                k_scale=scale, v_scale=scale)
    assert variants() == before
