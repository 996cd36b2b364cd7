"""Striped calls (``stripes=``): one large call split into kv-head groups, sent at once over
several connections and joined. The split itself (``_stripes.plan``), and whole calls against
a real server with two front-end processes, checked against the float64 reference and against
the same call sent whole."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest

from attention_client import (
    AsyncAttentionClient,
    AttentionClient,
    AttentionError,
    AttentionInputError,
)
from attention_client import _stripes as stripes
from attention_client._requests import ScoreMods

from ._server import require_server, start_server

torch = pytest.importorskip("torch")
attention_kernels = pytest.importorskip("attention_kernels")

TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def rand(*shape: int, seed: int, dtype: str = "float32") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(TORCH_DTYPES[dtype])


def rel_err(got, ref: torch.Tensor) -> float:
    got = torch.as_tensor(np.asarray(got, dtype=np.float64)) if not isinstance(
        got, torch.Tensor) else got.double()
    assert got.shape == ref.shape
    assert not torch.isnan(got).any()
    return (got - ref).norm().item() / max(ref.norm().item(), 1e-30)


# ---- the split ------------------------------------------------------------------------------

def test_plan_splits_kv_head_groups_with_their_query_heads():
    q, k = np.zeros((4, 12, 8), np.float32), np.zeros((4, 4, 8), np.float32)
    parts = stripes.plan(q, k, k, 3, None, None, min_bytes=0)
    assert parts == [
        stripes.Part(slice(0, 6), slice(0, 2)),  # 4 kv heads over 3: 2, 1, 1
        stripes.Part(slice(6, 9), slice(2, 3)),
        stripes.Part(slice(9, 12), slice(3, 4)),
    ]
    # More stripes than kv heads: one part per kv head.
    assert len(stripes.plan(q, k, k, 16, None, None, min_bytes=0)) == 4


@pytest.mark.parametrize("case", [
    "one stripe", "small", "one kv head", "heads not a multiple", "k and v differ",
    "ranks differ", "not arrays", "scales per other heads", "slopes per other heads",
])
def test_plan_leaves_whole_what_does_not_split_cleanly(case):
    q, k = np.zeros((4, 8, 8), np.float32), np.zeros((4, 4, 8), np.float32)
    v = k
    n, score, scales, min_bytes = 4, None, None, 0
    if case == "one stripe":
        n = 1
    elif case == "small":
        min_bytes = q.nbytes + 2 * k.nbytes + 1
    elif case == "one kv head":
        k = v = np.zeros((4, 1, 8), np.float32)
    elif case == "heads not a multiple":
        k = v = np.zeros((4, 3, 8), np.float32)
    elif case == "k and v differ":
        v = np.zeros((4, 2, 8), np.float32)
    elif case == "ranks differ":
        q = np.zeros((1, 4, 8, 8), np.float32)
    elif case == "not arrays":
        q = q.tolist()
    elif case == "scales per other heads":
        scales = ((1.0,) * 3, (1.0,) * 3)
    elif case == "slopes per other heads":
        score = ScoreMods(slopes=np.ones(4, np.float32))
    assert stripes.plan(q, k, v, n, score, scales, min_bytes=min_bytes) is None


def test_part_inputs_slice_heads_slopes_and_scales():
    q, k = torch.arange(2 * 8 * 3.0).reshape(2, 8, 3), torch.arange(2 * 4 * 3.0).reshape(2, 4, 3)
    score = ScoreMods(window=(4, 0), slopes=np.arange(16, dtype=np.float32).reshape(2, 8))
    scales = ((1.0, 2.0, 3.0, 4.0), (5.0, 6.0, 7.0, 8.0))
    part = stripes.Part(slice(4, 8), slice(2, 4))
    pq, pk, pv, pscore, pscales = stripes.part_inputs(part, q, k, k, score, scales)
    assert torch.equal(pq, q[:, 4:8])
    assert torch.equal(pk, k[:, 2:4]) and torch.equal(pv, k[:, 2:4])
    assert pscore.window == (4, 0)
    np.testing.assert_array_equal(pscore.slopes, score.slopes[:, 4:8])
    assert pscales == ((3.0, 4.0), (7.0, 8.0))


def test_join_puts_heads_back_in_order():
    parts = [(np.full((5, 2, 3), i, np.float32), np.full((2, 5), i, np.float32)) for i in range(3)]
    out, lse = stripes.join(parts, True, -2)
    assert out.shape == (5, 6, 3) and lse.shape == (6, 5)
    assert out[0, :, 0].tolist() == [0, 0, 1, 1, 2, 2] and lse[:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.equal(stripes.join([torch.zeros(3, 1, 2), torch.ones(3, 2, 2)], False, -2)[:, 1:],
                       torch.ones(3, 2, 2))


def test_parts_take_consecutive_connections():
    assert stripes.lanes(5, 3, 4) == [1, 2, 3]
    assert stripes.lanes(7, 4, 4) == [3, 0, 1, 2]  # distinct while channels >= parts


def test_merged_stats_sum_bytes_and_keep_the_longest_part():
    a = {"bytes_in": 10, "bytes_out": 4, "flops": 1.5, "kernel_seconds": 0.2,
         "batch_requests": 1, "cache_lengths": []}
    b = {"bytes_in": 30, "bytes_out": 8, "flops": 2.5, "kernel_seconds": 0.1,
         "batch_requests": 3, "cache_lengths": []}
    merged = stripes.merge_stats([a, b])
    assert merged == {"bytes_in": 40, "bytes_out": 12, "flops": 4.0, "kernel_seconds": 0.2,
                      "batch_requests": 3, "cache_lengths": []}
    assert stripes.merge_stats([None]) is None


def test_stripes_argument_checked_and_channels_raised():
    with pytest.raises(AttentionInputError, match="stripes must be in"):
        AttentionClient("127.0.0.1:1", stripes=0)
    with AttentionClient("127.0.0.1:1", stripes=4, channels=2) as c:
        assert c.channels == 4 and c.stripes == 4
        q = np.zeros((64, 8, 8), np.float32)
        k = np.zeros((64, 4, 8), np.float32)
        assert c._stripe_plan(q, k, k, None, None, None, None) is None  # under 4 MiB
        big = np.zeros((8192, 8, 64), np.float32)
        assert len(c._stripe_plan(big, big, big, None, None, None, None)) == 4
        assert c._stripe_plan(big, big, big, big, None, None, None) is None  # out=


# ---- against a real server with two front ends ----------------------------------------------

class CountCalls(grpc.StreamStreamClientInterceptor, grpc.UnaryUnaryClientInterceptor):
    """Counts the compute rpcs a client makes (any of Prefill*, Decode*)."""

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def _count(self, details) -> None:
        name = details.method.rsplit("/", 1)[-1]
        if name.startswith(("Prefill", "Decode")):
            with self._lock:
                self.calls += 1

    def intercept_stream_stream(self, continuation, details, requests):
        self._count(details)
        return continuation(details, requests)

    def intercept_unary_unary(self, continuation, details, request):
        self._count(details)
        return continuation(details, request)


@pytest.fixture(scope="module")
def group():
    require_server()
    running = start_server("--frontends", "2")
    with AttentionClient(running.target, timeout=60) as c:
        deadline = time.monotonic() + 60
        while c.health(wait_for_ready=True) != "SERVING":  # both front ends up, engine warm
            assert time.monotonic() < deadline, running.log()
            time.sleep(0.05)
    yield running
    running.stop()


@pytest.fixture
def small_stripes(monkeypatch):
    """Stripe calls of any size (the default leaves calls under 4 MiB whole)."""
    monkeypatch.setattr(stripes, "STRIPE_MIN_BYTES", 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rank", [3, 4])
def test_striped_prefill_matches_reference_and_whole_call(group, small_stripes, dtype, rank):
    counter = CountCalls()
    h, hkv, d = 12, 4, 40  # GQA 3, a head dim that is not a power of two
    if rank == 3:
        cu_q, cu_k = [0, 1, 1, 37, 50], [0, 3, 3, 60, 71]  # length 1, an empty sequence
        q = rand(50, h, d, seed=1, dtype=dtype)
        k, v = rand(71, hkv, d, seed=2, dtype=dtype), rand(71, hkv, d, seed=3, dtype=dtype)
        args = (cu_q, cu_k)
    else:
        q = rand(2, 33, h, d, seed=1, dtype=dtype)
        k, v = rand(2, 33, hkv, d, seed=2, dtype=dtype), rand(2, 33, hkv, d, seed=3, dtype=dtype)
        args = ()
    slopes = torch.rand(h, generator=torch.Generator().manual_seed(4)).float()
    opts = dict(causal=True, return_lse=True, window_size=(16, 0), softcap=20.0,
                alibi_slopes=slopes)
    # Streamed calls only, so that each part is one rpc to count.
    with AttentionClient(group.target, stripes=3, interceptors=[counter], unary=False,
                         call_streams=False) as striped:
        out, lse = striped.attention(q, k, v, *args, **opts)
    assert counter.calls == 3  # 4 kv heads over 3 stripes: three calls
    with AttentionClient(group.target) as whole:
        out_whole, lse_whole = whole.attention(q, k, v, *args, **opts)

    if rank == 3:
        ref, ref_lse = attention_kernels.prefill_ref(
            q.double(), k.double(), v.double(), torch.tensor(cu_q, dtype=torch.int32),
            torch.tensor(cu_k, dtype=torch.int32), return_lse=True, alibi_slopes=slopes,
            causal=True, window_size=(16, 0), softcap=20.0)
    else:
        ref = torch.empty(2, 33, h, d, dtype=torch.float64)
        ref_lse = torch.empty(2, h, 33, dtype=torch.float64)
        cu = torch.tensor([0, 33], dtype=torch.int32)
        for b in range(2):
            ref[b], ref_lse[b] = attention_kernels.prefill_ref(
                q[b].double(), k[b].double(), v[b].double(), cu, return_lse=True,
                alibi_slopes=slopes, causal=True, window_size=(16, 0), softcap=20.0)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_err(out, ref) < TOL[dtype]
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse.double()[finite], rtol=1e-4,
                               atol=1e-3)
    # Each head is computed alone either way: the parts' heads are the whole call's.
    torch.testing.assert_close(out, out_whole, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_whole, rtol=0, atol=0)


def test_striped_decode_numpy_matches_reference(group, small_stripes):
    counter = CountCalls()
    b, h, hkv, d = 3, 8, 8, 64
    cu_k = [0, 17, 17, 90]  # an empty cache: zeros, lse -inf
    q = rand(b, h, d, seed=5).numpy()
    k, v = rand(90, hkv, d, seed=6).numpy(), rand(90, hkv, d, seed=7).numpy()
    with AttentionClient(group.target, stripes=4, interceptors=[counter], unary=False,
                         call_streams=False) as c:
        out, lse = c.decode(q, k, v, cu_k, return_lse=True)
    assert counter.calls == 4
    ref, ref_lse = attention_kernels.decode_ref(
        torch.from_numpy(q).double(), torch.from_numpy(k).double(), torch.from_numpy(v).double(),
        torch.tensor(cu_k, dtype=torch.int32), return_lse=True)
    assert isinstance(out, np.ndarray) and out.shape == (b, h, d) and lse.shape == (b, h)
    assert rel_err(out, ref) < TOL["float32"]
    assert np.all(np.isneginf(lse[1])) and np.all(out[1] == 0)
    np.testing.assert_allclose(lse[[0, 2]], ref_lse[[0, 2]].numpy(), rtol=1e-4, atol=1e-3)


def test_striped_call_raises_the_servers_refusal_once(group, small_stripes):
    q, k = rand(20, 4, 32, seed=1), rand(20, 2, 32, seed=2)
    with AttentionClient(group.target, stripes=2) as c, pytest.raises(AttentionError) as err:
        c.attention(q, k, k, [0, 10, 25], [0, 10, 20])  # cu_seqlens past q's 20 rows
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "cu_seqlens" in err.value.details


def test_async_striped_prefill_matches_whole_call(group, small_stripes):
    q, k, v = rand(40, 8, 32, seed=1), rand(40, 4, 32, seed=2), rand(40, 4, 32, seed=3)

    async def run():
        async with AsyncAttentionClient(group.target, stripes=4) as striped, \
                AsyncAttentionClient(group.target) as whole:
            got = await striped.attention(q, k, v, causal=True)
            want = await whole.attention(q, k, v, causal=True)
            return got, want

    got, want = asyncio.run(run())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    ref = attention_kernels.prefill_ref(q.double(), k.double(), v.double(),
                                        torch.tensor([0, 40], dtype=torch.int32), causal=True)
    assert rel_err(got, ref) < TOL["float32"]


def test_striped_stats_cover_the_whole_call(group, small_stripes):
    q, k = rand(40, 8, 32, seed=1), rand(40, 4, 32, seed=2)
    with AttentionClient(group.target, stripes=4) as striped, \
            AttentionClient(group.target) as whole:
        striped.attention(q, k, k)
        whole.attention(q, k, k)
        for key in ("bytes_in", "bytes_out", "flops"):
            assert striped.last_stats[key] == whole.last_stats[key], key


@pytest.mark.parametrize("case", ["v rows", "slopes batch"])
def test_a_bad_argument_is_reported_as_for_the_whole_call(group, small_stripes, case):
    """The parts fail on their own slices; the error names the caller's shapes."""
    q, k, v = rand(40, 8, 32, seed=1), rand(40, 4, 32, seed=2), rand(30, 4, 32, seed=3)
    kwargs = {}
    if case == "slopes batch":
        v = k
        kwargs = {"alibi_slopes": torch.ones(3, 8)}  # 2 sequences, not 3
    with AttentionClient(group.target, stripes=2) as striped, \
            AttentionClient(group.target) as whole:
        with pytest.raises(AttentionInputError) as got:
            striped.attention(q, k, v, [0, 20, 40], **kwargs)
        with pytest.raises(AttentionInputError) as want:
            whole.attention(q, k, v, [0, 20, 40], **kwargs)
    assert str(got.value) == str(want.value)
    assert ("(30, 4, 32)" if case == "v rows" else "[3, 8]") in str(got.value)


def test_parts_run_in_the_callers_context(group, small_stripes):
    """Interceptors that read context variables (tracing, request ids) see the caller's in
    every part, those on the client's stripe threads too."""
    import contextvars

    trace = contextvars.ContextVar("trace", default=None)
    seen = []

    class Reads(grpc.StreamStreamClientInterceptor):
        def intercept_stream_stream(self, continuation, details, requests):
            if details.method.endswith("/Prefill"):
                seen.append(trace.get())
            return continuation(details, requests)

    q, k = rand(40, 8, 32, seed=1), rand(40, 4, 32, seed=2)
    with AttentionClient(group.target, stripes=4, interceptors=[Reads()], unary=False,
                         call_streams=False) as c:
        trace.set("trace-123")
        c.attention(q, k, k)
    assert seen == ["trace-123"] * 4


def test_async_striped_refusal_is_the_calls_error(group, small_stripes):
    """A part refused by the server fails the whole async call with its status."""
    q, k = rand(20, 4, 32, seed=1), rand(20, 2, 32, seed=2)

    async def run():
        async with AsyncAttentionClient(group.target, stripes=2) as c:
            await c.attention(q, k, k, [0, 10, 25], [0, 10, 20])

    with pytest.raises(AttentionError) as err:
        asyncio.run(run())
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.gpu
def test_parts_read_cuda_inputs_after_the_callers_stream(small_stripes):
    """CUDA inputs written by work still pending on the caller's stream: every part sees the
    written values (the fake server answers each call's q as its output)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from ._fakes import start_fake

    server, _, port = start_fake()
    try:
        side = torch.cuda.Stream()
        with AttentionClient(f"localhost:{port}", stripes=4, unary=False,
                             call_streams=False) as c:
            for seed in range(5):
                src = rand(512, 8, 64, seed=seed).cuda()
                q = torch.zeros_like(src)
                k = torch.zeros(512, 4, 64, device="cuda")
                with torch.cuda.stream(side):
                    torch.cuda._sleep(50_000_000)  # tens of ms of pending work, then the write
                    q.copy_(src)
                    out = c.attention(q, k, k)
                assert out.device == q.device
                assert torch.equal(out.cpu(), src.cpu())
    finally:
        server.stop(None)


def test_striped_fp8_queries_take_their_kv_heads_scales(group, small_stripes):
    """FP8 q, k, v striped by kv-head groups: each part sends its kv heads' q, k and v scales;
    the joined bf16 output equals the whole call's."""
    from attention_kernels.fp8 import quantize_queries

    q, k, v = rand(40, 8, 32, seed=5), rand(40, 4, 32, seed=6), rand(40, 4, 32, seed=7)
    q = q * torch.tensor([1.0, 1.0, 30.0, 30.0, 0.1, 0.1, 5.0, 5.0])[None, :, None]
    q8, qs = quantize_queries(q, 4)  # scales 300x apart between kv heads
    (k8, ks), (v8, vs) = attention_kernels.quantize_kv(k), attention_kernels.quantize_kv(v)
    opts = dict(causal=True, q_scale=qs, k_scale=ks, v_scale=vs)
    with AttentionClient(group.target, stripes=2, unary=False, call_streams=False) as striped:
        out = striped.attention(q8, k8, v8, [0, 15, 40], **opts)
    with AttentionClient(group.target) as whole:
        out_whole = whole.attention(q8, k8, v8, [0, 15, 40], **opts)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, out_whole, rtol=0, atol=0)
    ref = attention_kernels.prefill_ref(
        attention_kernels.dequantize_queries(q8, qs, 4, torch.float64),
        attention_kernels.dequantize_kv(k8, ks, torch.float64),
        attention_kernels.dequantize_kv(v8, vs, torch.float64),
        torch.tensor([0, 15, 40], dtype=torch.int32), causal=True)
    assert rel_err(out, ref) < TOL["bfloat16"]


def test_striped_fp8_rows_per_sequence_slice_each_row(group, small_stripes):
    """[batch, H_kv] scales (a row per sequence) striped by kv-head groups: each part sends
    its kv heads' column of every row; the joined output equals the whole call's and the
    reference with each sequence's own rows."""
    cu = [0, 15, 40]
    k, v = rand(40, 4, 32, seed=8), rand(40, 4, 32, seed=9)
    q = rand(40, 8, 32, seed=10).to(torch.bfloat16)
    (k0, ks0), (k1, ks1) = (attention_kernels.quantize_kv(k[a:b] * 20 ** i)
                            for i, (a, b) in enumerate(zip(cu, cu[1:], strict=False)))
    k8, ks = torch.cat([k0, k1]), torch.stack([ks0, ks1])
    v8, vs = attention_kernels.quantize_kv(v)
    opts = dict(causal=True, k_scale=ks, v_scale=vs)
    with AttentionClient(group.target, stripes=2, unary=False, call_streams=False) as striped:
        out = striped.attention(q, k8, v8, cu, **opts)
    with AttentionClient(group.target) as whole:
        out_whole = whole.attention(q, k8, v8, cu, **opts)
    torch.testing.assert_close(out, out_whole, rtol=0, atol=0)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    ref = attention_kernels.prefill_ref(
        q.double(), attention_kernels.dequantize_kv(k8, ks, torch.float64, cu_t),
        attention_kernels.dequantize_kv(v8, vs, torch.float64), cu_t, causal=True)
    assert rel_err(out, ref) < TOL["bfloat16"]
