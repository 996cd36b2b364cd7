"""Round trips through a real server (cpu backend) against the float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from attention_wire.pb import attention_pb2 as pb

from .svc_helpers import (
    TOLERANCE,
    MiB,
    collect,
    cu_from_lengths,
    decode_messages,
    decode_oracle,
    prefill_messages,
    prefill_oracle,
    random_qkv,
)

pytestmark = pytest.mark.timeout(60)
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected, atol=tol, rtol=tol)


def _check_lse(actual: torch.Tensor | None, expected: torch.Tensor) -> None:
    assert actual is not None and actual.dtype == torch.float32
    assert actual.shape == expected.shape
    # -inf (rows that see no key) must match exactly; isclose treats equal infinities as close.
    torch.testing.assert_close(actual.double(), expected.double(), atol=1e-4, rtol=1e-4)


# (name, q lengths, k lengths or None, heads, kv heads, head dim, causal, lse, scale)
PREFILL_CASES = [
    ("varlen", [5, 1, 17, 9], None, 4, 4, 64, False, False, None),
    ("gqa_causal_lse", [7, 12, 3], None, 8, 2, 32, True, True, None),
    # q shorter than k (a chunked-prefill continuation), one sequence with no keys, and one
    # causal sequence with more queries than keys (its first rows see no key).
    ("q_shorter_than_k", [3, 4, 2, 5], [9, 0, 21, 3], 4, 1, 16, True, True, None),
    ("head_dim_256_scale", [4, 6], [6, 6], 2, 1, 256, False, True, 0.3),
    ("head_dim_8", [1, 2, 33], None, 3, 1, 8, True, False, None),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[c[0] for c in PREFILL_CASES])
def test_prefill_matches_reference(server, case, dtype) -> None:  # type: ignore[no-untyped-def]
    _, len_q, len_k, heads, kv_heads, dim, causal, lse, scale = case
    cu_q = cu_from_lengths(len_q)
    cu_k = cu_from_lengths(len_k) if len_k else None
    total_k = (cu_k or cu_q)[-1]
    q, k, v = random_qkv(cu_q[-1], total_k, heads, kv_heads, dim, dtype, seed=len(len_q))
    resp = collect(
        server.stub().Prefill(
            prefill_messages(q, k, v, cu_q, cu_k, causal=causal, scale=scale, return_lse=lse,
                             chunk=1000)  # odd chunk size: chunks straddle rows and tensors
        )
    )
    out_ref, lse_ref = prefill_oracle(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=scale)
    _check(resp.out, out_ref, dtype)
    if lse:
        _check_lse(resp.lse, lse_ref)
    else:
        assert resp.lse is None
    stats = resp.stats
    assert stats is not None
    assert stats.bytes_in == q.nbytes + k.nbytes + v.nbytes
    assert stats.bytes_out == resp.out.nbytes + (resp.lse.nbytes if lse else 0)
    assert stats.batch_requests == 1 and stats.batch_tokens == cu_q[-1]
    assert stats.kernel_seconds > 0 and stats.queue_seconds >= 0
    # FLOPs: 4 * visible (query, key) pairs * heads * head_dim.
    pairs = 0
    for b in range(len(len_q)):
        sq, sk = len_q[b], (len_k or len_q)[b]
        pairs += sum(max(0, min(sk, i + sk - sq + 1)) for i in range(sq)) if causal else sq * sk
    assert stats.flops == 4 * pairs * heads * dim


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lse", [False, True])
def test_decode_matches_reference(server, dtype, lse) -> None:  # type: ignore[no-untyped-def]
    len_k = [13, 0, 40, 1, 7]
    cu_k = cu_from_lengths(len_k)
    q, k, v = random_qkv(len(len_k), cu_k[-1], 8, 2, 64, dtype, seed=3)
    resp = collect(
        server.stub().Decode(decode_messages(q, k, v, cu_k, num_splits=3, return_lse=lse))
    )
    out_ref, lse_ref = decode_oracle(q, k, v, cu_k)
    _check(resp.out, out_ref, dtype)
    if lse:
        _check_lse(resp.lse, lse_ref)
        assert resp.lse is not None and math.isinf(resp.lse[1, 0].item())  # empty sequence
    assert resp.stats is not None
    assert resp.stats.flops == 4 * cu_k[-1] * 8 * 64
    assert resp.stats.batch_tokens == cu_k[-1]


def test_output_is_sliced_under_chunk_bytes(server) -> None:  # type: ignore[no-untyped-def]
    """The shared server uses 64 KiB chunks: a ~2 MiB output arrives in many row slices."""
    q, k, v = random_qkv(4096, 4096, 4, 1, 32, torch.float32)
    cu = [0, 1024, 2048, 3072, 4096]
    resp = collect(server.stub().Prefill(prefill_messages(q, k, v, cu, return_lse=True)))
    assert resp.max_data <= 64 * 1024
    assert resp.messages > 2 * MiB // (64 * 1024)
    out_ref, lse_ref = prefill_oracle(q[:1024], k[:1024], v[:1024], [0, 1024])
    _check(resp.out[:1024], out_ref, torch.float32)


def test_row_bigger_than_chunk_goes_whole(start_server) -> None:  # type: ignore[no-untyped-def]
    """chunk_bytes smaller than a row: one row per message, never a split row."""
    srv = start_server(chunk_bytes=100)
    q, k, v = random_qkv(3, 3, 2, 1, 64, torch.float32)  # a row is 512 bytes
    resp = collect(srv.stub().Prefill(prefill_messages(q, k, v, [0, 3])))
    assert resp.messages == 3 + 1  # one message per OUT row, then the stats
    assert resp.max_data == 512


def test_all_bytes_in_first_message(server) -> None:  # type: ignore[no-untyped-def]
    """A small request may travel as a single message: header plus every chunk."""
    q, k, v = random_qkv(6, 6, 2, 2, 16, torch.float16)
    msgs = list(prefill_messages(q, k, v, [0, 6]))
    first = pb.PrefillRequest(header=msgs[0].header)
    for m in msgs[1:]:
        first.chunks.extend(m.chunks)
    resp = collect(server.stub().Prefill(iter([first])))
    out_ref, _ = prefill_oracle(q, k, v, [0, 6])
    _check(resp.out, out_ref, torch.float16)


def test_request_over_64_mib_with_default_message_limits(server) -> None:  # type: ignore[no-untyped-def]
    """64+ MiB in, ~21 MiB out, through 4 MiB default limits on both sides (plain channel)."""
    seqlen, batch, heads, dim = 256, 1366, 2, 8
    cu = cu_from_lengths([seqlen] * batch)
    q, k, v = random_qkv(cu[-1], cu[-1], heads, heads, dim, torch.float32, seed=7)
    assert q.nbytes + k.nbytes + v.nbytes >= 64 * MiB
    resp = collect(server.stub().Prefill(prefill_messages(q, k, v, cu), timeout=60))
    assert resp.stats is not None and resp.stats.bytes_in == q.nbytes + k.nbytes + v.nbytes
    assert resp.out.shape == q.shape
    for b in range(0, batch, batch // 16):  # spot-check sequences across the whole output
        s, e = cu[b], cu[b + 1]
        out_ref, _ = prefill_oracle(q[s:e], k[s:e], v[s:e], [0, seqlen])
        _check(resp.out[s:e], out_ref, torch.float32)
