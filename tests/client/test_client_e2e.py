"""The clients against the real server (cpu backend), checked against a float64 reference."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest

from attention_client import (
    AsyncAttentionClient,
    AttentionClient,
    AttentionError,
    AttentionInputError,
    AttentionTimeoutError,
)

from ._server import require_server, start_server

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
attention_kernels = pytest.importorskip("attention_kernels")

# Relative-norm error vs float64: the server rounds its float32 result to the input dtype.
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}
NP_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def make(kind: str, dtype: str, *shape: int, seed: int = 0):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    if kind == "torch":
        return x.to(TORCH_DTYPES[dtype])
    return x.numpy().astype(NP_DTYPES[dtype])


def f64(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().double()
    return torch.from_numpy(np.asarray(x).astype(np.float32)).double()


def check_out(out, ref: torch.Tensor, dtype: str, like) -> None:
    if isinstance(like, torch.Tensor):
        assert isinstance(out, torch.Tensor) and out.dtype == like.dtype
    else:
        assert isinstance(out, np.ndarray) and out.dtype == like.dtype
    got = f64(out)
    assert got.shape == ref.shape
    err = (got - ref).norm().item() / max(ref.norm().item(), 1e-30)
    assert err < TOL[dtype], f"relative error {err:.3g} over {TOL[dtype]}"


def check_lse(lse, ref: torch.Tensor) -> None:
    got = f64(lse)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-4, atol=1e-3)


@pytest.fixture(scope="module", params=[True, False], ids=["unary", "stream"])
def client(server, request):
    """Both ways a call travels: the unary twin rpcs (small calls, the default) and streams."""
    with AttentionClient(server.target, timeout=60, unary=request.param) as c:
        yield c


@pytest.mark.parametrize("head_dim", [3, 59, 250])
def test_any_head_dim_up_to_256(client, head_dim):
    """Head dims that are not multiples of 8 (issue 65): a stateless prefill and decode, and
    a KV cache of that head dim (append, a decode step on a step stream), against float64."""
    cu_q, cu_k = [0, 5, 12], [0, 9, 20]
    q = make("torch", "bfloat16", 12, 4, head_dim, seed=1)
    k = make("torch", "bfloat16", 20, 2, head_dim, seed=2)
    v = make("torch", "bfloat16", 20, 2, head_dim, seed=3)
    out, lse = client.attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    ref, ref_lse = attention_kernels.prefill_ref(
        f64(q), f64(k), f64(v), torch.tensor(cu_q, dtype=torch.int32),
        torch.tensor(cu_k, dtype=torch.int32), causal=True, return_lse=True)
    check_out(out, ref, "bfloat16", q)
    check_lse(lse, ref_lse)
    qd = make("torch", "bfloat16", 2, 4, head_dim, seed=4)
    cu = torch.tensor(cu_k, dtype=torch.int32)
    check_out(client.decode(qd, k, v, cu_k), attention_kernels.decode_ref(f64(qd), f64(k),
                                                                          f64(v), cu),
              "bfloat16", qd)
    ids = [f"odd{head_dim}-a", f"odd{head_dim}-b"]
    with client.kv_cache(2, head_dim, "bfloat16") as cache, client.decode_steps() as steps:
        assert cache.append(ids, k, v, cu_k) == [9, 11]
        kn = make("torch", "bfloat16", 2, 2, head_dim, seed=5)
        vn = make("torch", "bfloat16", 2, 2, head_dim, seed=6)
        got = steps.step(qd, ids, kn, vn)
        both_k = torch.cat([f64(k)[:9], f64(kn)[:1], f64(k)[9:], f64(kn)[1:]])
        both_v = torch.cat([f64(v)[:9], f64(vn)[:1], f64(v)[9:], f64(vn)[1:]])
        want = attention_kernels.decode_ref(f64(qd), both_k, both_v,
                                            torch.tensor([0, 10, 22], dtype=torch.int32))
        check_out(got, want, "bfloat16", qd)
        assert [c["length"] for c in cache.info()] == [10, 12]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_varlen_gqa_causal(client, kind, dtype):
    cu_q, cu_k = [0, 5, 5, 17, 20], [0, 9, 12, 30, 30]  # q shorter than k, empty sequences
    q = make(kind, dtype, 20, 4, 64, seed=1)
    k = make(kind, dtype, 30, 2, 64, seed=2)
    v = make(kind, dtype, 30, 2, 64, seed=3)
    out, lse = client.attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    ref, ref_lse = attention_kernels.prefill_ref(
        f64(q), f64(k), f64(v), torch.tensor(cu_q, dtype=torch.int32),
        torch.tensor(cu_k, dtype=torch.int32), causal=True, return_lse=True,
    )
    check_out(out, ref, dtype, q)
    check_lse(lse, ref_lse)
    assert np.isneginf(f64(lse)[:, 17:].numpy()).all()  # sequence 3 has no keys: lse = -inf
    assert not f64(out)[17:].any()  # and zero output


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_dense_3d(client, kind):
    q, k, v = (make(kind, "float16", n, 2, 32, seed=s) for n, s in ((7, 1), (11, 2), (11, 3)))
    out, lse = client.attention(q, k, v, softmax_scale=0.3, return_lse=True)
    cu_q, cu_k = torch.tensor([0, 7], dtype=torch.int32), torch.tensor([0, 11], dtype=torch.int32)
    ref, ref_lse = attention_kernels.prefill_ref(
        f64(q), f64(k), f64(v), cu_q, cu_k, softmax_scale=0.3, return_lse=True
    )
    assert out.shape == (7, 2, 32) and lse.shape == (2, 7)
    check_out(out, ref, "float16", q)
    check_lse(lse, ref_lse)


@pytest.mark.parametrize(("kind", "dtype"), [("torch", "bfloat16"), ("numpy", "float32")])
def test_dense_4d(client, kind, dtype):
    batch, n_q, n_k = 3, 6, 10
    q = make(kind, dtype, batch, n_q, 4, 64, seed=4)
    k = make(kind, dtype, batch, n_k, 1, 64, seed=5)
    v = make(kind, dtype, batch, n_k, 1, 64, seed=6)
    out, lse = client.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (batch, n_q, 4, 64) and lse.shape == (batch, 4, n_q)
    for b in range(batch):
        cu_q = torch.tensor([0, n_q], dtype=torch.int32)
        cu_k = torch.tensor([0, n_k], dtype=torch.int32)
        ref, ref_lse = attention_kernels.prefill_ref(
            f64(q[b]), f64(k[b]), f64(v[b]), cu_q, cu_k, causal=True, return_lse=True
        )
        check_out(out[b], ref, dtype, q)
        check_lse(lse[b], ref_lse)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("num_splits", [0, 3])
def test_decode(client, kind, dtype, num_splits):
    cu_k = [0, 1, 40, 40, 57]  # includes an empty context
    q = make(kind, dtype, 4, 8, 128, seed=7)
    k = make(kind, dtype, 57, 2, 128, seed=8)
    v = make(kind, dtype, 57, 2, 128, seed=9)
    out, lse = client.decode(q, k, v, cu_k, num_splits=num_splits, return_lse=True)
    ref, ref_lse = attention_kernels.decode_ref(
        f64(q), f64(k), f64(v), torch.tensor(cu_k, dtype=torch.int32), return_lse=True
    )
    assert lse.shape == (4, 8)
    check_out(out, ref, dtype, q)
    check_lse(lse, ref_lse)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_an_empty_batch_gets_empty_results(client, kind):
    """No queries (a step of an engine with nothing to prefill): empty outputs of q's type,
    as flash_attn answers, for prefill (with or without sequences or keys) and decode."""
    q = make(kind, "float16", 0, 4, 64)
    k = make(kind, "float16", 5, 2, 64, seed=1)
    for kk, cu in ((q[:, :2], None), (q[:, :2], ([0], [0])), (k, ([0, 0], [0, 5]))):
        out, lse = client.attention(q, kk, kk, *(cu or ()), causal=True, return_lse=True)
        check_out(out, f64(q), "float16", q)
        assert tuple(lse.shape) == (4, 0)
    out, lse = client.decode(q, q[:, :2], q[:, :2], [0], return_lse=True)
    check_out(out, f64(q), "float16", q)
    assert tuple(lse.shape) == (0, 4)
    out = client.decode(q, q[:, :2], q[:, :2], [0], alibi_slopes=np.zeros((0, 4)))  # [B, H]
    check_out(out, f64(q), "float16", q)
    assert client.last_stats["batch_requests"] == 0


def test_large_request_and_response_with_default_limits(client):
    q = make("numpy", "float32", 6144, 4, 64, seed=10)  # 6 MiB in, 6 MiB out
    k = make("numpy", "float32", 64, 4, 64, seed=11)
    out = client.attention(q, k, k, [0, 3000, 6144], [0, 30, 64])
    ref = attention_kernels.prefill_ref(
        f64(q), f64(k), f64(k), torch.tensor([0, 3000, 6144], dtype=torch.int32),
        torch.tensor([0, 30, 64], dtype=torch.int32),
    )
    check_out(out, ref, "float32", q)
    stats = client.last_stats
    assert stats["bytes_in"] == q.nbytes + 2 * k.nbytes and stats["bytes_out"] == q.nbytes


def test_info_health_and_stats(client):
    info = client.info()
    assert info["backend"] == "cpu"
    assert {"FLOAT16", "BFLOAT16", "FLOAT32"} <= set(info["dtypes"])
    assert 64 in info["head_dims"] and 128 in info["head_dims"]
    assert client.health() == "SERVING"
    q = make("numpy", "float16", 4, 2, 64)
    client.attention(q, q, q)
    stats = client.last_stats
    assert stats["flops"] > 0 and stats["batch_requests"] >= 1 and stats["bytes_out"] == q.nbytes


@pytest.mark.parametrize(
    ("shapes", "cu", "word"),
    [
        (((4, 2, 264), (4, 2, 264)), None, "head_dim"),  # over 256
        (((4, 3, 64), (4, 2, 64)), None, "head"),  # 3 heads over 2 kv heads
        (((4, 2, 64), (4, 2, 64)), ([0, 3], [0, 4]), "cu_seqlens"),  # does not end at total
    ],
)
def test_server_rejects_bad_arguments(client, shapes, cu, word):
    q = make("numpy", "float16", *shapes[0])
    k = make("numpy", "float16", *shapes[1])
    with pytest.raises(AttentionError) as exc:
        client.attention(q, k, k, *(cu or ()))
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert word in exc.value.details.lower(), exc.value.details


def test_deadline_exceeded(server):
    q = make("numpy", "float32", 4096, 8, 64)  # 8 MiB a tensor: cannot finish in 50 ms
    with AttentionClient(server.target, timeout=0.05) as c, pytest.raises(AttentionError) as e:
        c.attention(q, q, q)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("timeout", [0.005, 0.02])
def test_async_deadline_during_a_streamed_upload_is_a_timeout(server, timeout):
    """A deadline that runs out while an async call still sends its request stream (32 MiB
    a tensor: many messages, far more than the deadline to send) is AttentionTimeoutError,
    as with the sync client; grpc.aio itself reports INTERNAL ("Internal error from Core")
    there."""
    q = make("numpy", "float32", 8192, 8, 128)

    async def main():
        async with AsyncAttentionClient(server.target) as c:
            with pytest.raises(AttentionTimeoutError) as e:
                await c.attention(q, q, q, timeout=timeout)
            with pytest.raises(AttentionTimeoutError):
                await c.decode(q[:1], q, q, [0, 8192], timeout=timeout)
            return e.value

    assert asyncio.run(main()).code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_closed_client_says_so(server):
    """Calls on a closed client raise AttentionError, not grpc's ValueError / UsageError
    (which ``except ValueError`` would take for a bad argument)."""
    q = make("numpy", "float32", 4, 2, 8)
    c = AttentionClient(server.target)
    c.attention(q, q, q)
    c.close()
    c.close()  # twice: harmless
    for call in (lambda: c.attention(q, q, q), c.info, c.list_caches):
        with pytest.raises(AttentionError, match="closed") as e:
            call()
        assert not isinstance(e.value, ValueError)

    async def main():
        ac = AsyncAttentionClient(server.target)
        await ac.attention(q, q, q)
        await ac.close()
        with pytest.raises(AttentionError, match="closed"):
            await ac.attention(q, q, q)

    asyncio.run(main())


def test_async_client_concurrent(server):
    async def main():
        async with AsyncAttentionClient(server.target) as c:
            qs = [make("torch", "bfloat16", 9, 4, 64, seed=s) for s in range(6)]
            outs = await asyncio.gather(*[c.attention(q, q, q, causal=True) for q in qs])
            dq = make("numpy", "float16", 2, 4, 64, seed=20)
            dk = make("numpy", "float16", 12, 4, 64, seed=21)
            dec = await c.decode(dq, dk, dk, [0, 5, 12])
            with pytest.raises(AttentionError) as exc:
                await c.attention(make("numpy", "float16", 4, 3, 64), *[  # 3 heads over 2
                    make("numpy", "float16", 4, 2, 64)] * 2)
            return qs, outs, (dq, dk, dec), exc.value, await c.health()

    qs, outs, (dq, dk, dec), err, status = asyncio.run(main())
    cu = torch.tensor([0, 9], dtype=torch.int32)
    for q, out in zip(qs, outs, strict=True):
        check_out(out, attention_kernels.prefill_ref(f64(q), f64(q), f64(q), cu, causal=True),
                  "bfloat16", q)
    ref = attention_kernels.decode_ref(f64(dq), f64(dk), f64(dk),
                                       torch.tensor([0, 5, 12], dtype=torch.int32))
    check_out(dec, ref, "float16", dq)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and status == "SERVING"


def test_auth_token():
    require_server()
    running = start_server("--auth-token", "s3cret")
    try:
        q = make("numpy", "float16", 3, 1, 64)
        with AttentionClient(running.target) as c, pytest.raises(AttentionError) as exc:
            c.attention(q, q, q)
        assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED
        with AttentionClient(running.target, token="wrong") as c, pytest.raises(AttentionError):
            c.attention(q, q, q)
        with AttentionClient(running.target, token="s3cret") as c:
            out = c.attention(q, q, q)
            assert out.shape == q.shape
    finally:
        running.stop()


class RpcNames(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """The rpcs a client used: each call once, each stream once however many calls it
    carried (thread-safe)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._lock = threading.Lock()

    def _note(self, details) -> None:  # type: ignore[no-untyped-def]
        with self._lock:
            self.names.append(details.method.rsplit("/", 1)[-1])

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        self._note(details)
        return continuation(details, request)

    def intercept_stream_stream(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        self._note(details)
        return continuation(details, request_iterator)


@pytest.mark.parametrize("call_streams", [True, False], ids=["call-streams", "unary"])
def test_small_calls_go_in_one_message_and_large_ones_stream(server, call_streams):
    """One message each way when the request and the outputs each fit one of max_chunk_bytes:
    on a kept-open PrefillSteps/DecodeSteps stream (opened once, then reused), or with
    call_streams=False a unary call each. The result is the same every way (cpu backend,
    batching off in this server: bitwise)."""
    seen = RpcNames()
    one = ("PrefillSteps", "DecodeSteps") if call_streams else ("PrefillUnary", "DecodeUnary")
    with AttentionClient(server.target, max_chunk_bytes=16384, interceptors=[seen],
                         call_streams=call_streams, spread=False) as c, \
            AttentionClient(server.target, unary=False) as streamed:
        q = make("numpy", "float16", 16, 2, 64, seed=30)  # 4 KiB: q, k, v 12 KiB
        small = c.attention(q, q, q, causal=True)
        assert seen.names == [one[0]]
        np.testing.assert_array_equal(small, streamed.attention(q, q, q, causal=True))
        big = make("numpy", "float16", 70, 2, 64, seed=31)  # 17.5 KiB of q: over 16 KiB
        c.attention(big, big[:1], big[:1])
        # 14 KiB in, but out (14 KiB) and lse (3.5 KiB) together are over 16 KiB.
        narrow = make("numpy", "float16", 896, 1, 8, seed=32)
        c.attention(narrow, narrow[:1], narrow[:1], [0, 896], [0, 1], return_lse=True)
        assert seen.names == [one[0], "Prefill", "Prefill"]
        again = c.attention(q, q, q, causal=True)
        np.testing.assert_array_equal(again, small)
        # A stream is opened once and carries every later call.
        assert seen.names[-1] == ("Prefill" if call_streams else one[0])
        out, lse = c.decode(q[:2], q, q, [0, 7, 16], return_lse=True)
        assert seen.names[-1] == one[1]
        ref_out, ref_lse = streamed.decode(q[:2], q, q, [0, 7, 16], return_lse=True)
        np.testing.assert_array_equal(out, ref_out)
        np.testing.assert_array_equal(lse, ref_lse)


def test_head_dims_outside_1_to_256_are_refused_before_sending():
    """The client checks head dims itself (no server at this address: nothing is sent)."""
    with AttentionClient("127.0.0.1:1", spread=False, timeout=5) as c:
        for dim in (0, 257):
            bad = np.zeros((4, 2, dim), np.float16)
            with pytest.raises(AttentionInputError, match=r"head_dim .* must be in \[1, 256\]"):
                c.attention(bad, bad, bad)
            with pytest.raises(AttentionInputError, match="head_dim"):
                c.kv_cache(2, dim, "float16")
