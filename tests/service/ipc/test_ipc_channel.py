"""The front-end/engine channel's hot-path economies, without processes: corked sends go out
as one write per channel in order, and a front end's Params cross once (with the first Submit
that names them) and start over when its table is full (ForgetParams)."""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import threading
from typing import Any

import grpc
import pytest
import torch

from attention_service.ipc import remote_link
from attention_service.ipc.channel import (
    _HEADER,
    Cancel,
    Channel,
    Done,
    ForgetParams,
    SegmentSpan,
    Submit,
    _Decoder,
    _frame,
    _unsent,
    compact,
    corked,
)
from attention_service.ipc.remote_link import RemoteLink
from attention_service.link import ExecStats
from attention_service.params import Op, make_params
from attention_wire.pb import attention_pb2 as pb


def _read_frames(sock: socket.socket, want: int, timeout: float = 5.0) -> tuple[list[Any], int]:
    """(the messages of ``want`` frames, how many reads they took)."""
    sock.settimeout(timeout)
    decoder, got, reads = _Decoder(), [], 0
    while len(got) < want:
        data = sock.recv(1 << 16)
        assert data, "channel closed"
        reads += 1
        decoder.buf += data
        got += [msg for msg, _ in decoder.frames()]
    return got, reads


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    mine, theirs = socket.socketpair()
    channel = Channel(mine, lambda msg, fds: None, lambda: None, "test")
    channel.start()
    yield channel, theirs
    channel.close()
    theirs.close()


def test_corked_sends_wait_for_the_block_and_go_out_in_order(pair) -> None:  # type: ignore[no-untyped-def]
    channel, theirs = pair
    with corked():
        for i in range(20):
            channel.send(Cancel(i))
        theirs.settimeout(0.1)
        with pytest.raises(TimeoutError):
            theirs.recv(1)  # nothing went out yet
    got, reads = _read_frames(theirs, 20)
    assert [m.call_id for m in got] == list(range(20))
    assert reads == 1  # one write, read at once


def test_a_raw_frame_the_socket_takes_in_part_arrives_whole_and_in_order() -> None:
    """Over a small send buffer a raw frame leaves in part at once, the rest (only what was
    not sent, copied) from the writer thread; the parts may change once ``send_raw`` returns,
    and a frame sent meanwhile follows it."""
    mine, theirs = socket.socketpair()
    mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
    channel = Channel(mine, lambda msg, fds: None, lambda: None, "test")
    channel.start()
    try:
        body = bytearray(os.urandom(600_000))
        parts = [b"head", memoryview(body)[:250_000], memoryview(body)[250_000:]]
        channel.send_raw(parts)
        want = b"head" + bytes(body)
        body[:] = bytes(len(body))  # the caller's buffer reused at once
        channel.send_raw([b"next"])
        theirs.settimeout(5.0)
        got = b""
        while len(got) < 2 * 4 + len(want) + 4:
            got += theirs.recv(1 << 20)
        assert got == (len(want).to_bytes(4, "little") + want + (4).to_bytes(4, "little")
                       + b"next")
    finally:
        channel.close()
        theirs.close()


def test_only_the_unsent_bytes_are_kept_for_the_writer() -> None:
    wide = memoryview(bytearray(b"klmn")).cast("H")  # 2 items of 2 bytes: counted in bytes
    parts = [b"abc", memoryview(b"defgh"), b"ij", wide]
    for sent in range(15):
        rest = _unsent(parts, sent)
        assert b"".join(rest) == b"abcdefghijklmn"[sent:]
        # Nothing sent is copied again.
        assert sum(memoryview(p).nbytes for p in rest) == 14 - sent


def test_cork_is_per_thread_and_nested_blocks_join_the_outer(pair) -> None:  # type: ignore[no-untyped-def]
    channel, theirs = pair
    with corked():
        channel.send(Cancel(1))
        with corked():
            channel.send(Cancel(2))
        # Another thread's sends are not corked by this one's block.
        t = threading.Thread(target=channel.send, args=(Cancel(99),))
        t.start()
        t.join()
        got, _ = _read_frames(theirs, 1)
        assert [m.call_id for m in got] == [99]
        channel.send(Cancel(3))
    got, _ = _read_frames(theirs, 3)
    assert [m.call_id for m in got] == [1, 2, 3]


class _Sent:
    """A stand-in channel that records what a RemoteLink sends."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any, fds: Any = ()) -> None:
        self.sent.append(msg)


def _params(cache: str) -> Any:
    return make_params(Op.CACHE_DECODE, pb.BFLOAT16, (1, 4, 8), (1, 2, 8), [0, 1],
                       cache_ids=[cache], store=True)


class _NoBuffers:
    spans: dict[str, Any] = {}
    segment_fd = None


def test_params_cross_once_and_start_over_when_the_table_is_full(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(remote_link, "MAX_DEFINED_PARAMS", 3)
    loop = asyncio.new_event_loop()
    try:
        sent = _Sent()
        arena = type("Arena", (), {"size": 1 << 12})()
        link = RemoteLink(sent, arena, None, loop)  # type: ignore[arg-type]
        a, b = _params("a"), _params("b")

        def submit(params: Any) -> Submit:
            return link._submission(7, params, {}, "")

        # New params ride with their first Submit; equal ones are named by the same id.
        assert submit(a) == Submit(7, 0, {}, "", a)
        assert submit(_params("a")) == Submit(7, 0, {}, "")
        assert submit(b) == Submit(7, 1, {}, "", b)
        assert sent.sent == []
        ids = [submit(_params(c)).params_id for c in ("c", "d")]
        # The fourth distinct Params found the table full: the engine forgets, ids restart.
        assert ids == [2, 0]
        assert sent.sent == [ForgetParams()]
        assert submit(a) == Submit(7, 1, {}, "", a)  # forgotten with the rest: sent again
        sent.sent.clear()

        def broken(msg: Any, fds: Any = ()) -> None:
            raise OSError("the channel broke")

        link.channel = type("Broken", (), {"send": staticmethod(broken)})()
        fresh = _params("e")
        with pytest.raises(OSError):
            loop.run_until_complete(link.run(fresh, _NoBuffers(), {}, ""))
        link.channel = sent
        assert submit(fresh).params == fresh  # it never reached the engine: sent again
    finally:
        loop.close()


def test_engine_connection_resolves_params_by_id() -> None:
    from attention_service.engine.core import FrontendConnection

    seen: list[Any] = []

    class Core:
        def submit(self, params, sources, owner, done, issue_here=False):  # type: ignore[no-untyped-def]
            seen.append(params)
            return object()

    arena = torch.zeros(64, dtype=torch.uint8)
    conn = FrontendConnection(0, Core(), arena, None, lambda m: None)  # type: ignore[arg-type]
    a, b = _params("a"), _params("b")
    spans = {"q": (0, 8)}
    conn.on_message(Submit(1, 0, spans, "", a), [])
    conn.on_message(Submit(2, 1, spans, "", b), [])
    conn.on_message(Submit(3, 1, spans, ""), [])
    conn.on_message(Submit(4, 0, spans, ""), [])
    conn.on_message(ForgetParams(), [])
    conn.on_message(Submit(5, 0, spans, "", b), [])
    conn.on_message(Submit(6, 0, spans, ""), [])
    assert seen == [a, b, b, a, b, b]
    # An id the engine never got (a bug, or a Submit lost): that call fails, INTERNAL; the
    # descriptors it brought are closed and the connection goes on.
    answers = _Sent()
    conn.attach(answers)  # type: ignore[arg-type]
    r, w = os.pipe()
    try:
        conn.on_message(Submit(7, 5, spans, ""), [r])
        [failed] = answers.sent
        assert failed.call_id == 7 and failed.error.code == grpc.StatusCode.INTERNAL
        with pytest.raises(OSError):
            os.fstat(r)  # closed
        conn.on_message(Submit(8, 0, spans, ""), [])
        assert seen[-1] == b
    finally:
        os.close(w)


def test_compact_messages_cross_as_plain_tuples_with_their_descriptors() -> None:
    # Done and Submit travel as plain tuples (no class references to pickle) and arrive as
    # the same NamedTuples, descriptors in order beside ordinary frames.
    mine, theirs = socket.socketpair()
    got: list[tuple[Any, list[int]]] = []
    arrived = threading.Event()

    def on_message(msg: Any, fds: list[int]) -> None:
        got.append((msg, fds))
        if len(got) == 3:
            arrived.set()

    receiver = Channel(theirs, on_message, lambda: None, "receiver")
    receiver.start()
    sender = Channel(mine, lambda msg, fds: None, lambda: None, "sender")
    sender.start()
    stats = ExecStats(0.5, 0.1, 0.2, 0.0, 3, 4096, 17, (4097, 12))
    submit = Submit(7, 3, {"q": (0, 256), "k": SegmentSpan(0, 64, 128)}, "token-a")
    r, w = os.pipe()
    try:
        sender.send(Done(9, stats))
        sender.send(submit, [r])
        sender.send(Cancel(9))
        assert arrived.wait(5)
        (done, no_fds), (sub, fds), (cancel, _) = got
        assert type(done) is Done and type(done.stats) is ExecStats and no_fds == []
        assert done == (9, stats)
        assert type(sub) is Submit and sub == submit and len(fds) == 1
        assert type(cancel) is Cancel
        os.close(fds[0])
        assert pickle.loads(_frame(Done(9, stats), 0)[_HEADER.size:]) == (9, tuple(stats))
    finally:
        os.close(w)
        sender.close()
        receiver.close()


def test_an_unknown_compact_code_is_a_broken_channel_not_a_crash() -> None:
    decoder = _Decoder()
    payload = pickle.dumps((1, 2))
    decoder.buf += _HEADER.pack(len(payload), 999 << 16) + payload
    with pytest.raises(pickle.UnpicklingError, match="compact"):
        decoder.frames()
    with pytest.raises(ValueError, match="taken"):
        compact(tuple, 1, tuple, tuple)  # Done's code


@pytest.mark.parametrize("params", [
    make_params(Op.PREFILL, pb.BFLOAT16, (7, 4, 24), (9, 2, 24), (0, 3, 9), (0, 2, 7),
                causal=True, softmax_scale=0.3, return_lse=True),
    make_params(Op.DECODE, pb.FLOAT16, (2, 8, 64), (300, 1, 64), (0, 100, 300),
                num_splits=4, window=(16, 0), softcap=30.0, alibi_slopes=(0.5, 0.25)),
    make_params(Op.CACHE_DECODE, pb.BFLOAT16, (2, 4, 32), (2, 2, 32), (0, 1, 2),
                cache_ids=("a", "b"), store=True),
    make_params(Op.PREFILL, pb.BFLOAT16, (5, 4, 32), (5, 2, 32), (0, 5), (0, 5),
                kv_dtype=pb.FLOAT8_E4M3, kv_scales=((0.5, 2.0), (1.0, 0.25))),
], ids=["prefill-lse", "decode-modifiers", "cached", "fp8"])
def test_new_params_cross_as_field_values_and_arrive_equal(params: Any) -> None:
    # No class reference but Submit's own code: the Params arrive equal (every field, the Op
    # itself), hashable alike, and usable (the engine memoizes on them).
    spans = {"q": (0, 256)}
    frame = _frame(Submit(4, 5, spans, "token-a", params), 0)
    size, nfds = _HEADER.unpack_from(frame)
    assert nfds >> 16 and b"Params" not in frame and b"dataclass" not in frame
    decoder = _Decoder()
    decoder.buf += frame
    ((msg, fds),) = decoder.frames()
    assert type(msg) is Submit and msg[:4] == (4, 5, spans, "token-a") and fds == []
    got = msg.params
    assert got == params and hash(got) == hash(params) and got.op is params.op
    assert {f: getattr(got, f) for f in vars(params) if f != "memo"} == {
        f: getattr(params, f) for f in vars(params) if f != "memo"}
    got.memo["k"] = 1
    assert got.memo == {"k": 1} and got.num_heads == params.num_heads
    assert got.tokens == params.tokens and got.flops == params.flops
