"""The cpu backend's tiled attention (engine/cpu_attention.py) against the float64 reference:
odd lengths, empty sequences, bottom-right causal with more queries than keys, GQA ratios,
tiles small enough to split rows and keys; its scratch bounded by the tile size whatever the
heads ratio; a cancel honoured within a tile; short sequences in batches by padded shape, each
with the bits it has alone."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from attention_kernels import prefill_ref
from attention_service.engine import cpu_attention
from attention_service.engine.cpu_attention import attend
from attention_service.errors import Cancelled

pytestmark = pytest.mark.timeout(120)


def _cu(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (8, 2), (16, 1)])
@pytest.mark.parametrize("tile", [7, 64, 1 << 21])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_attention_matches_the_reference(causal: bool, heads: int, kv_heads: int,
                                               tile: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(heads * 31 + tile)
    len_q, len_k = [1, 0, 37, 5, 19], [1, 4, 37, 0, 3]  # q > k (causal: rows see nothing)
    cu_q, cu_k = _cu(len_q), _cu(len_k)
    q = torch.randn(cu_q[-1], heads, 24, generator=g).to(dtype)
    k = torch.randn(cu_k[-1], kv_heads, 24, generator=g).to(dtype)
    v = torch.randn(cu_k[-1], kv_heads, 24, generator=g).to(dtype)
    never = threading.Event()
    out, lse = attend(q, k, v, cu_q, cu_k, causal=causal, scale=None, cancelled=never.is_set,
                      tile_elements=tile)
    ref, ref_lse = prefill_ref(q.double(), k.double(), v.double(),
                               torch.tensor(cu_q, dtype=torch.int32),
                               torch.tensor(cu_k, dtype=torch.int32), causal=causal,
                               return_lse=True)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=1e-4, rtol=1e-4)


def test_scratch_stays_within_a_tile_whatever_the_heads_ratio(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # 256 query heads over one kv head, 2048 keys: the reference would score 256 x 2048 per
    # row and expand K/V 256 times.
    largest = [0]
    real = torch.einsum

    def spy(eq: str, *ops: torch.Tensor) -> torch.Tensor:
        res = real(eq, *ops)
        largest[0] = max(largest[0], res.numel())
        return res

    monkeypatch.setattr(cpu_attention.torch, "einsum", spy)
    q = torch.randn(64, 256, 8)
    k, v = torch.randn(2048, 1, 8), torch.randn(2048, 1, 8)
    attend(q, k, v, [0, 64], [0, 2048], causal=True, scale=None, cancelled=threading.Event().is_set,
           tile_elements=1 << 14)
    assert 0 < largest[0] <= 1 << 14
    # Short sequences in batches: as many a batch as fit in a tile.
    largest[0] = 0
    real_bmm = torch.bmm
    monkeypatch.setattr(cpu_attention.torch, "bmm",
                        lambda *ops: _largest(largest, real_bmm(*ops)))
    q, k = torch.randn(300, 16, 8), torch.randn(300 * 9, 2, 8)
    attend(q, k, k, list(range(301)), list(range(0, 301 * 9, 9)), causal=False, scale=None,
           cancelled=threading.Event().is_set, tile_elements=1 << 10)
    assert 16 * 16 <= largest[0] <= 1 << 10  # 16 heads x 16 keys (9 padded) a sequence


def _largest(largest: list[int], res: torch.Tensor) -> torch.Tensor:
    largest[0] = max(largest[0], res.numel())
    return res


def test_a_cancel_stops_a_long_sequence_within_a_tile() -> None:
    q = torch.randn(4096, 8, 64)
    k, v = torch.randn(8192, 8, 64), torch.randn(8192, 8, 64)
    cancel = threading.Event()
    timer = threading.Timer(0.2, cancel.set)
    timer.start()
    t0 = time.perf_counter()
    with pytest.raises(Cancelled):
        attend(q, k, v, [0, 4096], [0, 8192], causal=False, scale=None, cancelled=cancel.is_set,
               tile_elements=1 << 18)
    assert time.perf_counter() - t0 < 1.5  # the whole sequence takes several seconds


@pytest.mark.parametrize("seed", range(6))
def test_window_softcap_and_alibi_match_the_reference(seed: int) -> None:
    # Random lengths (q longer than k too), windows, softcap and per-sequence ALiBi slopes,
    # in tiles small enough that the window's skipped and partial tiles both occur.
    import random

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(8):
        batch, heads, kv_heads = rng.randint(1, 3), 4, rng.choice([1, 2, 4])
        len_q = [rng.randint(0, 19) for _ in range(batch)]
        len_k = [rng.randint(0, 23) for _ in range(batch)]
        cu_q, cu_k = _cu(len_q), _cu(len_k)
        causal = rng.random() < 0.5
        window = (rng.randint(-1, 7), rng.randint(-1, 7))
        softcap = rng.choice([0.0, 1.5])
        slopes = torch.rand(batch, heads, generator=g) if rng.random() < 0.5 else None
        q = torch.randn(cu_q[-1], heads, 16, generator=g)
        k = torch.randn(cu_k[-1], kv_heads, 16, generator=g)
        v = torch.randn(cu_k[-1], kv_heads, 16, generator=g)
        out, lse = attend(q, k, v, cu_q, cu_k, causal=causal, scale=None,
                          cancelled=threading.Event().is_set, window=window, softcap=softcap,
                          alibi_slopes=slopes, tile_elements=rng.choice([5, 48, 1 << 21]))
        ref, ref_lse = prefill_ref(
            q.double(), k.double(), v.double(), torch.tensor(cu_q, dtype=torch.int32),
            torch.tensor(cu_k, dtype=torch.int32), causal=causal, return_lse=True,
            window_size=window, softcap=softcap, alibi_slopes=slopes)
        assert not out.isnan().any() and not lse.isnan().any()
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), ref_lse.double(), atol=1e-4, rtol=1e-4)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("seed", range(4))
def test_short_sequences_go_in_batches_and_match_the_reference(
        seed: int, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Decode steps (one row each) and short prompts, empty sequences and q longer than k
    # among them, with every score option: two products per padded shape (powers of two of
    # rows and keys), the padding never seen; each sequence alone gives the same bits.
    import random

    rng = random.Random(100 + seed)
    g = torch.Generator().manual_seed(100 + seed)
    calls = [0]
    real = torch.bmm

    def spy(*ops: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return real(*ops)

    monkeypatch.setattr(cpu_attention.torch, "bmm", spy)
    for decode in (True, False):
        batch, heads, kv_heads = rng.randint(1, 70), 8, rng.choice([1, 2, 8])
        len_q = [1] * batch if decode else [rng.randint(0, 9) for _ in range(batch)]
        len_k = [rng.randint(0 if not decode else 1, 40) for _ in range(batch)]
        cu_q, cu_k = _cu(len_q), _cu(len_k)
        opts = {"causal": not decode and rng.random() < 0.5, "scale": 0.3,
                "window": (rng.randint(-1, 9), rng.randint(-1, 9)) if rng.random() < 0.5
                else (-1, -1), "softcap": rng.choice([0.0, 2.0])}
        slopes = torch.rand(batch, heads, generator=g) if rng.random() < 0.5 else None
        dtype = rng.choice([torch.float32, torch.bfloat16])
        q = torch.randn(cu_q[-1], heads, 16, generator=g).to(dtype)
        k = torch.randn(cu_k[-1], kv_heads, 16, generator=g).to(dtype)
        v = torch.randn(cu_k[-1], kv_heads, 16, generator=g).to(dtype)
        calls[0] = 0
        never = threading.Event().is_set
        out, lse = attend(q, k, v, cu_q, cu_k, cancelled=never, alibi_slopes=slopes, **opts)
        shapes = {(_pow2(a), _pow2(b)) for a, b in zip(len_q, len_k, strict=True) if a and b}
        assert calls[0] == 2 * len(shapes)
        ref, ref_lse = prefill_ref(
            q.double(), k.double(), v.double(), torch.tensor(cu_q, dtype=torch.int32),
            torch.tensor(cu_k, dtype=torch.int32), causal=opts["causal"], return_lse=True,
            softmax_scale=0.3, window_size=opts["window"], softcap=opts["softcap"],
            alibi_slopes=slopes)
        tol = 1e-5 if dtype == torch.float32 else 1.6e-2
        assert out.dtype == dtype and not out.isnan().any() and not lse.isnan().any()
        torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), ref_lse.double(), atol=1e-4, rtol=1e-4)
        for b in rng.sample(range(batch), min(batch, 6)):
            qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            alone, alone_lse = attend(
                q[qs], k[ks], v[ks], [0, len_q[b]], [0, len_k[b]], cancelled=never,
                alibi_slopes=None if slopes is None else slopes[b : b + 1], **opts)
            assert torch.equal(alone, out[qs]) and torch.equal(alone_lse, lse[:, qs])


def test_a_cancel_before_a_batch_of_short_sequences_stops_it() -> None:
    q, k = torch.randn(4, 2, 8), torch.randn(12, 2, 8)
    with pytest.raises(Cancelled):
        attend(q, k, k, [0, 1, 2, 3, 4], [0, 3, 6, 9, 12], causal=False, scale=None,
               cancelled=lambda: True)
