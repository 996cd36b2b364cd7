"""A mutation fuzzer of our own at the raw gRPC level (issue 12): valid request streams of
every compute rpc and valid control requests, mutated (bit flips, interesting bytes, inserts,
deletes, truncation, duplicated ranges, spliced, dropped and repeated messages), sent as bytes.

Every mutated call must end in a documented status -- never UNKNOWN or INTERNAL, never a hang
-- and afterwards the server is SERVING, has recorded no INTERNAL, and answers a good call
correctly. Bounded: ``FUZZ_CASES`` cases per rpc (default 60) from ``FUZZ_SEED`` (default
fixed; the failing case's seed and mutation are in the assertion message, to replay).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import torch

from attention_wire.pb import attention_pb2 as pb

from ..kv_helpers import append_messages, cache_decode_messages, cache_prefill_messages
from ..svc_helpers import (
    ServerHandle,
    collect,
    decode_messages,
    health_status,
    make_config,
    prefill_messages,
    prefill_oracle,
    random_qkv,
    request_codes,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("no_tracebacks")]
METHOD = "/attention.v1.AttentionService/"
CASES = int(os.environ.get("FUZZ_CASES", "60"))
SEED = int(os.environ.get("FUZZ_SEED", "20261123"))
# What docs/service.md promises a bad request can get (OK: a mutation that is still valid).
DOCUMENTED = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.ABORTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}
INTERESTING = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0x08, 0x10, 0x12, 0x1A)


def _flip(rng: random.Random, b: bytearray) -> str:
    i = rng.randrange(len(b))
    b[i] ^= 1 << rng.randrange(8)
    return f"flip@{i}"


def _byte(rng: random.Random, b: bytearray) -> str:
    i = rng.randrange(len(b))
    b[i] = rng.choice(INTERESTING)
    return f"byte@{i}={b[i]}"


def _insert(rng: random.Random, b: bytearray) -> str:
    i = rng.randrange(len(b) + 1)
    junk = bytes(rng.choice(INTERESTING) for _ in range(rng.randint(1, 12)))
    b[i:i] = junk
    return f"insert@{i}:{junk.hex()}"


def _delete(rng: random.Random, b: bytearray) -> str:
    i = rng.randrange(len(b))
    n = rng.randint(1, 16)
    del b[i : i + n]
    return f"delete@{i}+{n}"


def _truncate(rng: random.Random, b: bytearray) -> str:
    i = rng.randrange(len(b))
    del b[i:]
    return f"truncate@{i}"


def _duplicate(rng: random.Random, b: bytearray) -> str:
    i = rng.randrange(len(b))
    n = rng.randint(1, 32)
    b[i:i] = b[i : i + n]
    return f"duplicate@{i}+{n}"


BYTE_MUTATIONS: list[Callable[[random.Random, bytearray], str]] = [
    _flip, _byte, _insert, _delete, _truncate, _duplicate,
]


def mutate(rng: random.Random, msgs: list[bytes]) -> tuple[list[bytes], str]:
    """One to three mutations of a stream of serialized messages; returns it and a log."""
    out = [bytearray(m) for m in msgs]
    log = []
    for _ in range(rng.randint(1, 3)):
        what = rng.random()
        if what < 0.1 and len(out) > 1:
            i = rng.randrange(len(out))
            del out[i]
            log.append(f"drop msg {i}")
        elif what < 0.2:
            i = rng.randrange(len(out))
            out.insert(i, bytearray(out[i]))
            log.append(f"repeat msg {i}")
        elif what < 0.25 and len(out) > 1:
            i, j = rng.randrange(len(out)), rng.randrange(len(out))
            out[i] = out[i][: len(out[i]) // 2] + out[j][len(out[j]) // 2 :]
            log.append(f"splice {i}/{j}")
        else:
            i = rng.randrange(len(out))
            if not out[i]:
                out[i] = bytearray(b"\x00")
            log.append(f"msg {i}: " + rng.choice(BYTE_MUTATIONS)(rng, out[i]))
    return [bytes(m) for m in out], "; ".join(log)


@pytest.fixture(scope="module")
def srv() -> Any:
    # A tight byte limit: a mutated header may declare any shape, and the fuzzer must not
    # make the server allocate gigabytes.
    handle = ServerHandle(make_config(metrics_port=0, max_request_bytes=1 << 20,
                                      kv_cache_bytes=8 << 20, kv_page_bytes=4096,
                                      batching=True))
    yield handle
    handle.close()


def _corpus(op: str) -> list[bytes]:
    q, k, v = random_qkv(8, 8, 2, 1, 8, torch.float32)
    if op == "Prefill":
        msgs = prefill_messages(q, k, v, [0, 3, 8], causal=True, return_lse=True, chunk=96)
    elif op == "Decode":
        msgs = decode_messages(q[:2], k, v, [0, 3, 8], return_lse=True, chunk=96)
    elif op == "AppendKV":
        msgs = append_messages(["fz"], k[:2], v[:2], [2])
    elif op == "CachePrefill":
        msgs = cache_prefill_messages(["fz"], q[:2], k[:2], v[:2], [2], [2], store=False)
    else:
        msgs = cache_decode_messages(["fz"], q[:1], k[:1], v[:1], store=False)
    return [m.SerializeToString() for m in msgs]


def _call_stream(ch: grpc.Channel, op: str, msgs: list[bytes]) -> grpc.StatusCode:
    call = ch.stream_stream(METHOD + op, request_serializer=None, response_deserializer=None)
    try:
        for _ in call(iter(msgs), timeout=20):
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _create_cache(ch: grpc.Channel) -> None:
    stub_create = ch.unary_unary(METHOD + "CreateCaches",
                                 request_serializer=pb.CreateCachesRequest.SerializeToString,
                                 response_deserializer=pb.CreateCachesResponse.FromString)
    try:
        stub_create(pb.CreateCachesRequest(cache_ids=["fz"], layout=pb.CacheLayout(
            dtype=pb.FLOAT32, num_kv_heads=1, head_dim=8)), timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.ALREADY_EXISTS


@pytest.mark.parametrize("op", ["Prefill", "Decode", "AppendKV", "CachePrefill", "CacheDecode"])
def test_mutated_streams_get_documented_statuses(srv: ServerHandle, op: str) -> None:
    ch = srv.channel()
    _create_cache(ch)
    corpus = _corpus(op)
    assert _call_stream(ch, op, corpus) == grpc.StatusCode.OK  # the seed itself is valid
    rng = random.Random(f"{SEED}-{op}")
    seen: dict[str, int] = {}
    for case in range(CASES):
        msgs, log = mutate(rng, corpus)
        code = _call_stream(ch, op, msgs)
        assert code in DOCUMENTED, f"{op} case {case} (FUZZ_SEED={SEED}): {log} -> {code}"
        seen[code.name] = seen.get(code.name, 0) + 1
    assert seen.get("INVALID_ARGUMENT", 0) > 0, seen  # the mutations do reach validation
    _after(srv)


CONTROL = {
    "CreateCaches": pb.CreateCachesRequest(cache_ids=["a", "b"], layout=pb.CacheLayout(
        dtype=pb.BFLOAT16, num_kv_heads=2, head_dim=64)),
    "ForkCache": pb.ForkCacheRequest(source_id="fz", target_id="fz2", length=1),
    "ReleaseCaches": pb.ReleaseCachesRequest(cache_ids=["a", "b", "fz2"]),
    "ListCaches": pb.ListCachesRequest(cache_ids=["fz"]),
    "GetServerInfo": pb.GetServerInfoRequest(),
    "ListRegions": pb.ListRegionsRequest(),
    "UnregisterRegion": pb.UnregisterRegionRequest(name="nope"),
    "ConnectNixl": pb.ConnectNixlRequest(agent_name="fz", agent_metadata=b"not metadata"),
}


@pytest.mark.parametrize("method", sorted(CONTROL))
def test_mutated_unary_requests_get_documented_statuses(srv: ServerHandle, method: str) -> None:
    ch = srv.channel()
    _create_cache(ch)
    call = ch.unary_unary(METHOD + method, request_serializer=None, response_deserializer=None)
    seed = CONTROL[method].SerializeToString() or b"\x00\x00"  # an empty message: mutate 2 bytes
    rng = random.Random(f"{SEED}-{method}")
    for case in range(CASES):
        buf = bytearray(seed)
        log = "; ".join(rng.choice(BYTE_MUTATIONS)(rng, buf) if buf else "empty"
                        for _ in range(rng.randint(1, 3)))
        raw = bytes(buf)
        try:
            call(raw, timeout=10)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
        assert code in DOCUMENTED, f"{method} case {case} (FUZZ_SEED={SEED}): {log} -> {code}"
    _after(srv)


def _after(srv: ServerHandle) -> None:
    """SERVING, nothing recorded as INTERNAL/UNKNOWN, and a good call is still correct."""
    assert health_status(srv.channel()) == "SERVING"
    assert not {"INTERNAL", "UNKNOWN"} & request_codes(srv)
    q, k, v = random_qkv(8, 8, 2, 1, 8, torch.float32, seed=99)
    r = collect(srv.stub().Prefill(prefill_messages(q, k, v, [0, 5, 8], causal=True), timeout=20))
    out, _ = prefill_oracle(q, k, v, [0, 5, 8], causal=True)
    torch.testing.assert_close(r.out.double(), out, atol=1e-5, rtol=1e-5)
