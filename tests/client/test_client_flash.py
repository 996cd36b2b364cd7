"""attention_client.flash against the real cpu server: flash_attn's and torch varlen_attn's
signatures and semantics (window, softcap, ALiBi included) vs the float64 reference, the
refusals, and the custom op under torch.compile."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
attention_kernels = pytest.importorskip("attention_kernels")

from attention_client import (  # noqa: E402
    AttentionClient,
    AttentionInputError,
    flash,  # noqa: E402
)

# flash_attn 2.x, in order (flash_attn/flash_attn_interface.py).
FLASH_VARLEN_ARGS = [
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
    "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
    "return_attn_probs", "block_table",
]
# flash_attn 2.x's flash_attn_with_kvcache, in order.
KVCACHE_ARGS = [
    "q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
    "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal", "window_size",
    "softcap", "rotary_interleaved", "alibi_slopes", "num_splits", "return_softmax_lse",
]
FLASH_ARGS = [
    "q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
    "alibi_slopes", "deterministic", "return_attn_probs",
]


@pytest.fixture(scope="module")
def client(server):  # type: ignore[no-untyped-def]
    with AttentionClient(server.target, timeout=60) as c:
        flash.set_client(c)
        yield c
        flash.set_client(None)


def _ref(q, k, v, cu_q, cu_k, **kw):  # type: ignore[no-untyped-def]
    out = attention_kernels.prefill_ref(q.double(), k.double(), v.double(), cu_q, cu_k, **kw)
    return out.float()


def _packed(lens_q, lens_k, heads=4, kv_heads=2, dim=16, seed=0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads, dim, generator=g)
    k = torch.randn(int(cu_k[-1]), kv_heads, dim, generator=g)
    v = torch.randn(int(cu_k[-1]), kv_heads, dim, generator=g)
    return q, k, v, cu_q, cu_k


def test_signatures_match_flash_attn() -> None:
    assert list(inspect.signature(flash.flash_attn_varlen_func).parameters)[:16] == (
        FLASH_VARLEN_ARGS)
    assert list(inspect.signature(flash.flash_attn_func).parameters)[:11] == FLASH_ARGS
    assert list(inspect.signature(flash.flash_attn_with_kvcache).parameters)[:19] == KVCACHE_ARGS
    # The packed forms: their packed tensors first, then the same arguments.
    tail = FLASH_ARGS[3:]
    for fn, head in ((flash.flash_attn_qkvpacked_func, ["qkv"]),
                     (flash.flash_attn_kvpacked_func, ["q", "kv"]),
                     (flash.flash_attn_varlen_qkvpacked_func, ["qkv", "cu_seqlens", "max_seqlen"]),
                     (flash.flash_attn_varlen_kvpacked_func,
                      ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                       "max_seqlen_k"])):
        assert list(inspect.signature(fn).parameters)[:len(head) + len(tail)] == head + tail
    defaults = {n: p.default for n, p in
                inspect.signature(flash.flash_attn_varlen_func).parameters.items()}
    assert defaults["dropout_p"] == 0.0 and defaults["causal"] is False
    assert defaults["window_size"] == (-1, -1) and defaults["softcap"] == 0.0
    assert defaults["alibi_slopes"] is None and defaults["return_attn_probs"] is False


@pytest.mark.parametrize(("causal", "window", "softcap", "alibi"), [
    (False, (-1, -1), 0.0, False),
    (True, (-1, -1), 0.0, False),
    (True, (5, 0), 0.0, True),
    (False, (3, 2), 1.5, False),
    (True, (-1, -1), 2.0, True),
])
def test_flash_attn_varlen_func_positional_like_flash_attn(client, causal, window, softcap,  # type: ignore[no-untyped-def]
                                                           alibi) -> None:
    q, k, v, cu_q, cu_k = _packed([7, 1, 12], [9, 4, 12])
    slopes = torch.rand(4) if alibi else None
    out = flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, 0.0, None, causal, window,
                                       softcap, slopes)
    want = _ref(q, k, v, cu_q, cu_k, causal=causal, window_size=window, softcap=softcap,
                alibi_slopes=slopes)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_flash_attn_func_dense_batch(client) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 6, h, 8, generator=g) for h in (4, 1, 1))
    out = flash.flash_attn_func(q, k, v, causal=True, window_size=(2, 0))
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    want = _ref(q.reshape(12, 4, 8), k.reshape(12, 1, 8), v.reshape(12, 1, 8), cu, cu,
                causal=True, window_size=(2, 0))
    torch.testing.assert_close(out, want.reshape(2, 6, 4, 8), atol=1e-5, rtol=1e-5)


def test_torch_varlen_attn_causal_window_lse_and_seqused(client) -> None:  # type: ignore[no-untyped-def]
    from torch.nn.attention.varlen import AuxRequest

    q, k, v, cu_q, cu_k = _packed([5, 8], [5, 8], heads=2, kv_heads=2)
    out, lse = flash.varlen_attn(q, k, v, cu_q, cu_k, 8, 8, window_size=(-1, 0),
                                 return_aux=AuxRequest(lse=True))
    want, want_lse = attention_kernels.prefill_ref(q.double(), k.double(), v.double(), cu_q,
                                                   cu_k, causal=True, return_lse=True)
    torch.testing.assert_close(out, want.float(), atol=1e-5, rtol=1e-5)
    assert lse.shape == (13, 2)  # torch's [T_q, H]
    torch.testing.assert_close(lse, want_lse.float().t(), atol=1e-4, rtol=1e-4)
    # seqused_k: only the first 3 and 6 keys of each sequence take part.
    used = torch.tensor([3, 6], dtype=torch.int32)
    out = flash.varlen_attn(q, k, v, cu_q, cu_k, 8, 8, seqused_k=used)
    keep = torch.cat([torch.arange(0, 3), torch.arange(5, 11)])
    want = _ref(q, k[keep], v[keep], cu_q, torch.tensor([0, 3, 9], dtype=torch.int32))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(AttentionInputError, match="enable_gqa"):
        flash.varlen_attn(q, k[:, :1], v[:, :1], cu_q, cu_k, 8, 8)
    # An empty batch with seqused_k: an empty result.
    none = torch.zeros(1, dtype=torch.int32)
    out = flash.varlen_attn(q[:0], k[:0], v[:0], none, none, 0, 0,
                            seqused_k=torch.zeros(0, dtype=torch.int32))
    assert out.shape == (0, 2, q.shape[2])


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"dropout_p": 0.1}, "dropout_p"),
    ({"dropout_p": 0.1, "return_attn_probs": True}, "dropout_p"),
])
def test_what_a_remote_op_cannot_do_is_refused_by_name(kwargs, name) -> None:  # type: ignore[no-untyped-def]
    q, k, v, cu_q, cu_k = _packed([3], [3])
    with pytest.raises(NotImplementedError, match=f"^{name}: "):
        flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, **kwargs)


def test_return_attn_probs_gives_flash_attns_out_lse_none(client) -> None:  # type: ignore[no-untyped-def]
    """flash_attn's return form: (out, softmax_lse, None), lse float32 in its shapes: [H,
    total_q] for varlen, [B, H, N_q] for the dense batch; both against the float64 reference."""
    q, k, v, cu_q, cu_k = _packed([5, 2, 9], [7, 2, 9], seed=3)
    out, lse, probs = flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=True,
                                                   return_attn_probs=True)
    want, want_lse = attention_kernels.prefill_ref(q.double(), k.double(), v.double(), cu_q,
                                                   cu_k, causal=True, return_lse=True)
    assert probs is None and lse.dtype == torch.float32 and lse.shape == (4, 16)
    torch.testing.assert_close(out, want.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse.double(), atol=1e-4, rtol=1e-4)
    g = torch.Generator().manual_seed(4)
    qd, kd, vd = (torch.randn(3, 5, h, 8, generator=g) for h in (4, 2, 2))
    out, lse, probs = flash.flash_attn_func(qd, kd, vd, return_attn_probs=True)
    cu = torch.tensor([0, 5, 10, 15], dtype=torch.int32)
    want, want_lse = attention_kernels.prefill_ref(
        qd.reshape(15, 4, 8).double(), kd.reshape(15, 2, 8).double(),
        vd.reshape(15, 2, 8).double(), cu, cu, return_lse=True)
    assert probs is None and lse.shape == (3, 4, 5)
    torch.testing.assert_close(out, want.float().reshape(3, 5, 4, 8), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse.double().reshape(4, 3, 5).transpose(0, 1),
                               atol=1e-4, rtol=1e-4)


def test_inputs_that_require_grad_are_refused_unless_grad_is_off(client) -> None:  # type: ignore[no-untyped-def]
    """The op is forward-only: an input requiring grad is refused at the call, naming it (not
    at backward()); under no_grad the same call runs and its output claims no grad."""
    q, k, v, cu_q, cu_k = _packed([4], [4])
    for name in ("q", "k", "v"):
        args = {"q": q, "k": k, "v": v}
        args[name] = args[name].clone().requires_grad_(True)
        with pytest.raises(NotImplementedError, match=f"^{name}.requires_grad: .*forward-only"):
            flash.flash_attn_varlen_func(args["q"], args["k"], args["v"], cu_q, cu_k, 4, 4)
    slopes = torch.rand(4, requires_grad=True)
    with pytest.raises(NotImplementedError, match="^alibi_slopes.requires_grad"):
        flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 4, alibi_slopes=slopes)
    with pytest.raises(NotImplementedError, match="^q.requires_grad"):
        flash.flash_attn_func(q[None].clone().requires_grad_(True), k[None], v[None])
    with pytest.raises(NotImplementedError, match="^query.requires_grad|^q.requires_grad"):
        flash.varlen_attn(q.clone().requires_grad_(True), k, v, cu_q, cu_k, 4, 4,
                          enable_gqa=True)
    with torch.no_grad():
        out = flash.flash_attn_varlen_func(q.clone().requires_grad_(True), k, v, cu_q, cu_k,
                                           4, 4)
    assert not out.requires_grad
    torch.testing.assert_close(out, _ref(q, k, v, cu_q, cu_k), atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_input_errors_in_the_callers_names(client) -> None:  # type: ignore[no-untyped-def]
    q, k, v, cu_q, cu_k = _packed([4, 6], [4, 6])
    with pytest.raises(AttentionInputError, match="max_seqlen_q"):
        flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6)
    for bad in (6.0, True, "6", torch.tensor([6, 6]), torch.tensor(6.0)):  # not one integer
        with pytest.raises(AttentionInputError, match="max_seqlen_k must be an int"):
            flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, bad)
    # Integers as flash_attn takes them: numpy's, a 0-d tensor (``seqlens.max()``).
    ref = _ref(q, k, v, cu_q, cu_k)
    for n in (np.int64(6), torch.tensor(7, dtype=torch.int32)):
        out = flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, n, n)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(AttentionInputError, match=r"window_size\[0\]"):
        flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, window_size=(-3, 0))
    with pytest.raises(AttentionInputError, match="alibi_slopes"):
        flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, alibi_slopes=torch.ones(3))


def test_custom_op_runs_under_torch_compile(client) -> None:  # type: ignore[no-untyped-def]
    q, k, v, cu_q, cu_k = _packed([6, 9], [6, 9])

    def layer(x: torch.Tensor) -> torch.Tensor:
        y = flash.flash_attn_varlen_func(x * 2, k, v, cu_q, cu_k, 9, 9, causal=True,
                                         window_size=(4, 0))
        return y + 1

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    got = compiled(q)
    want = _ref(q * 2, k, v, cu_q, cu_k, causal=True, window_size=(4, 0)) + 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_no_client_no_target_says_how_to_set_one(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(flash, "_default", None)
    monkeypatch.delenv("ATTENTION_TARGET", raising=False)
    q, k, v, cu_q, cu_k = _packed([2], [2])
    with pytest.raises(RuntimeError, match="ATTENTION_TARGET"):
        flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 2)


def test_client_decode_and_cache_calls_take_score_options(client) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 16, generator=g)
    k = torch.randn(20, 2, 16, generator=g)
    v = torch.randn(20, 2, 16, generator=g)
    cu = torch.tensor([0, 12, 20], dtype=torch.int32)
    slopes = torch.rand(2, 4, generator=g)
    out = client.decode(q, k, v, cu, window_size=(5, -1), softcap=3.0, alibi_slopes=slopes)
    want = attention_kernels.decode_ref(q.double(), k.double(), v.double(), cu,
                                        window_size=(5, -1), softcap=3.0, alibi_slopes=slopes)
    torch.testing.assert_close(out, want.float(), atol=1e-5, rtol=1e-5)
    with client.kv_cache(2, 16, torch.float32) as cache:
        cache.append(["s0", "s1"], k, v, cu)
        out = cache.decode(q, ["s0", "s1"], window_size=(5, -1), alibi_slopes=slopes[0])
        want = attention_kernels.decode_ref(q.double(), k.double(), v.double(), cu,
                                            window_size=(5, -1), alibi_slopes=slopes[0])
        torch.testing.assert_close(out, want.float(), atol=1e-5, rtol=1e-5)
        out = client.decode_step(q, ["s0", "s1"], softcap=2.0, store=False)
        want = attention_kernels.decode_ref(q.double(), k.double(), v.double(), cu, softcap=2.0)
        torch.testing.assert_close(out, want.float(), atol=1e-5, rtol=1e-5)
        with pytest.raises(AttentionInputError, match="alibi_slopes must have shape"):
            cache.decode(q, ["s0", "s1"], alibi_slopes=torch.ones(3, 4))


def test_the_client_made_from_the_environment_closes_quietly_at_exit(server) -> None:  # type: ignore[no-untyped-def]
    """A script that only sets ATTENTION_TARGET: its answer, and nothing on stderr at exit
    (an unclosed stream can print "Exception ignored in ... _Rendezvous.__del__"; not
    reproduced here with grpcio 1.85.3, so this guards the exit rather than shows a fix)."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from attention_client.flash import flash_attn_varlen_func\n"
        "q, k = torch.randn(8, 4, 16), torch.randn(8, 2, 16)\n"
        "cu = torch.tensor([0, 8], dtype=torch.int32)\n"
        "print(tuple(flash_attn_varlen_func(q, k, k, cu, cu, 8, 8, causal=True).shape))\n"
    )
    env = {**os.environ, "ATTENTION_TARGET": server.target}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(8, 4, 16)"
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def _kvcache_ref(q, keys, values, causal):  # type: ignore[no-untyped-def]
    """out [B, S_q, H, D] and lse [B, H, S_q] over each sequence's keys (lists), float64."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        cu_q = torch.tensor([0, q.shape[1]], dtype=torch.int32)
        cu_k = torch.tensor([0, keys[b].shape[0]], dtype=torch.int32)
        o, lse = attention_kernels.prefill_ref(q[b].double(), keys[b].double(),
                                               values[b].double(), cu_q, cu_k, causal=causal,
                                               return_lse=True)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("s_q", [1, 3])
def test_flash_attn_with_kvcache_writes_in_place_and_attends(client, s_q) -> None:  # type: ignore[no-untyped-def]
    """The new k/v land in the caller's cache at cache_seqlens (rows by cache_batch_idx),
    nothing else in the cache changes, and out/lse match the reference over each sequence's
    keys from cache_leftpad to its new end (causal: the queries are the last positions)."""
    g = torch.Generator().manual_seed(7)
    k_cache = torch.randn(4, 20, 2, 16, generator=g)
    v_cache = torch.randn(4, 20, 2, 16, generator=g)
    q = torch.randn(2, s_q, 4, 16, generator=g)
    k = torch.randn(2, s_q, 2, 16, generator=g)
    v = torch.randn(2, s_q, 2, 16, generator=g)
    seqlens = torch.tensor([5, 11], dtype=torch.int32)
    batch_idx = torch.tensor([3, 1], dtype=torch.int32)
    leftpad = torch.tensor([0, 4], dtype=torch.int32)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out, lse = flash.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, cache_batch_idx=batch_idx,
        cache_leftpad=leftpad, causal=True, return_softmax_lse=True)
    expect_k, expect_v = before_k.clone(), before_v.clone()
    for b, (row, n) in enumerate(zip((3, 1), (5, 11), strict=True)):
        expect_k[row, n : n + s_q] = k[b]
        expect_v[row, n : n + s_q] = v[b]
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    keys = [expect_k[3, 0 : 5 + s_q], expect_k[1, 4 : 11 + s_q]]
    values = [expect_v[3, 0 : 5 + s_q], expect_v[1, 4 : 11 + s_q]]
    want, want_lse = _kvcache_ref(q, keys, values, causal=True)
    assert out.shape == q.shape and lse.shape == (2, 4, s_q) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse.double(), atol=1e-4, rtol=1e-4)


def test_flash_attn_with_kvcache_paged_and_without_new_tokens(client) -> None:  # type: ignore[no-untyped-def]
    """flash_attn's paged layout: caches [num_blocks, block_size, H_kv, D] and block_table
    [B, max_blocks]; a new token crosses into its sequence's next page; then a call without
    new tokens reads the cache as it is (cache_seqlens as an int)."""
    g = torch.Generator().manual_seed(8)
    k_cache = torch.randn(6, 4, 2, 16, generator=g)
    v_cache = torch.randn(6, 4, 2, 16, generator=g)
    table = torch.tensor([[5, 0, 2], [1, 3, 4]], dtype=torch.int32)
    q = torch.randn(2, 1, 4, 16, generator=g)
    k, v = torch.randn(2, 1, 2, 16, generator=g), torch.randn(2, 1, 2, 16, generator=g)
    seqlens = torch.tensor([4, 6], dtype=torch.int32)  # sequence 0's token starts page 0
    out = flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                        block_table=table)
    assert torch.equal(k_cache[0, 0], k[0, 0]) and torch.equal(v_cache[3, 2], v[1, 0])

    def keys(cache, b, n):  # type: ignore[no-untyped-def]
        return torch.cat([cache[int(p)] for p in table[b]])[:n]

    want, _ = _kvcache_ref(q, [keys(k_cache, 0, 5), keys(k_cache, 1, 7)],
                           [keys(v_cache, 0, 5), keys(v_cache, 1, 7)], causal=False)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    snapshot = k_cache.clone()
    out = flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5,
                                        block_table=table, softcap=3.0)
    assert torch.equal(k_cache, snapshot)
    want = []
    for b in range(2):
        cu = torch.tensor([0, 1], dtype=torch.int32)
        cu_k = torch.tensor([0, 5], dtype=torch.int32)
        want.append(attention_kernels.prefill_ref(
            q[b].double(), keys(k_cache, b, 5).double(), keys(v_cache, b, 5).double(), cu,
            cu_k, softcap=3.0))
    torch.testing.assert_close(out.double(), torch.stack(want), atol=1e-5, rtol=1e-5)


def test_flash_attn_with_kvcache_in_fp8_with_descales(client) -> None:  # type: ignore[no-untyped-def]
    """FP8 q and caches with FlashAttention-3's descales: the new FP8 tokens land in the
    caller's cache, and the bfloat16 output matches float64 on the dequantized keys; a
    descale on 16-bit inputs is an input error."""
    from attention_kernels.fp8 import dequantize_queries, quantize_queries

    g = torch.Generator().manual_seed(9)
    k_cache8, ks = attention_kernels.quantize_kv(torch.randn(2, 12, 2, 16, generator=g))
    v_cache8, vs = attention_kernels.quantize_kv(torch.randn(2, 12, 2, 16, generator=g))
    q8, qs = quantize_queries(torch.randn(2, 4, 16, generator=g), 2)
    k8, _ = attention_kernels.quantize_kv(torch.randn(2, 2, 16, generator=g), ks)
    v8, _ = attention_kernels.quantize_kv(torch.randn(2, 2, 16, generator=g), vs)
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    out = flash.flash_attn_with_kvcache(q8[:, None], k_cache8, v_cache8, k8[:, None],
                                        v8[:, None], cache_seqlens=seqlens, q_descale=qs,
                                        k_descale=ks, v_descale=vs, client=client)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 1, 4, 16)
    assert torch.equal(k_cache8[1, 9].view(torch.uint8), k8[1].view(torch.uint8))
    deq = dequantize_queries(q8, qs, 2, torch.float64)
    keys = [attention_kernels.dequantize_kv(k_cache8[b, : n + 1], ks, torch.float64)
            for b, n in enumerate((3, 9))]
    values = [attention_kernels.dequantize_kv(v_cache8[b, : n + 1], vs, torch.float64)
              for b, n in enumerate((3, 9))]
    want, _ = _kvcache_ref(deq[:, None], keys, values, causal=False)
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < 2e-2, err
    with pytest.raises(AttentionInputError, match="q_descale is for float8_e4m3fn q"):
        flash.flash_attn_with_kvcache(deq[:, None].bfloat16(), k_cache8, v_cache8,
                                      cache_seqlens=4, q_descale=qs, k_descale=ks,
                                      v_descale=vs, client=client)


def test_packed_forms_equal_the_unpacked_calls(client) -> None:  # type: ignore[no-untyped-def]
    """flash_attn's packed layouts (qkv [B, S, 3, H, D] / [total, 3, H, D], kv with 2): the
    same answers as the unpacked calls on the same values (those are checked against float64
    above); a wrongly packed tensor is refused naming it."""
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(2, 6, 3, 4, 16, generator=g)
    q, k, v = qkv.unbind(2)
    torch.testing.assert_close(flash.flash_attn_qkvpacked_func(qkv, causal=True),
                               flash.flash_attn_func(q, k, v, causal=True), atol=0, rtol=0)
    kv = torch.randn(2, 9, 2, 2, 16, generator=g)
    out, lse, _ = flash.flash_attn_kvpacked_func(q, kv, return_attn_probs=True)
    want, want_lse, _ = flash.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], return_attn_probs=True)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    qp, kp, vp, cu_q, cu_k = _packed([5, 2, 9], [5, 2, 9], seed=12)
    qkv_v = torch.stack([qp, qp.roll(1, 0), qp.roll(2, 0)], 1)  # [total, 3, H, D]
    torch.testing.assert_close(
        flash.flash_attn_varlen_qkvpacked_func(qkv_v, cu_q, 9, causal=True),
        flash.flash_attn_varlen_func(*qkv_v.unbind(1), cu_q, cu_q, 9, 9, causal=True),
        atol=0, rtol=0)
    torch.testing.assert_close(
        flash.flash_attn_varlen_kvpacked_func(qp, torch.stack([kp, vp], 1), cu_q, cu_k, 9, 9),
        flash.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 9, 9), atol=0, rtol=0)
    with pytest.raises(AttentionInputError, match="^qkv must be 5-D with 3 at dim 2"):
        flash.flash_attn_qkvpacked_func(kv)
    with pytest.raises(AttentionInputError, match="^kv must be 4-D with 2 at dim 1"):
        flash.flash_attn_varlen_kvpacked_func(qp, qkv_v, cu_q, cu_k, 9, 9)


def test_a_query_that_sees_no_key_has_flash_attns_lse(client) -> None:  # type: ignore[no-untyped-def]
    """Causal with more queries than keys (bottom-right aligned): the first queries see no
    key; their output is 0 and their lse +inf, flash_attn 2's value (the service's is -inf)."""
    g = torch.Generator().manual_seed(13)
    q, k = torch.randn(1, 7, 2, 8, generator=g), torch.randn(1, 3, 2, 8, generator=g)
    out, lse, _ = flash.flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
    assert bool((out[0, :4] == 0).all()) and bool((lse[0, :, :4] == float("inf")).all())
    assert bool(lse[0, :, 4:].isfinite().all())
    cache = torch.randn(1, 8, 2, 8, generator=g)
    _, lse = flash.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=3, causal=True,
                                           return_softmax_lse=True)
    assert bool((lse[0, :, :4] == float("inf")).all()) and bool(lse[0, :, 4:].isfinite().all())


def test_refused_kvcache_calls_leave_the_cache_as_it_was() -> None:
    """Every input is checked before the new k/v are written (and they are written only once
    the call succeeded): each refusal names its argument and the caches keep their bytes."""
    g = torch.Generator().manual_seed(14)
    q, new = torch.randn(2, 1, 4, 16, generator=g), torch.randn(2, 1, 2, 16, generator=g)
    dense = torch.randn(3, 8, 2, 16, generator=g)
    pages = torch.randn(5, 4, 2, 16, generator=g)
    cases = [
        ("block_table names block 7", pages, dict(
            cache_seqlens=5, block_table=torch.tensor([[0, 1], [2, 7]], dtype=torch.int32))),
        ("q .* must have k_cache's head dim and a multiple of its heads", dense,
         dict(cache_seqlens=2, q=torch.randn(2, 1, 3, 16))),
        ("cache_batch_idx must name rows of k_cache", dense,
         dict(cache_seqlens=2, cache_batch_idx=torch.tensor([0, -1]))),
        ("cache_batch_idx must name rows of k_cache", dense,
         dict(cache_seqlens=2, cache_batch_idx=torch.tensor([0, 3]))),
        ("cache_batch_idx must be an integer tensor of shape", dense,
         dict(cache_seqlens=2, cache_batch_idx=torch.tensor([0.0, 1.0]))),
        ("cache_batch_idx must be an integer tensor of shape", dense,
         dict(cache_seqlens=2, cache_batch_idx=torch.tensor([0]))),
        ("k_cache has 1 rows for a batch of 2", dense[:1], dict(cache_seqlens=2)),
        ("k and v must have k_cache's heads, head dim and dtype", dense,
         dict(cache_seqlens=2, k=new[:, :, :1], v=new[:, :, :1])),
        ("k and v must have k_cache's heads, head dim and dtype", dense,
         dict(cache_seqlens=2, k=new.double(), v=new.double())),
    ]
    for match, cache, kw in cases:
        kc, vc = cache.clone(), cache.clone()
        args = {"q": q, "k": new, "v": new, **kw}
        with pytest.raises(AttentionInputError, match=match):
            flash.flash_attn_with_kvcache(args.pop("q"), kc, vc, **args)
        assert torch.equal(kc, cache) and torch.equal(vc, cache), match


def test_flash_attn_func_refuses_keys_of_another_batch_or_length() -> None:
    q = torch.randn(2, 7, 4, 16)
    for k, v in ((torch.randn(1, 7, 2, 16), torch.randn(1, 7, 2, 16)),
                 (torch.randn(2, 7, 2, 16), torch.randn(2, 5, 2, 16))):
        with pytest.raises(AttentionInputError, match=r"^k and v must be \[batch=2"):
            flash.flash_attn_func(q, k, v)


def test_flash_attn_with_kvcache_refusals() -> None:
    q = torch.randn(1, 1, 4, 16)
    cache = torch.randn(1, 8, 2, 16)
    new = torch.randn(1, 1, 2, 16)
    with pytest.raises(NotImplementedError, match="^rotary_cos: "):
        flash.flash_attn_with_kvcache(q, cache, cache, new, new, rotary_cos=torch.ones(8, 8),
                                      rotary_sin=torch.ones(8, 8), cache_seqlens=1)
    with pytest.raises(AttentionInputError, match="k and v must be given together"):
        flash.flash_attn_with_kvcache(q, cache, cache, new, None, cache_seqlens=1)
    with pytest.raises(AttentionInputError, match="must fit the cache's 8 positions"):
        flash.flash_attn_with_kvcache(q, cache, cache, new, new, cache_seqlens=8)
    with pytest.raises(AttentionInputError, match="cache_seqlens must be an int"):
        flash.flash_attn_with_kvcache(q, cache, cache, new, new, cache_seqlens=1.5)
    with pytest.raises(AttentionInputError, match="cache_batch_idx cannot be used"):
        flash.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=1,
                                      block_table=torch.zeros(1, 1, dtype=torch.int32),
                                      cache_batch_idx=torch.zeros(1, dtype=torch.int32))


def test_flash_attn_varlen_func_reads_flash_attns_pages(client) -> None:  # type: ignore[no-untyped-def]
    """block_table: k/v as pages [num_blocks, block_size, H_kv, D], each sequence's keys the
    first cu_seqlens_k lengths of its pages (one sequence ending mid-page, one on a page
    boundary); against the reference on the same keys packed; torch's varlen_attn still
    refuses a local block_table, naming it."""
    g = torch.Generator().manual_seed(9)
    k_pages = torch.randn(7, 4, 2, 16, generator=g)
    v_pages = torch.randn(7, 4, 2, 16, generator=g)
    table = torch.tensor([[6, 2, 0], [3, 1, 5]], dtype=torch.int32)
    cu_q = torch.tensor([0, 3, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, 18], dtype=torch.int32)  # 10 keys, then 8 (two full pages)
    q = torch.randn(5, 4, 16, generator=g)
    out = flash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 3, 10, causal=True,
                                       block_table=table)
    k = torch.cat([torch.cat([k_pages[int(p)] for p in table[0]])[:10],
                   torch.cat([k_pages[int(p)] for p in table[1]])[:8]])
    v = torch.cat([torch.cat([v_pages[int(p)] for p in table[0]])[:10],
                   torch.cat([v_pages[int(p)] for p in table[1]])[:8]])
    torch.testing.assert_close(out, _ref(q, k, v, cu_q, cu_k, causal=True), atol=1e-5,
                               rtol=1e-5)
    with pytest.raises(AttentionInputError, match="block_table must be"):
        flash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, torch.tensor(
            [0, 13, 21], dtype=torch.int32), 3, 13, block_table=table)  # 13 > 3 pages of 4
    for bad in (-1, 7):
        wrong = table.clone()
        wrong[1, 1] = bad
        with pytest.raises(AttentionInputError, match=f"block_table names block {bad}, outside"):
            flash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 3, 10,
                                         block_table=wrong)
        with pytest.raises(AttentionInputError, match=f"block_table names block {bad}"):
            flash.flash_attn_with_kvcache(q[:2, None], k_pages, v_pages, cache_seqlens=8,
                                          block_table=wrong)
    with pytest.raises(NotImplementedError, match="^block_table: "):
        flash.varlen_attn(q, k, v, cu_q, cu_k, 3, 10, enable_gqa=True, block_table=table)
    with pytest.raises(AttentionInputError, match="block_table must hold integer block ids"):
        flash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 3, 10,
                                     block_table=table.float())
    with pytest.raises(AttentionInputError, match="block_table must hold integer block ids"):
        flash.flash_attn_with_kvcache(q[:2, None], k_pages, v_pages, cache_seqlens=8,
                                      block_table=table.float() + 0.5)


def test_fp8_with_flash_attention_3s_descales(client) -> None:  # type: ignore[no-untyped-def]
    """FlashAttention-3's FP8 forward form: float8_e4m3fn q, k, v with ``q_descale`` /
    ``k_descale`` / ``v_descale`` ``[batch, H_kv]`` (keyword arguments, as in its
    ``flash_attn_func``): a bfloat16 output like float64 on the dequantized inputs; None
    means 1; rows that differ go per sequence (a wrong row count is an input error naming
    both forms); descales on 16-bit inputs are input errors."""
    from attention_kernels.fp8 import dequantize_queries, quantize_queries

    q, k, v, _, _ = _packed([24], [24], seed=7)
    q8, qs = quantize_queries(q, 2)
    (k8, ks), (v8, vs) = attention_kernels.quantize_kv(k), attention_kernels.quantize_kv(v)
    batch = 2
    q4, k4, v4 = (t.reshape(batch, 12, *t.shape[1:]) for t in (q8, k8, v8))
    rows = {name: s[None, :].expand(batch, 2) for name, s in
            (("q_descale", qs), ("k_descale", ks), ("v_descale", vs))}
    out = flash.flash_attn_func(q4, k4, v4, causal=True, **rows)
    assert out.dtype == torch.bfloat16 and out.shape == q4.shape
    cu = torch.tensor([0, 12, 24], dtype=torch.int32)
    ref = attention_kernels.prefill_ref(
        dequantize_queries(q8, qs, 2, torch.float64),
        attention_kernels.dequantize_kv(k8, ks, torch.float64),
        attention_kernels.dequantize_kv(v8, vs, torch.float64), cu, causal=True)
    err = ((out.reshape(24, 4, 16).double() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err
    ones = flash.flash_attn_varlen_func(q8, k8, v8, cu, cu, 12, 12)
    ref1 = attention_kernels.prefill_ref(q8.double(), k8.double(), v8.double(), cu)
    assert ((ones.double() - ref1).norm() / ref1.norm()).item() < 2e-2
    # Rows that differ go as a row per sequence: the second sequence's queries count double.
    differ, kdiff = rows["q_descale"].clone(), rows["k_descale"].clone()
    differ[1] *= 2
    kdiff[0] *= 0.5
    out = flash.flash_attn_func(q4, k4, v4, causal=True, q_descale=differ, k_descale=kdiff,
                                v_descale=rows["v_descale"])
    ref = attention_kernels.prefill_ref(
        dequantize_queries(q8, differ, 2, torch.float64, cu),
        attention_kernels.dequantize_kv(k8, kdiff, torch.float64, cu),
        attention_kernels.dequantize_kv(v8, vs, torch.float64), cu, causal=True)
    err = ((out.reshape(24, 4, 16).double() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err
    with pytest.raises(AttentionInputError, match=r"q_descale has 3 rows for 2 sequences"):
        flash.flash_attn_func(q4, k4, v4, q_descale=torch.stack([qs, qs, 2 * qs]))
    with pytest.raises(AttentionInputError, match="k_descale is for float8_e4m3fn k"):
        flash.flash_attn_func(q4.bfloat16(), k4.bfloat16(), v4.bfloat16(), k_descale=ks)
    for bad in (ks.double(), ks[:1], ks.expand(2, 2, 2)):  # FA3's: float32 [batch, H_kv]
        with pytest.raises(AttentionInputError, match="k_descale must be a float32 tensor"):
            flash.flash_attn_func(q4, k4, v4, k_descale=bad)
