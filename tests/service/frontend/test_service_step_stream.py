"""Step streams: CacheDecodeSteps (a decode loop on one stream, each message one whole
CacheDecode step), and PrefillSteps / DecodeSteps (stateless calls on one stream)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from attention_service.params import Op
from attention_wire.messages import IN_BAND, STEP_ERRORS_HEADER
from attention_wire.pb import attention_pb2 as pb

from ..kv_helpers import cache_decode_messages, layout, rand
from ..svc_helpers import (
    GatedBackend,
    collect,
    collect_result,
    cu_from_lengths,
    decode_messages,
    one_message,
    prefill_messages,
    random_qkv,
    request_codes,
    same_answer,
    unary_rpc,
    wait_until,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_tracebacks")]
SERVICE = "/attention.v1.AttentionService/"


class Steps:
    """A CacheDecodeSteps stream driven one step at a time, as a decode loop does."""

    def __init__(self, channel: grpc.Channel, method: str = "CacheDecodeSteps",
                 **kw: Any) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        rpc = channel.stream_stream(SERVICE + method,
                                    request_serializer=lambda m: m.SerializeToString(),
                                    response_deserializer=pb.AttentionResult.FromString)
        self.call = rpc(self._requests(), **kw)

    def _requests(self) -> Iterator[Any]:
        while (msg := self._queue.get()) is not None:
            yield msg

    def step(self, message: Any) -> pb.AttentionResult:
        self._queue.put(message)
        return next(self.call)

    def send(self, message: Any) -> None:
        """Send a step without reading its answer (a stream with in-band errors)."""
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)


def _step_message(ids: list[str], seed: int, dim: int = 16) -> Any:
    q = rand(len(ids), 4, dim, seed=seed)
    k, v = rand(len(ids), 2, dim, seed=seed + 1), rand(len(ids), 2, dim, seed=seed + 2)
    return one_message(cache_decode_messages(ids, q, k, v, cu_k=list(range(len(ids) + 1))))


def _create(stub: Any, ids: list[str]) -> None:
    stub.CreateCaches(pb.CreateCachesRequest(cache_ids=ids, layout=layout(torch.float32, 2, 16)),
                      timeout=10)


def _lengths(stub: Any, ids: list[str]) -> list[int]:
    reply = stub.ListCaches(pb.ListCachesRequest(cache_ids=ids), timeout=10)
    return [c.length for c in reply.caches]


def test_steps_on_one_stream_equal_unary_steps(server) -> None:  # type: ignore[no-untyped-def]
    """Twin caches, one stepped through the stream and one through CacheDecodeUnary: every
    answer bitwise the same, every stored token kept, the stream ended cleanly."""
    stub = server.stub()
    _create(stub, ["st0", "st1", "un0", "un1"])
    try:
        steps = Steps(server.channel(), timeout=30)
        unary = unary_rpc(server, "CacheDecodeUnary")
        for seed in range(0, 50, 5):
            got = steps.step(_step_message(["st0", "st1"], seed))
            want = unary(_step_message(["un0", "un1"], seed), timeout=30)
            same_answer(collect_result(got), collect_result(want))
            assert [c.field for c in got.chunks] == [pb.OUT, pb.LSE]
        assert list(got.stats.cache_lengths) == [10, 10]
        steps.close()
        assert list(steps.call) == [] and steps.call.code() == grpc.StatusCode.OK
        assert _lengths(stub, ["st0", "st1"]) == [10, 10]
    finally:
        stub.ReleaseCaches(pb.ReleaseCachesRequest(cache_ids=["st0", "st1", "un0", "un1"]),
                           timeout=10)


def test_a_failing_step_ends_the_stream_with_its_status(start_server) -> None:  # type: ignore[no-untyped-def]
    """An unknown cache: NOT_FOUND naming the cache, counted as a CacheDecode call; the step
    queued behind it never runs (its token is not stored); a new stream works."""
    handle = start_server(metrics_port=0)
    stub = handle.stub()
    _create(stub, ["a"])
    steps = Steps(handle.channel(), timeout=30)
    steps.step(_step_message(["a"], 1))
    steps._queue.put(_step_message(["missing"], 2))
    steps._queue.put(_step_message(["a"], 3))  # sent behind the failing step
    with pytest.raises(grpc.RpcError) as err:
        next(steps.call)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "missing" in err.value.details()
    assert _lengths(stub, ["a"]) == [1]
    assert request_codes(handle, "CacheDecode") == {"OK", "NOT_FOUND"}
    again = Steps(handle.channel(), timeout=30)
    assert list(again.step(_step_message(["a"], 4)).stats.cache_lengths) == [2]
    again.close()


def test_a_bad_message_is_refused_like_a_unary_call(server) -> None:  # type: ignore[no-untyped-def]
    rpc = server.channel().stream_stream(SERVICE + "CacheDecodeSteps")
    with pytest.raises(grpc.RpcError) as err:
        list(rpc(iter([b"\xff\xff\xff"]), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("message")


def test_the_stream_needs_the_token(start_server) -> None:  # type: ignore[no-untyped-def]
    handle = start_server(auth_token="s3cret")
    rpc = handle.channel().stream_stream(SERVICE + "CacheDecodeSteps")
    with pytest.raises(grpc.RpcError) as err:
        list(rpc(iter([_step_message(["a"], 1).SerializeToString()]), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_an_idle_stream_does_not_hold_a_drain(start_server) -> None:  # type: ignore[no-untyped-def]
    """A stream between steps is not a call in flight: the drain goes on, and the stream ends
    with an error status (the client opens a new one, elsewhere), never hangs."""
    handle = start_server()
    stub = handle.stub()
    _create(stub, ["d"])
    steps = Steps(handle.channel(), timeout=30)
    steps.step(_step_message(["d"], 1))
    t0 = time.monotonic()
    done = threading.Event()

    def stop() -> None:
        handle.run(handle.server.stop(10.0))
        done.set()

    threading.Thread(target=stop, daemon=True).start()
    assert done.wait(8.0), "the drain waited on an idle step stream"
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(grpc.RpcError) as err:
        steps.step(_step_message(["d"], 2))
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def test_a_step_after_the_drain_began_is_refused(start_server) -> None:  # type: ignore[no-untyped-def]
    handle = start_server()
    stub = handle.stub()
    _create(stub, ["r"])
    steps = Steps(handle.channel(), timeout=30)
    steps.step(_step_message(["r"], 1))
    handle.server.frontend.tracker.accepting = False  # what the drain sets first
    handle.server.frontend.tracker.refusal = "server is shutting down"
    with pytest.raises(grpc.RpcError) as err:
        steps.step(_step_message(["r"], 2))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _lengths(stub, ["r"]) == [1]


def test_streamed_steps_match_the_stream_rpc(server) -> None:  # type: ignore[no-untyped-def]
    """The same step through CacheDecode (chunked stream) and CacheDecodeSteps."""
    stub = server.stub()
    _create(stub, ["m0", "m1"])
    try:
        q, k, v = rand(1, 4, 16, seed=7), rand(1, 2, 16, seed=8), rand(1, 2, 16, seed=9)
        streamed = collect(stub.CacheDecode(cache_decode_messages(["m0"], q, k, v,
                                                                  cu_k=[0, 1])))
        steps = Steps(server.channel(), timeout=30)
        got = steps.step(one_message(cache_decode_messages(["m1"], q, k, v, cu_k=[0, 1])))
        steps.close()
        same_answer(collect_result(got), streamed)
    finally:
        stub.ReleaseCaches(pb.ReleaseCachesRequest(cache_ids=["m0", "m1"]), timeout=10)


def _stateless_call(method: str, seed: int) -> Any:
    """A Prefill or Decode call of its own shapes (GQA, odd lengths) as one message."""
    lengths = [1 + seed % 7, 5 + seed % 3]
    cu = cu_from_lengths(lengths)
    if method == "Prefill":
        q, k, v = random_qkv(cu[-1], cu[-1], 4, 2, 24, torch.float16, seed=seed)
        return one_message(prefill_messages(q, k, v, cu, causal=True, return_lse=True))
    q, _, _ = random_qkv(2, 0, 4, 2, 24, torch.float16, seed=seed)
    _, k, v = random_qkv(0, cu[-1], 4, 2, 24, torch.float16, seed=seed + 1)
    return one_message(decode_messages(q, k, v, cu, return_lse=True))


@pytest.mark.parametrize("method", ["Prefill", "Decode"])
def test_stateless_calls_on_one_stream_equal_unary_calls(start_server, method) -> None:  # type: ignore[no-untyped-def]
    """PrefillSteps / DecodeSteps: each answer bitwise the unary twin's, counted under the
    op's name; a failing call ends the stream with its status, naming the field."""
    handle = start_server(metrics_port=0)
    steps = Steps(handle.channel(), method + "Steps", timeout=30)
    unary = unary_rpc(handle, method + "Unary")
    for seed in range(4):
        message = _stateless_call(method, seed)
        same_answer(collect_result(steps.step(message)),
                    collect_result(unary(message, timeout=30)))
    steps.close()
    assert list(steps.call) == [] and steps.call.code() == grpc.StatusCode.OK
    bad = _stateless_call(method, 9)
    bad.header.q.shape[2] = 25  # q's head dim no longer k's
    steps = Steps(handle.channel(), method + "Steps", timeout=30)
    with pytest.raises(grpc.RpcError) as err:
        steps.step(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("header.k.shape[2]: head_dim 24 differs from q's")
    assert request_codes(handle, method) == {"OK", "INVALID_ARGUMENT"}


IN_BAND_METADATA = ((STEP_ERRORS_HEADER, IN_BAND),)


def _same_outputs(got: pb.AttentionResult, want: pb.AttentionResult) -> None:
    """The same output tensors and cache lengths (steps sent ahead may share a launch, so
    their batch counts differ)."""
    a, b = collect_result(got), collect_result(want)
    assert a.tensors.keys() == b.tensors.keys()
    for field, t in a.tensors.items():
        assert torch.equal(t, b.tensors[field]), pb.OutputField.Name(field)
    assert list(a.stats.cache_lengths) == list(b.stats.cache_lengths)  # type: ignore[union-attr]


def test_in_band_steps_run_ahead_in_order_and_fail_alone(start_server) -> None:  # type: ignore[no-untyped-def]
    """A stream with in-band errors takes steps before it answers earlier ones: answers in
    order, each bitwise a unary step's on twin caches; a step on an unknown cache is answered
    with its error (NOT_FOUND naming the id, counted) and changes nothing, the steps after it
    run; steps on one cache keep their order (its lengths grow one by one)."""
    handle = start_server(metrics_port=0)
    stub = handle.stub()
    _create(stub, ["ia", "ib", "ua", "ub"])
    plan = [(["ia"], ["ua"]), (["ib"], ["ub"]), (["gone"], None), (["ia", "ib"], ["ua", "ub"]),
            (["ia"], ["ua"]), (["ib"], ["ub"])]
    steps = Steps(handle.channel(), timeout=30, metadata=IN_BAND_METADATA)
    for seed, (ids, _) in enumerate(plan):
        steps.send(_step_message(ids, 10 * seed))
    unary = unary_rpc(handle, "CacheDecodeUnary")
    for seed, (_, twins) in enumerate(plan):
        got = next(steps.call)
        if twins is None:
            assert not got.chunks and not got.HasField("stats")
            assert got.error.code == grpc.StatusCode.NOT_FOUND.value[0]
            assert "gone" in got.error.details
            continue
        assert not got.HasField("error")
        _same_outputs(got, unary(_step_message(twins, 10 * seed), timeout=30))
    steps.close()
    assert list(steps.call) == [] and steps.call.code() == grpc.StatusCode.OK
    assert _lengths(stub, ["ia", "ib"]) == [3, 3]
    assert request_codes(handle, "CacheDecode") == {"OK", "NOT_FOUND"}


def test_in_band_steps_on_other_caches_start_while_one_computes(start_server) -> None:  # type: ignore[no-untyped-def]
    """While a step's launch is held (a gated backend), the steps sent behind it on other
    caches reach the engine's queue, and one on the held step's cache does not (it waits for
    that step); once released, every step is answered in order with the right lengths. A
    stream without in-band errors starts nothing behind the held step."""
    backend = GatedBackend()
    handle = start_server(backend=backend, metrics_port=0)
    stub = handle.stub()
    _create(stub, ["g0", "g1", "g2", "s0", "s1"])
    depth = handle.server.executor.queue_depth
    steps = Steps(handle.channel(), timeout=30, metadata=IN_BAND_METADATA)
    steps.send(_step_message(["g0"], 1))
    assert backend.entered.wait(10)
    for seed, ids in enumerate((["g1"], ["g2"], ["g0"]), start=2):
        steps.send(_step_message(ids, seed))
    assert wait_until(lambda: depth(Op.CACHE_DECODE) == 2)
    time.sleep(0.2)
    assert depth(Op.CACHE_DECODE) == 2  # the second g0 step waits for the first
    plain = Steps(handle.channel(), timeout=30)
    plain.send(_step_message(["s0"], 5))
    plain.send(_step_message(["s1"], 6))
    time.sleep(0.2)
    assert depth(Op.CACHE_DECODE) == 3  # s0 queued, s1 not read before s0 is answered
    backend.release.set()
    lengths = [list(next(steps.call).stats.cache_lengths) for _ in range(4)]
    assert lengths == [[1], [1], [1], [2]]
    assert [list(next(plain.call).stats.cache_lengths) for _ in range(2)] == [[1], [1]]
    for s in (steps, plain):
        s.close()
        assert list(s.call) == []


def test_in_band_steps_of_a_draining_server(start_server) -> None:  # type: ignore[no-untyped-def]
    """Once the drain began, an in-band stream answers what it read, refuses the next step
    (its error, or the stream's UNAVAILABLE status) and ends UNAVAILABLE; nothing is stored."""
    handle = start_server()
    stub = handle.stub()
    _create(stub, ["dr"])
    steps = Steps(handle.channel(), timeout=30, metadata=IN_BAND_METADATA)
    assert list(steps.step(_step_message(["dr"], 1)).stats.cache_lengths) == [1]
    handle.server.frontend.tracker.accepting = False  # what the drain sets first
    handle.server.frontend.tracker.refusal = "server is shutting down"
    steps.send(_step_message(["dr"], 2))
    with pytest.raises(grpc.RpcError) as err:
        for answer in steps.call:
            assert answer.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _lengths(stub, ["dr"]) == [1]


def test_in_band_stateless_calls_answer_errors_in_their_place(start_server) -> None:  # type: ignore[no-untyped-def]
    """PrefillSteps with in-band errors: calls sent ahead, answered in order (bitwise the
    unary twin's), a bad call answered with INVALID_ARGUMENT naming the field."""
    handle = start_server(metrics_port=0)
    steps = Steps(handle.channel(), "PrefillSteps", timeout=30, metadata=IN_BAND_METADATA)
    unary = unary_rpc(handle, "PrefillUnary")
    calls = [_stateless_call("Prefill", seed) for seed in range(4)]
    calls[1].header.q.shape[2] = 25  # q's head dim no longer k's
    for message in calls:
        steps.send(message)
    for n, message in enumerate(calls):
        got = next(steps.call)
        if n == 1:
            assert got.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert got.error.details.startswith("header.k.shape[2]: head_dim 24 differs")
        else:
            _same_outputs(got, unary(message, timeout=30))
    steps.close()
    assert list(steps.call) == [] and steps.call.code() == grpc.StatusCode.OK
