"""Sliding window, softcap and ALiBi (flash_attn's semantics) in every kernel, vs the float64
reference; the reference itself against an independently built mask and bias.

Under the interpreter the prefill tiles are 32 queries x 16 keys and decode blocks 16 keys, so
windows of a few keys over sequences of 40-100 cross several blocks on both edges. Outputs and
lse are poisoned (NaN) before each call; ``rel_err`` and ``check_lse`` fail on any NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

from attention_kernels import (
    decode,
    decode_ref,
    paged_decode,
    paged_decode_ref,
    paged_prefill,
    paged_prefill_ref,
    prefill,
    prefill_ref,
    supported_head_dim,
)
from attention_kernels.configs import (
    DecodeConfig,
    PrefillConfig,
    decode_config,
    paged_decode_config,
    prefill_config,
)
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
from tests.kernels.test_paged import Paged

ODD_HEAD_DIM = 72  # not a power of two (padded to 128 in the kernels)
assert supported_head_dim(ODD_HEAD_DIM)


def slopes(*shape: int) -> torch.Tensor:
    """ALiBi slopes in (0.05, 1]: a bias that matters over a few dozen keys."""
    g = torch.Generator().manual_seed(sum(shape))
    return (0.05 + 0.95 * torch.rand(*shape, generator=g)).to(DEVICE)


def features(window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
             alibi: torch.Tensor | None = None) -> dict:
    return {"window_size": window, "softcap": softcap, "alibi_slopes": alibi}


def check_out(got: torch.Tensor, got_lse: torch.Tensor, ref: torch.Tensor, ref_lse: torch.Tensor,
              dtype: torch.dtype, lse_rows_first: bool) -> None:
    """Output within tolerance, rows that see no key exactly 0, lse (incl. -inf) right."""
    if got.numel():
        err = rel_err(got, ref)
        assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]:.3g}"
        empty = torch.isneginf(ref_lse.cpu())
        empty = empty if lse_rows_first else empty.t()  # [rows, H]
        assert (got.cpu()[empty] == 0).all(), "rows that see no key must be 0"
    check_lse(got_lse, ref_lse, dtype)


def run_prefill(lens_q: list[int], lens_k: list[int], heads: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype, causal: bool, feats: dict,
                config: PrefillConfig | None = None, scale: float = 1.0) -> torch.Tensor:
    """prefill vs prefill_ref; returns the reference lse (to assert on empty rows)."""
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = randn(sum(lens_q), heads, head_dim, dtype=dtype) * scale
    k = randn(sum(lens_k), kv_heads, head_dim, dtype=dtype) * scale
    v = randn(sum(lens_k), kv_heads, head_dim, dtype=dtype)
    out, lse = torch.empty_like(q), torch.empty(heads, sum(lens_q), device=DEVICE)
    poison_(out)
    poison_(lse)
    got, got_lse = prefill(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, out=out,
                           lse_out=lse, _config=config, **feats)
    ref, ref_lse = prefill_ref(q.double(), k.double(), v.double(), cu_q, cu_k, causal=causal,
                               return_lse=True, **feats)
    check_out(got, got_lse, ref, ref_lse, dtype, lse_rows_first=False)
    return ref_lse


def run_decode(lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
               num_splits: int, feats: dict) -> None:
    cu = cu_seqlens(lens)
    q = randn(len(lens), heads, head_dim, dtype=dtype)
    k = randn(sum(lens), kv_heads, head_dim, dtype=dtype)
    v = randn(sum(lens), kv_heads, head_dim, dtype=dtype)
    out, lse = torch.empty_like(q), torch.empty(len(lens), heads, device=DEVICE)
    poison_(out)
    poison_(lse)
    got, got_lse = decode(q, k, v, cu, num_splits=num_splits, return_lse=True, out=out,
                          lse_out=lse, **feats)
    ref, ref_lse = decode_ref(q.double(), k.double(), v.double(), cu, return_lse=True, **feats)
    check_out(got, got_lse, ref, ref_lse, dtype, lse_rows_first=True)


# ---- prefill: the window -------------------------------------------------------------------

SELF_LENS = [70, 1, 0, 33]  # several query blocks, a single row, an empty sequence
WINDOWS = {
    "left5": (5, -1), "right4": (-1, 4), "left6-right3": (6, 3), "zero": (0, 0),
    "left0": (0, -1), "wider-than-seq": (500, 500), "causal-as-window": (-1, 0),
    "left40-right17": (40, 17),
}


# Every window without and with causal, less two causal repeats: causal folds the right side
# into 0, so causal "left0" (0, -1) launches as causal "zero" (0, 0) does, and causal
# "causal-as-window" (-1, 0) as causal "right4" (-1, 4) does: plain causal (same kernel
# arguments, and references that agree).
CAUSAL_REPEATS = {"zero", "causal-as-window"}


@pytest.mark.parametrize(
    ("window", "causal"),
    [pytest.param(window, causal, id=f"{'causal' if causal else 'full'}-{name}")
     for causal in (False, True) for name, window in WINDOWS.items()
     if not (causal and name in CAUSAL_REPEATS)],
)
def test_prefill_window(window: tuple[int, int], causal: bool) -> None:
    run_prefill(SELF_LENS, SELF_LENS, 4, 2, 64, torch.float16, causal, features(window))


@pytest.mark.parametrize("window", [(3, 0), (-1, 2), (4, 4), (1, -1)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_prefill_window_q_and_k_lengths_differ(window: tuple[int, int], causal: bool) -> None:
    # q longer than k: the first rows sit before the first key, and with a bounded right
    # side (or causal) see no key at all; q shorter than k: decode-like rows at the end.
    ref_lse = run_prefill([20, 3, 9, 0], [6, 40, 0, 5], 2, 1, 64, torch.float16, causal,
                          features(window))
    if window[1] >= 0 or causal:
        assert torch.isneginf(ref_lse[:, :10]).all(), "the case covers rows with no key"


@pytest.mark.parametrize(
    "config",
    [PrefillConfig(16, 32, 4, 1), PrefillConfig(64, 16, 4, 1), PrefillConfig(16, 16, 4, 1)],
    ids=["m16n32", "m64n16", "m16n16"],
)
@pytest.mark.parametrize("window", [(7, -1), (20, 5)], ids=["left7", "left20-right5"])
def test_prefill_window_other_blocks(config: PrefillConfig, window: tuple[int, int]) -> None:
    run_prefill([90, 17], [100, 17], 2, 1, 64, torch.float16, True, features(window),
                config=config)


# On a GPU the key blocks are 64-128 keys: long sequences put many blocks on each side of a
# window, and D 128 bf16 with enough work takes the tensor-descriptor (TMA) loads on Hopper.
LONG_LENS = [3000, 129, 1000]
LONG_WINDOWS = [(256, -1), (100, 37), (1000, 0), (0, 0)]


@pytest.mark.skipif(not ON_GPU, reason="GPU tiles; the interpreter covers the logic above")
@pytest.mark.parametrize("window", LONG_WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_window_long(window: tuple[int, int], causal: bool, head_dim: int) -> None:
    run_prefill(LONG_LENS, LONG_LENS, 8, 2, head_dim, torch.bfloat16, causal, features(window))


TMA_N, TMA_HEADS = 8192, 16


@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] < 9,
                    reason="TMA loads: Hopper or newer")
@pytest.mark.parametrize(
    ("causal", "feats"),
    [(True, features((4096, -1))), (False, features((2048, 2048))),
     (True, features((4096, -1), softcap=30.0, alibi=slopes(TMA_HEADS)))],
    ids=["causal-left4096", "left2048-right2048", "causal-all"],
)
def test_prefill_window_tma(causal: bool, feats: dict) -> None:
    from attention_kernels.prefill_kernel import _tma_ok

    q = randn(TMA_N, TMA_HEADS, 128, dtype=torch.bfloat16)
    kv = randn(TMA_N, 2, 128, dtype=torch.bfloat16)
    left, right = feats["window_size"]
    assert _tma_ok(q, kv, kv, left + (0 if causal else right) + 1), "the TMA path runs"
    run_prefill([TMA_N], [TMA_N], TMA_HEADS, 2, 128, torch.bfloat16, causal, feats)


# ---- prefill: softcap and ALiBi ------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_prefill_softcap(dtype: torch.dtype, causal: bool) -> None:
    # Logits of unit spread against a cap of 1: tanh bends all of them, saturates the tails.
    # (Scaled-up inputs would saturate more, but fp32 runs in TF32 on a GPU: its error grows
    # with the logits.)
    run_prefill([40, 9], [40, 9], 2, 1, 64, dtype, causal, features(softcap=1.0))


def test_prefill_softcap_with_window() -> None:
    # bf16 (exact products, fp32 sums): inputs scaled by 3 saturate tanh at a cap of 1.5.
    run_prefill([50, 20], [60, 20], 4, 2, 64, torch.bfloat16, True,
                features((9, -1), softcap=1.5), scale=3.0)


@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes-H", "slopes-BH"])
@pytest.mark.parametrize("kv_heads", [8, 2, 1], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_prefill_alibi(per_batch: bool, kv_heads: int, causal: bool) -> None:
    lens = [37, 0, 20]
    alibi = slopes(len(lens), 8) if per_batch else slopes(8)
    run_prefill(lens, lens, 8, kv_heads, 64, torch.float16, causal, features(alibi=alibi))


@pytest.mark.parametrize("head_dim", [ODD_HEAD_DIM, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_all_features_head_dims(head_dim: int, dtype: torch.dtype) -> None:
    lens_q, lens_k = [33, 1], [45, 7]
    run_prefill(lens_q, lens_k, 4, 2, head_dim, dtype, True,
                features((11, -1), softcap=2.0, alibi=slopes(2, 4)))


# ---- decode --------------------------------------------------------------------------------

DECODE_LENS = [0, 1, 23, 100, 64]  # empty, one key, off the block grid, several blocks


@pytest.mark.parametrize("window", [(0, -1), (7, 0), (30, 5), (99, -1), (1000, -1)],
                         ids=["left0", "left7", "left30", "left99", "left1000"])
@pytest.mark.parametrize("num_splits", [1, 3, 8], ids=lambda s: f"splits{s}")
def test_decode_window(window: tuple[int, int], num_splits: int) -> None:
    run_decode(DECODE_LENS, 8, 2, 64, torch.float16, num_splits, features(window))


@pytest.mark.parametrize("num_splits", [1, 4], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_softcap(num_splits: int, dtype: torch.dtype) -> None:
    run_decode([50, 9], 4, 2, 64, dtype, num_splits, features(softcap=1.5))


@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes-H", "slopes-BH"])
@pytest.mark.parametrize("kv_heads", [8, 2, 1], ids=["mha", "gqa4", "gqa8"])
def test_decode_alibi(per_batch: bool, kv_heads: int) -> None:
    lens = [70, 0, 9]
    alibi = slopes(len(lens), 8) if per_batch else slopes(8)
    run_decode(lens, 8, kv_heads, 64, torch.bfloat16, 3, features(alibi=alibi))


@pytest.mark.parametrize("head_dim", [ODD_HEAD_DIM, 128])
def test_decode_all_features(head_dim: int) -> None:
    run_decode([90, 5, 33], 8, 2, head_dim, torch.bfloat16, 5,
                features((20, -1), softcap=3.0, alibi=slopes(3, 8)))


@pytest.mark.skipif(not ON_GPU, reason="long contexts: GPU only")
@pytest.mark.parametrize(("left", "num_splits"), [(4096, 0), (4096, 16), (100, 8), (0, 4)])
def test_decode_window_long(left: int, num_splits: int) -> None:
    run_decode([32768, 4096, 70000, 1], 32, 8, 128, torch.bfloat16, num_splits,
               features((left, -1), alibi=slopes(32)))


def test_decode_window_splits_share_the_window() -> None:
    """Automatic splits are sized on the window (a hint of 10K keys with a 20-key window would
    otherwise ask for many splits), and any explicit count gives the same answer."""
    lens = [300, 41]
    cu = cu_seqlens(lens)
    q = randn(2, 4, 64, dtype=torch.float32)
    k, v = (randn(sum(lens), 2, 64, dtype=torch.float32) for _ in range(2))
    ref, ref_lse = decode_ref(q.double(), k.double(), v.double(), cu, window_size=(20, -1),
                              return_lse=True)
    for splits in (0, 2, 7, 40):  # 40: more splits than the window's blocks
        got, lse = decode(q, k, v, cu, num_splits=splits, max_seqlen_k=10_000, return_lse=True,
                          window_size=(20, -1))
        assert rel_err(got, ref) < TOL[torch.float32]
        check_lse(lse, ref_lse, torch.float32)


# ---- skipping, not masking: keys no row can see are never read ----------------------------
# The kernels' key blocks are those of the default configs (16 keys under the interpreter,
# 64 or 128 on a GPU): keys more than a block before a window's first key are poisoned.

def _poison_before(t: torch.Tensor, cu: list[int], firsts: list[int]) -> torch.Tensor:
    """A copy of packed ``t`` with NaN in keys ``[0, firsts[b])`` of each sequence ``b``."""
    t = t.clone()
    for b, first in enumerate(firsts):
        t[cu[b] : cu[b] + first] = float("nan")
    return t


def test_prefill_window_never_reads_keys_before_it() -> None:
    """Short query chunks at the end of long contexts with a small left window: the keys
    before the key block of the first row's window are NaN, and must not be loaded."""
    lens_q, lens_k, left = [8, 5], ([100, 61] if not ON_GPU else [1000, 613]), 10
    bn = prefill_config(64, torch.float16, True, torch.device(DEVICE)).block_n
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = randn(sum(lens_q), 4, 64, dtype=torch.float16)
    k, v = (randn(sum(lens_k), 2, 64, dtype=torch.float16) for _ in range(2))
    firsts = [(lk - lq - left) // bn * bn for lq, lk in zip(lens_q, lens_k, strict=True)]
    assert min(firsts) >= 2 * bn
    ck = cu_k.tolist()
    kp, vp = _poison_before(k, ck, firsts), _poison_before(v, ck, firsts)
    for causal, window in ((True, (left, -1)), (False, (left, 0)), (False, (left, 3))):
        got = prefill(q, kp, vp, cu_q, cu_k, causal=causal, window_size=window)
        ref = prefill_ref(q.double(), k.double(), v.double(), cu_q, cu_k, causal=causal,
                          window_size=window)
        assert rel_err(got, ref) < TOL[torch.float16]


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_window_never_reads_keys_before_it(num_splits: int) -> None:
    lens, left = ([120, 77, 3] if not ON_GPU else [1200, 770, 3]), 25
    bn = decode_config(64, torch.float16, torch.device(DEVICE)).block_n
    cu = cu_seqlens(lens)
    q = randn(3, 4, 64, dtype=torch.float16)
    k, v = (randn(sum(lens), 2, 64, dtype=torch.float16) for _ in range(2))
    firsts = [max(0, (n - 1 - left) // bn * bn) for n in lens]
    assert max(firsts) >= 2 * bn
    kp, vp = _poison_before(k, cu.tolist(), firsts), _poison_before(v, cu.tolist(), firsts)
    got = decode(q, kp, vp, cu, num_splits=num_splits, window_size=(left, -1))
    ref = decode_ref(q.double(), k.double(), v.double(), cu, window_size=(left, -1))
    assert rel_err(got, ref) < TOL[torch.float16]


def test_paged_window_never_reads_pages_before_it() -> None:
    """Table entries of pages wholly before the window's first key block name a NaN page:
    neither those pages nor anything they hold may be used."""
    lens, left, page = ([100, 70] if not ON_GPU else [1000, 700]), 12, 8
    device = torch.device(DEVICE)
    c = Paged(lens, page, 2, 64, torch.float16)
    table = c.block_table.clone()
    nan_page = int(c.block_table[0, -2])  # Paged's spare all-NaN page
    assert torch.isnan(c.k_pages[nan_page]).all()
    bn = paged_decode_config(64, torch.float16, device).block_n
    for b, n in enumerate(lens):
        first_block = (n - 1 - left) // bn * bn  # decode: the window's first key block
        table[b, : first_block // page] = nan_page
    q = randn(2, 4, 64, dtype=torch.float16)
    got = paged_decode(q, c.k_pages, c.v_pages, table, c.seqlens_k, num_splits=3,
                       window_size=(left, -1))
    ref = decode_ref(q.double(), c.k.double(), c.v.double(), c.cu_k, window_size=(left, -1))
    assert rel_err(got, ref) < TOL[torch.float16]
    # Prefill of the last 6 tokens of each sequence: the window starts 5 rows earlier.
    lens_q = [6, 6]
    bn = prefill_config(64, torch.float16, True, device).block_n
    poisoned = 0
    for b, n in enumerate(lens):
        first_block = (n - lens_q[b] - left) // bn * bn
        table[b] = c.block_table[b]
        table[b, : first_block // page] = nan_page
        poisoned += first_block // page
    assert poisoned >= 4
    cu_q = cu_seqlens(lens_q)
    qp = randn(sum(lens_q), 4, 64, dtype=torch.float16)
    got = paged_prefill(qp, c.k_pages, c.v_pages, table, cu_q, c.seqlens_k, causal=True,
                        window_size=(left, -1))
    ref = prefill_ref(qp.double(), c.k.double(), c.v.double(), cu_q, c.cu_k, causal=True,
                      window_size=(left, -1))
    assert rel_err(got, ref) < TOL[torch.float16]


# ---- paged ---------------------------------------------------------------------------------

PAGED_FEATURES = {
    "window": features((9, 2)),
    "softcap": features(softcap=2.0),
    "alibi": features(alibi=slopes(4)),
    "all": features((13, -1), softcap=2.5, alibi=slopes(3, 4)),
}


@pytest.mark.parametrize("feats", list(PAGED_FEATURES.values()), ids=list(PAGED_FEATURES))
@pytest.mark.parametrize("page_tokens", [7, 16], ids=lambda p: f"page{p}")
def test_paged_prefill_features(feats: dict, page_tokens: int) -> None:
    lens_q, lens_k = [9, 20, 0], [30, 20, 5]
    c = Paged(lens_k, page_tokens, 2, 64, torch.float16)
    cu_q = cu_seqlens(lens_q)
    q = randn(sum(lens_q), 4, 64, dtype=torch.float16)
    out, lse = torch.empty_like(q), torch.empty(4, sum(lens_q), device=DEVICE)
    poison_(out)
    poison_(lse)
    got, got_lse = paged_prefill(q, *c.cache, cu_q, c.seqlens_k, causal=True, return_lse=True,
                                 out=out, lse_out=lse, **feats)
    ref, ref_lse = paged_prefill_ref(q.double(), *c.double(), cu_q, c.seqlens_k, causal=True,
                                     return_lse=True, **feats)
    check_out(got, got_lse, ref, ref_lse, torch.float16, lse_rows_first=False)
    # The paged kernel does the contiguous kernel's arithmetic in the same order.
    want, want_lse = prefill(q, c.k, c.v, cu_q, c.cu_k, causal=True, return_lse=True, **feats)
    if not ON_GPU:
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("feats", list(PAGED_FEATURES.values()), ids=list(PAGED_FEATURES))
@pytest.mark.parametrize("page_tokens", [7, 16], ids=lambda p: f"page{p}")
def test_paged_decode_features(feats: dict, page_tokens: int) -> None:
    lens = [45, 0, 17]
    c = Paged(lens, page_tokens, 2, 64, torch.float16)
    q = randn(len(lens), 4, 64, dtype=torch.float16)
    out, lse = torch.empty_like(q), torch.empty(len(lens), 4, device=DEVICE)
    poison_(out)
    poison_(lse)
    got, got_lse = paged_decode(q, *c.cache, c.seqlens_k, num_splits=3, return_lse=True,
                                out=out, lse_out=lse, **feats)
    ref, ref_lse = paged_decode_ref(q.double(), *c.double(), c.seqlens_k, return_lse=True,
                                    **feats)
    check_out(got, got_lse, ref, ref_lse, torch.float16, lse_rows_first=True)
    want, want_lse = decode(q, c.k, c.v, c.cu_k, num_splits=3, return_lse=True, **feats)
    if not ON_GPU:
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


# ---- the reference against an independent construction ------------------------------------

def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens_q: list[int],
              lens_k: list[int], causal: bool, window: tuple[int, int], softcap: float,
              alibi: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention from a mask and a bias written out entry by entry (float64, one head at a
    time), in absolute token positions: query i of a sequence is token lk - lq + i."""
    total_q, heads, d = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(total_q, heads, d, dtype=torch.float64)
    lse = torch.full((heads, total_q), -math.inf, dtype=torch.float64)
    q0 = k0 = 0
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        for h in range(heads):
            slope = 0.0 if alibi is None else float(alibi[h] if alibi.dim() == 1 else alibi[b, h])
            for i in range(lq):
                token = lk - lq + i
                logits, vals = [], []
                for j in range(lk):
                    if causal and j > token:
                        continue
                    if window[0] != -1 and j < token - window[0]:
                        continue
                    if window[1] != -1 and j > token + window[1]:
                        continue
                    s = float(q[q0 + i, h] @ k[k0 + j, h // group]) / math.sqrt(d)
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    logits.append(s - slope * abs(token - j))
                    vals.append(v[k0 + j, h // group])
                if logits:
                    w = torch.tensor(logits, dtype=torch.float64)
                    lse[h, q0 + i] = torch.logsumexp(w, 0)
                    out[q0 + i, h] = torch.softmax(w, 0) @ torch.stack(vals)
        q0, k0 = q0 + lq, k0 + lk
    return out, lse


@pytest.mark.parametrize(
    ("causal", "window", "softcap", "per_batch_alibi"),
    [(False, (3, 1), 0.0, None), (True, (2, -1), 0.0, None), (False, (-1, 0), 1.5, False),
     (True, (4, 7), 2.0, True), (False, (0, -1), 0.0, False)],
)
def test_reference_equals_explicit_mask_and_bias(causal: bool, window: tuple[int, int],
                                                 softcap: float,
                                                 per_batch_alibi: bool | None) -> None:
    g = torch.Generator().manual_seed(3)
    lens_q, lens_k = [5, 9, 0, 3], [8, 6, 2, 3]
    q = torch.randn(sum(lens_q), 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), 2, 8, generator=g, dtype=torch.float64)
    alibi = None
    if per_batch_alibi is not None:
        alibi = torch.rand(*((len(lens_q), 4) if per_batch_alibi else (4,)), generator=g)
    want, want_lse = _explicit(q, k, v, lens_q, lens_k, causal, window, softcap, alibi)
    got, got_lse = prefill_ref(q, k, v, cu_seqlens(lens_q).cpu(), cu_seqlens(lens_k).cpu(),
                               causal=causal, return_lse=True, window_size=window,
                               softcap=softcap, alibi_slopes=alibi)
    assert torch.allclose(got, want, atol=1e-12)
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(want_lse.float()))
    assert torch.allclose(got_lse.double(), want_lse, atol=1e-5)  # lse is float32
    assert torch.isneginf(want_lse).any() or not (causal or window[1] >= 0)


def test_defaults_are_the_plain_semantics() -> None:
    """(-1, -1), softcap 0 and no slopes are exactly the calls without them."""
    lens = [30, 7]
    cu = cu_seqlens(lens)
    q, k, v = (randn(37, 2, 64, dtype=torch.float16) for _ in range(3))
    plain = prefill(q, k, v, cu, causal=True, return_lse=True)
    same = prefill(q, k, v, cu, causal=True, return_lse=True, **features())
    assert all(torch.equal(a, b) for a, b in zip(plain, same, strict=True))
    # A window wider than any sequence is no window (compiled without it).
    wide = prefill(q, k, v, cu, causal=True, return_lse=True, window_size=(10_000, 10_000))
    assert all(torch.equal(a, b) for a, b in zip(plain, wide, strict=True))


# ---- invalid arguments ---------------------------------------------------------------------

BAD_FEATURES = [
    ({"window_size": (1,)}, "window_size must be a pair"),
    ({"window_size": (1, 2, 3)}, "window_size must be a pair"),
    ({"window_size": 4}, "window_size must be a pair"),
    ({"window_size": (1.5, 2)}, "window_size must be a pair"),
    ({"window_size": (True, 0)}, "window_size must be a pair"),
    ({"window_size": (-2, 0)}, "window_size entries must be >= -1"),
    ({"window_size": (0, -3)}, "window_size entries must be >= -1"),
    ({"softcap": -1.0}, "softcap must be a finite number >= 0"),
    ({"softcap": math.nan}, "softcap must be a finite number >= 0"),
    ({"softcap": math.inf}, "softcap must be a finite number >= 0"),
    ({"softcap": "2"}, "softcap must be a finite number >= 0"),
    ({"alibi_slopes": [0.5, 0.5, 0.5, 0.5]}, "alibi_slopes must be a tensor"),
    ({"alibi_slopes": torch.ones(4, dtype=torch.float16)}, "alibi_slopes must be float32"),
    ({"alibi_slopes": torch.ones(4, dtype=torch.float64)}, "alibi_slopes must be float32"),
    ({"alibi_slopes": torch.ones(5)}, "alibi_slopes must be \\[num_heads=4\\]"),
    ({"alibi_slopes": torch.ones(3, 4)}, "\\[batch=2, num_heads=4\\]"),
    ({"alibi_slopes": torch.ones(2, 4, 1)}, "alibi_slopes must be"),
    ({"alibi_slopes": torch.ones(4, device="meta")}, "alibi_slopes is on meta"),
]


def _calls() -> dict[str, tuple]:
    """Each public function with valid arguments for a batch of 2, 4 query heads."""
    c = Paged([9, 4], 7, 2, 64, torch.float16)
    q = randn(2, 4, 64, dtype=torch.float16)
    cu = cu_seqlens([1, 1])
    kd = {"q": q, "k": c.k, "v": c.v}
    pd = {"q": q, "k_pages": c.k_pages, "v_pages": c.v_pages, "block_table": c.block_table,
          "seqlens_k": c.seqlens_k}
    return {
        "prefill": (prefill, {**kd, "cu_seqlens_q": cu, "cu_seqlens_k": c.cu_k}),
        "prefill_ref": (prefill_ref, {**kd, "cu_seqlens_q": cu, "cu_seqlens_k": c.cu_k}),
        "decode": (decode, {**kd, "cu_seqlens_k": c.cu_k}),
        "decode_ref": (decode_ref, {**kd, "cu_seqlens_k": c.cu_k}),
        "paged_prefill": (paged_prefill, {**pd, "cu_seqlens_q": cu}),
        "paged_prefill_ref": (paged_prefill_ref, {**pd, "cu_seqlens_q": cu}),
        "paged_decode": (paged_decode, pd),
        "paged_decode_ref": (paged_decode_ref, pd),
    }


def test_bad_feature_arguments_raise() -> None:
    calls = _calls()
    for name, (fn, args) in calls.items():
        for change, match in BAD_FEATURES:
            change = {k: (t.to(DEVICE) if isinstance(t, torch.Tensor) and t.device.type != "meta"
                          else t) for k, t in change.items()}
            with pytest.raises(ValueError, match=match):
                fn(**args, **change)
                pytest.fail(f"{name} accepted {change}")
        # Valid feature arguments pass (window entries of -1 and 0, int softcap, [B, H]).
        fn(**args, window_size=[-1, 0], softcap=3, alibi_slopes=slopes(2, 4))


def test_references_reject_non_finite_slopes() -> None:
    # The kernels trust slope values (a check would be a host sync on the GPU); the references,
    # which read everything on the host anyway, check them.
    bad = slopes(4)
    bad[1] = math.inf
    for name, (fn, args) in _calls().items():
        if name.endswith("_ref"):
            with pytest.raises(ValueError, match="alibi_slopes must be finite"):
                fn(**args, alibi_slopes=bad)


def test_decode_config_other_than_default_with_window() -> None:
    # 32-key blocks: the window's first block is masked below its left edge in split 0 only.
    lens = [130, 40]
    cu = cu_seqlens(lens)
    q = randn(2, 4, 64, dtype=torch.float16)
    k, v = (randn(sum(lens), 2, 64, dtype=torch.float16) for _ in range(2))
    for left in (0, 33, 50):
        got, lse = decode(q, k, v, cu, num_splits=3, window_size=(left, -1), return_lse=True,
                          _config=DecodeConfig(32, 4, 1))
        ref, ref_lse = decode_ref(q.double(), k.double(), v.double(), cu, return_lse=True,
                                  window_size=(left, -1))
        assert rel_err(got, ref) < TOL[torch.float16]
        check_lse(lse, ref_lse, torch.float16)
