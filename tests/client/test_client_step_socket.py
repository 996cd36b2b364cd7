"""``client.decode_steps(step_socket=...)``: decode steps through the server's step socket
(``--step-socket PATH``: a Unix socket of the engine process), one process and a process group
(cpu backend), checked against the float64 reference; steps sent ahead, in-band errors, auth,
a host killed mid-loop, oversized frames, region steps and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from attention_client import (
    AsyncAttentionClient,
    AttentionAuthError,
    AttentionClient,
    AttentionError,
    AttentionInputError,
    AttentionNotFoundError,
    AttentionUnavailableError,
)
from attention_client._call_streams import SocketStream
from attention_wire.messages import SOCKET_FRAME, STEP_SOCKET_HELLO
from attention_wire.pb import attention_pb2 as pb
from attention_wire.pb.attention_pb2_grpc import AttentionServiceStub

from ._server import RunningServer, require_server, start_server
from .test_client_e2e import check_lse, check_out, f64, make
from .test_client_kv_cache import HKV, Context, D, H, cu

torch = pytest.importorskip("torch")
reference = pytest.importorskip("attention_kernels.reference")
pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def _socket_server(*extra: str) -> Iterator[RunningServer]:
    """A real server with ``--step-socket`` at a short path (``.path``: under 108 bytes)."""
    require_server()
    tmp = tempfile.mkdtemp(dir="/tmp", prefix="ss-")
    path = os.path.join(tmp, "steps.sock")
    running = start_server("--step-socket", path, *extra)
    running.path = path  # type: ignore[attr-defined]
    try:
        yield running
    finally:
        running.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    log = "".join(running.lines)
    assert "Traceback" not in log and "a step failed" not in log, log[-6000:]


@pytest.fixture(scope="module")
def one() -> Iterator[RunningServer]:
    """One process, metrics on (a later --metrics-port overrides start_server's -1)."""
    with _socket_server("--metrics-port", "0") as running:
        yield running


@pytest.fixture(scope="module")
def group() -> Iterator[RunningServer]:
    with _socket_server("--frontends", "2") as running:
        yield running


@pytest.fixture(scope="module")
def authed() -> Iterator[RunningServer]:
    with _socket_server("--auth-token", "a,b") as running:
        yield running


@pytest.fixture(params=["one-process", "two-frontends"])
def both(request: pytest.FixtureRequest) -> RunningServer:
    return request.getfixturevalue("one" if request.param == "one-process" else "group")


# ---- a raw step socket client ---------------------------------------------------------------


def _connect(path: str, hello: bytes | None = STEP_SOCKET_HELLO) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    if hello is not None:
        _send_frame(sock, hello)
    return sock


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(SOCKET_FRAME.pack(len(payload)) + payload)


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        assert got, f"the server closed the connection after {len(buf)} of {n} bytes"
        buf += got
    return buf


def _recv_frame(sock: socket.socket) -> bytes:
    (size,) = SOCKET_FRAME.unpack(_exactly(sock, SOCKET_FRAME.size))
    return _exactly(sock, size) if size else b""


def _result(sock: socket.socket) -> pb.AttentionResult:
    return pb.AttentionResult.FromString(_recv_frame(sock))


def _closed_by_server(sock: socket.socket, within: float = 10.0) -> bool:
    """The server closed the connection (EOF, or a reset) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _accepted(sock: socket.socket) -> None:
    answer = _result(sock)
    assert not answer.HasField("error"), answer.error


# ---- steps ------------------------------------------------------------------------------------


def _prompt(cache, ctx, ids, lengths, seed, kind="numpy", dtype="float32"):
    k = make(kind, dtype, sum(lengths), HKV, D, seed=seed)
    cache.append(ids, k, k, cu(lengths))
    ctx.add(ids, k, k, lengths)
    return k


def _step_inputs(n, seed, kind="numpy", dtype="float32"):
    return make(kind, dtype, n, H, D, seed=seed), make(kind, dtype, n, HKV, D, seed=seed + 1)


def _lengths(cache) -> list[int]:
    return [i["length"] for i in cache.info()]


@pytest.mark.parametrize(("kind", "dtype"), [("numpy", "float16"), ("torch", "bfloat16")])
def test_a_decode_loop_through_the_step_socket(both, kind, dtype):
    """Steps through the socket (the advertised path, then the path given): answers right
    against the float64 reference (lse too), the lengths kept as with gRPC."""
    ids = [f"lp-{kind}-a", f"lp-{kind}-b"]
    ctx = Context(ids)
    with AttentionClient(both.target, timeout=60) as c, c.kv_cache(HKV, D, dtype) as cache:
        assert c.info()["step_socket"] == both.path
        _prompt(cache, ctx, ids, [5, 18], 1, kind, dtype)
        for n, way in enumerate((True, both.path)):
            with c.decode_steps(step_socket=way) as steps:
                for step in range(4):
                    q, kn = _step_inputs(2, 10 * n + 2 * step + 10, kind, dtype)
                    with_lse = step % 2 == 0
                    got = steps.step(q, ids, kn, kn, return_lse=with_lse, num_splits=step % 3)
                    assert isinstance(steps._stream, SocketStream)
                    ctx.add(ids, kn, kn, [1, 1])
                    ref, ref_lse = reference.decode_ref(f64(q), *ctx.packed(ids),
                                                        return_lse=True)
                    if with_lse:
                        out, lse = got
                        check_lse(lse, ref_lse)
                    else:
                        out = got
                    check_out(out, ref, dtype, q)  # numpy in -> numpy out, torch -> torch
                    mem = out if isinstance(out, np.ndarray) else out.view(torch.uint8).numpy()
                    assert mem.flags.writeable  # the answer's own memory
                    assert c.last_stats["cache_lengths"] == ctx.lengths(ids)
                # No new tokens, store=False: the layout comes from the handle.
                q = make(kind, dtype, 2, H, D, seed=40 + n)
                out = steps.step(q, ids, store=False, softmax_scale=0.3)
                check_out(out, reference.decode_ref(f64(q), *ctx.packed(ids),
                                                    softmax_scale=0.3), dtype, q)
                stream = steps._stream
                assert isinstance(stream, SocketStream)
            assert stream._sock is None  # closed with the handle
            assert _lengths(cache) == ctx.lengths(ids) == [5 + 4 * (n + 1), 18 + 4 * (n + 1)]


def test_steps_that_wait_by_polling_are_answered_alike(one):
    """``spin_us``: each answer is waited for by polling first; the answers are the same
    (one step sent ahead too), and the step stream holds it; bad values, a spin without the
    socket, and a spin on the asyncio client are refused naming ``spin_us``."""
    ids = ["sp-a"]
    ctx = Context(ids)
    with AttentionClient(one.target, timeout=60) as c, c.kv_cache(HKV, D, "float32") as cache:
        _prompt(cache, ctx, ids, [6], 3)
        with c.decode_steps(step_socket=True, spin_us=2000) as steps:
            for n in range(3):
                q, kn = _step_inputs(1, 300 + 10 * n)
                ahead = steps.submit(q, ids, kn, kn) if n == 2 else None
                out = ahead.result() if ahead else steps.step(q, ids, kn, kn)
                ctx.add(ids, kn, kn, [1])
                check_out(out, reference.decode_ref(f64(q), *ctx.packed(ids)), "float32", q)
            assert isinstance(steps._stream, SocketStream) and steps._stream._spin_s == 2e-3
        for bad in (-1, 10_001, True, "5"):
            with pytest.raises(AttentionInputError, match="spin_us"):
                c.decode_steps(step_socket=True, spin_us=bad)
        with pytest.raises(AttentionInputError, match="spin_us: only steps through the step"):
            c.decode_steps(spin_us=100)

    async def main():
        async with AsyncAttentionClient(one.target) as c:
            with pytest.raises(AttentionInputError, match="spin_us: the asyncio client"):
                c.decode_steps(step_socket=True, spin_us=100)

    asyncio.run(main())


def test_steps_sent_ahead_through_the_socket_are_answered_in_order(one):
    """12 steps on the same caches sent before any answer is read (more than the server's
    steps_in_flight: the client reads the oldest first): each answered in order, right at the
    point it ran, each storing one token per cache."""
    ids = ["ah-a", "ah-b"]
    ctx = Context(ids)
    with AttentionClient(one.target, timeout=60) as c, c.kv_cache(HKV, D, "float32") as cache, \
            c.decode_steps(step_socket=True) as steps:
        assert c.info()["steps_in_flight"] == 8
        _prompt(cache, ctx, ids, [3, 7], 2)
        sent = []
        for n in range(12):
            q, kn = _step_inputs(2, 100 + 10 * n)
            pending = steps.submit(q, ids, kn, kn)
            ctx.add(ids, kn, kn, [1, 1])
            sent.append((pending, q, reference.decode_ref(f64(q), *ctx.packed(ids))))
        stream = steps._stream
        assert isinstance(stream, SocketStream)
        assert stream._unread - len(stream._early) <= 8  # never more unread on the server
        outs = []
        for n, (pending, _, _) in enumerate(sent):
            outs.append(pending.result())
            assert c.last_stats["cache_lengths"] == [3 + n + 1, 7 + n + 1]
        for out, (_, q, ref) in zip(outs, sent, strict=True):  # each its own (no shared buffer)
            check_out(out, ref, "float32", q)
        assert steps._stream is stream  # one connection throughout
        assert _lengths(cache) == [15, 19]


def _step_frame(cache_id: str, seed: int, store: bool = True) -> tuple[bytes, np.ndarray,
                                                                        np.ndarray]:
    """A whole one-sequence CacheDecode step as the socket takes it, its q and k/v."""
    q, kn = _step_inputs(1, seed)
    header = pb.DecodeHeader(
        q=pb.TensorSpec(dtype=pb.FLOAT32, shape=[1, H, D]),
        k=pb.TensorSpec(dtype=pb.FLOAT32, shape=[1, HKV, D]),
        v=pb.TensorSpec(dtype=pb.FLOAT32, shape=[1, HKV, D]),
        cache=pb.CacheTarget(cache_ids=[cache_id], store=store))
    request = pb.DecodeRequest(header=header, chunks=[
        pb.TensorChunk(field=f, offset=0, data=x.tobytes())
        for f, x in ((pb.Q, q), (pb.K, kn), (pb.V, kn))])
    return request.SerializeToString(), q, kn


def test_steps_past_the_limit_wait_unread_and_all_run_in_order(one):
    """A raw client that sends 16 steps at once before reading: the server reads no more than
    8 unanswered (the rest wait in the socket, as on a gRPC stream's flow control), then each
    as room comes; all run, each cache's in the order sent, with right answers. Malformed
    frames after the hello are INVALID_ARGUMENT in-band, and the connection goes on."""
    ids = ["bu-a", "bu-b"]
    ctx = Context(ids)
    with AttentionClient(one.target, timeout=60) as c, \
            c.kv_cache(HKV, D, "float32") as cache, _connect(one.path) as sock:
        _prompt(cache, ctx, ids, [2, 4], 11)
        _accepted(sock)
        for junk in (b"", b"\xff\xff\xff\x07junk"):
            _send_frame(sock, junk)
            answer = _result(sock)
            assert answer.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        frames = [_step_frame(ids[n % 2], 200 + 2 * n) for n in range(16)]
        sock.sendall(b"".join(SOCKET_FRAME.pack(len(f)) + f for f, _, _ in frames))
        for n, (_, q, kn) in enumerate(frames):
            cid = ids[n % 2]
            answer = _result(sock)
            assert not answer.HasField("error"), answer.error.details
            ctx.add([cid], kn, kn, [1])
            assert list(answer.stats.cache_lengths) == ctx.lengths([cid])
            out = np.frombuffer(answer.chunks[0].data, np.float32).reshape(1, H, D)
            check_out(out, reference.decode_ref(f64(q), *ctx.packed([cid])), "float32", q)
        assert _lengths(cache) == ctx.lengths(ids) == [10, 12]


def test_a_client_that_reads_no_answers_is_read_no_further(one):
    """Answers a client does not read do not pile up in the server without bound: once about
    36 MiB of them wait (8 answers of 4 MiB, and one more), the server stops reading that
    client's steps, so its sends block (here: steps of 64 sequences, 128 KiB answers, well
    before 2000 of them) and fewer steps have run than were sent; reading the answers then
    lets the rest run, every one answered, right."""
    ids = [f"nr-{i}" for i in range(64)]
    ctx = Context(ids)
    with AttentionClient(one.target, timeout=60) as c, \
            c.kv_cache(HKV, D, "float32") as cache, _connect(one.path) as sock:
        _prompt(cache, ctx, ids, [2] * 64, 12)
        _accepted(sock)
        q, kn = _step_inputs(64, 310)
        header = pb.DecodeHeader(
            q=pb.TensorSpec(dtype=pb.FLOAT32, shape=[64, H, D]),
            k=pb.TensorSpec(dtype=pb.FLOAT32, shape=[64, HKV, D]),
            v=pb.TensorSpec(dtype=pb.FLOAT32, shape=[64, HKV, D]),
            cache=pb.CacheTarget(cache_ids=ids, store=False))
        frame = pb.DecodeRequest(header=header, chunks=[
            pb.TensorChunk(field=f, offset=0, data=x.tobytes())
            for f, x in ((pb.Q, q), (pb.K, kn), (pb.V, kn))]).SerializeToString()
        data = SOCKET_FRAME.pack(len(frame)) + frame
        before = _requests(one, "OK")
        sock.settimeout(2.0)  # a send that waits this long: the server reads no more
        sent = 0
        with contextlib.suppress(TimeoutError):
            while sent < 2000:
                sock.sendall(data)  # a partial frame only at the very end (then unread)
                sent += 1
        assert sent < 2000, "the server read every step while nothing was read back"
        ran = _requests(one, "OK") - before
        assert 8 <= ran < sent
        sock.settimeout(60)
        ref = reference.decode_ref(f64(q), *ctx.packed(ids, kn, kn, 1))
        for _ in range(sent):
            answer = _result(sock)
            assert not answer.HasField("error"), answer.error.details
            out = np.frombuffer(b"".join(ch.data for ch in answer.chunks), np.float32)
            check_out(out.reshape(64, H, D), ref, "float32", q)
        assert _lengths(cache) == [2] * 64  # store=False


def test_large_steps_sent_ahead_between_small_ones(one, monkeypatch):
    """Steps of 150-490 KiB (each read into a pinned block of its size), sent ahead on the
    same caches (so they wait, their frames kept until they start) between small ones: every
    answer right, every token kept."""
    sizes = []
    send = SocketStream.send

    def spy(self, message):  # a message whole, or in pieces (a compiled step's)
        parts = message if isinstance(message, tuple) else (message,)
        sizes.append(sum(memoryview(p).nbytes for p in parts))
        return send(self, message)

    monkeypatch.setattr(SocketStream, "send", spy)
    ids = [f"lg-{i}" for i in range(160)]
    ctx = Context(ids)
    with AttentionClient(one.target, timeout=60) as c, c.kv_cache(HKV, D, "float32") as cache, \
            c.decode_steps(step_socket=True) as steps:
        _prompt(cache, ctx, ids, [1 + i % 5 for i in range(160)], 21)
        sent = []
        for n, count in enumerate((160, 1, 48, 12, 160, 1)):  # ~490, 3, 147, 37 KiB, ...
            names = ids[:count] if n % 2 == 0 else ids[-count:]
            q, kn = _step_inputs(count, 300 + 2 * n)
            sent.append((steps.submit(q, names, kn, kn), q, names))
            ctx.add(names, kn, kn, [1] * count)
            sent[-1] = (*sent[-1][:2], reference.decode_ref(f64(q), *ctx.packed(names)))
        for pending, q, ref in sent:
            check_out(pending.result(), ref, "float32", q)
        assert isinstance(steps._stream, SocketStream)
        assert len(sizes) == 6 and max(sizes) > 256 << 10
        assert sum(size > 64 << 10 for size in sizes) == 3
        assert _lengths(cache) == ctx.lengths(ids)


def test_aligned_inputs_are_read_in_place_and_the_rest_copied():
    """A step's q, k and v stay in the frame they arrived in when each came whole in one
    chunk at a 16-byte offset (``message_frame`` lays a decode loop's steps out so); a tensor
    in two chunks, or a frame read at an odd address, goes through the step's own block."""
    from attention_service.engine.jobs import ByteBase
    from attention_service.step_socket import _in_place
    from attention_wire.messages import DATA_ALIGN, message_frame, read_request

    b = 37
    header = pb.DecodeHeader(cache=pb.CacheTarget(cache_ids=[f"c{i}" for i in range(b)])
                             ).SerializeToString()
    sizes = {"q": b * H * D * 2, "k": b * HKV * D * 2, "v": b * HKV * D * 2, "out": 1}
    rng = np.random.default_rng(5)
    data = {n: rng.integers(0, 256, sizes[n], dtype=np.uint8).tobytes() for n in "qkv"}

    def placed(message: bytes, shift: int = 0) -> dict[str, tuple[object, int]]:
        frame = ByteBase(torch.zeros(len(message) + shift, dtype=torch.uint8))
        view = memoryview(frame.np)[shift:]
        view[:] = message
        got = _in_place(read_request(view, lambda raw: None).chunks, frame, sizes)
        for name, (base, at) in got.items():
            assert base is frame and at % DATA_ALIGN == 0
            assert frame.np[at : at + sizes[name]].tobytes() == data[name]
        return got

    frame = message_frame(header, [sizes[n] for n in "qkv"])
    aligned = b"".join(x for pair in zip(frame, data.values(), strict=True) for x in pair)
    assert set(placed(aligned)) == {"q", "k", "v"}
    assert placed(aligned, shift=1) == {}
    half = sizes["q"] // 2
    split = pb.DecodeRequest(header=pb.DecodeHeader.FromString(header), chunks=[
        pb.TensorChunk(field=pb.Q, data=data["q"][:half]),
        pb.TensorChunk(field=pb.Q, offset=half, data=data["q"][half:]),
        pb.TensorChunk(field=pb.K, data=data["k"]), pb.TensorChunk(field=pb.V, data=data["v"]),
    ]).SerializeToString()
    assert "q" not in placed(split)


def test_a_message_of_a_checked_form_skips_the_parse_and_anything_else_does_not():
    """A connection keeps the form of a message read the long way (its header, its chunk
    heads at their offsets, every input whole and aligned); a later message with the same
    fixed bytes, and nothing after its tensors but a ``step_timeout_ms``, has that form (its
    params and buffers as checked), whatever its tensor bytes. Any other difference (a chunk
    head, a field after the tensors, a shorter message, a header by a byte, the header's
    length in an overlong varint) reads the long way; so does a form with a tensor in two
    chunks."""
    import threading

    from attention_service.config import ServerConfig
    from attention_service.engine.jobs import ByteBase
    from attention_service.frontend.streams import Upload, UploadBudget, start_upload
    from attention_service.frontend.validation import Limits
    from attention_service.step_socket import OP, _in_place, _SocketConnection, _StepForm
    from attention_wire.alloc import layout
    from attention_wire.messages import message_frame, step_timeout, varint

    b = 5
    ids = [f"f{i}" for i in range(b)]
    header = pb.DecodeHeader(
        q=pb.TensorSpec(dtype=pb.FLOAT16, shape=[b, H, D]),
        k=pb.TensorSpec(dtype=pb.FLOAT16, shape=[b, HKV, D]),
        v=pb.TensorSpec(dtype=pb.FLOAT16, shape=[b, HKV, D]),
        cu_seqlens_k=list(range(b + 1)), cache=pb.CacheTarget(cache_ids=ids, store=True),
    ).SerializeToString() + pb.DecodeHeader(num_splits=18).SerializeToString()
    # (num_splits written last: the header ends in 0x12, the chunks' key: see below)
    assert header[-1] == 0x12 and len(header) < 128
    sizes = [b * H * D * 2, b * HKV * D * 2, b * HKV * D * 2]
    frame = message_frame(header, sizes)
    rng = np.random.default_rng(11)

    def message(head: bytes = header, tail: bytes = b"", pieces=frame) -> memoryview:
        data = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
        if head != header:
            pieces = message_frame(head, sizes)
        raw = b"".join(x for pair in zip(pieces, data, strict=True) for x in pair) + tail
        block = ByteBase(torch.zeros(len(raw), dtype=torch.uint8))
        block.np[:] = np.frombuffer(raw, np.uint8)
        return memoryview(block.np), block  # type: ignore[return-value]

    conn = _SocketConnection.__new__(_SocketConnection)
    conn._lock, conn._forms = threading.Lock(), {}
    first, block = message()
    upload = Upload(UploadBudget(1 << 30, 1.0))
    parsed, by_name = start_upload(upload, OP, first, Limits.of(ServerConfig()), "")
    placed = _in_place(parsed.chunks, block, by_name)
    offsets, total = layout({n: x for n, x in by_name.items() if n not in placed})
    form = _StepForm.of(first, header, upload, by_name, placed, offsets, total,
                        frozenset(ids))
    assert form is not None and form.params is upload.params
    assert form.inputs_at == {n: at for n, (_, at) in placed.items()} and len(form.inputs_at) == 3
    conn._forms[form.header] = form

    assert conn._match(first) == (form, 0)
    assert conn._match(message()[0]) == (form, 0)  # other tensor bytes: the same form
    timed = message(tail=step_timeout(time.monotonic() + 3))[0]
    got, ms = conn._match(timed)
    assert got is form and 2900 < ms <= 3000
    unknown = pb.DecodeRequest(step_timeout_ms=5).SerializeToString() + b"\x98\x06\x01"
    assert conn._match(message(tail=unknown)[0]) == (None, 0)  # an unknown field after
    assert conn._match(message()[0][:-1]) == (None, 0)  # a byte short
    other = header.replace(b"f4", b"f5")
    assert conn._match(message(head=other)[0]) == (None, 0)  # another header
    # The header's length in an overlong varint, and q's chunk key (0x12) dropped: the same
    # bytes at the same offsets from the header's last byte on, which is that key; corrupt for
    # protobuf and the long way, so not of the form either.
    skip = 1 + len(varint(len(header))) + len(header) + 1  # key, length, header, chunks' key
    crafted = (bytes([0x0A, len(header) | 0x80, 0]) + header + frame[0][skip:], *frame[1:])
    assert sum(map(len, crafted)) == sum(map(len, frame))
    assert conn._match(message(pieces=crafted)[0]) == (None, 0)
    heads = list(frame)
    heads[1] = heads[1][:-1] + bytes([heads[1][-1] ^ 1])  # k's chunk head, one bit
    assert conn._match(message(pieces=tuple(heads))[0]) == (None, 0)
    # A tensor in two chunks has no form: its bytes are copied, not where they lie.
    half = sizes[0] // 2
    q = rng.integers(0, 256, sizes[0], dtype=np.uint8).tobytes()
    split = pb.DecodeRequest(header=pb.DecodeHeader.FromString(header), chunks=[
        pb.TensorChunk(field=pb.Q, data=q[:half]),
        pb.TensorChunk(field=pb.Q, offset=half, data=q[half:]),
        pb.TensorChunk(field=pb.K, data=bytes(sizes[1])),
        pb.TensorChunk(field=pb.V, data=bytes(sizes[2])),
    ]).SerializeToString()
    sblock = ByteBase(torch.zeros(len(split), dtype=torch.uint8))
    sblock.np[:] = np.frombuffer(split, np.uint8)
    upload = Upload(UploadBudget(1 << 30, 1.0))
    parsed, by_name = start_upload(upload, OP, memoryview(sblock.np), Limits.of(ServerConfig()),
                                   "")
    placed = _in_place(parsed.chunks, sblock, by_name)
    offsets, total = layout({n: x for n, x in by_name.items() if n not in placed})
    assert _StepForm.of(memoryview(sblock.np), header, upload, by_name, placed, offsets, total,
                        frozenset(ids)) is None


def test_a_step_of_regions_only_has_a_form():
    """A step whose tensors all lie in regions sends its header alone: it has a form too (no
    inputs in the message, its regions as the header named them), matched by that header
    and, as any form, not by another or by a message with more after it."""
    import threading

    from attention_service.config import ServerConfig
    from attention_service.frontend.streams import Upload, UploadBudget, start_upload
    from attention_service.frontend.validation import Limits
    from attention_service.step_socket import OP, _SocketConnection, _StepForm
    from attention_wire.alloc import layout

    header = _region_header(["rf-a"], "a-region", 4096).SerializeToString()
    raw = memoryview(pb.DecodeRequest(header=pb.DecodeHeader.FromString(header))
                     .SerializeToString())
    upload = Upload(UploadBudget(1 << 30, 1.0))
    parsed, by_name = start_upload(upload, OP, raw, Limits.of(ServerConfig()), "")
    assert set(upload.regions) == {"q", "k", "v"} and not parsed.chunks
    offsets, total = layout(by_name)
    form = _StepForm.of(raw, parsed.header_bytes, upload, by_name, {}, offsets, total,
                        frozenset(["rf-a"]))
    assert form is not None and form.inputs_at == {} and form.end == len(raw)
    assert form.regions is upload.regions and form.regions["q"].offset == 4096
    conn = _SocketConnection.__new__(_SocketConnection)
    conn._lock, conn._forms = threading.Lock(), {form.header: form}
    assert conn._match(raw) == (form, 0)
    other = pb.DecodeRequest(header=_region_header(["rf-a"], "a-region", 8192)).SerializeToString()
    assert conn._match(memoryview(other)) == (None, 0)  # another span: another header
    assert conn._match(memoryview(bytes(raw) + b"\x98\x06\x01")) == (None, 0)


def _one_checked_step(steps, cache, ctx, cid, seed):
    """A cache ``cid`` of a few tokens and one step on it through ``steps``, checked against
    the float64 reference; (q, k/v) of the step."""
    _prompt(cache, ctx, [cid], [4], seed)
    q, kn = _step_inputs(1, seed + 1)
    out = steps.step(q, [cid], kn, kn)
    ctx.add([cid], kn, kn, [1])
    check_out(out, reference.decode_ref(f64(q), *ctx.packed([cid])), "float32", q)
    assert isinstance(steps._stream, SocketStream)
    return q, kn


def test_a_failed_step_is_answered_in_band_and_the_socket_goes_on(one):
    ids = ["ib-a"]
    ctx = Context(ids)
    with AttentionClient(one.target, timeout=60) as c, c.kv_cache(HKV, D, "float32") as cache, \
            c.decode_steps(step_socket=True) as steps:
        q, kn = _one_checked_step(steps, cache, ctx, ids[0], 3)
        stream = steps._stream
        with pytest.raises(AttentionNotFoundError, match="ib-nope"):
            steps.step(q, ["ib-nope"], kn, kn)
        # The failed step's request was kept as a template: without the outputs it never read.
        assert steps._templates and not any(t.prep.expecting_reply
                                            for t in steps._templates.values())
        with pytest.raises(AttentionNotFoundError, match="ib-gone"):  # one of two ids
            steps.step(np.concatenate([q, q]), ["ib-a", "ib-gone"], np.concatenate([kn, kn]),
                       np.concatenate([kn, kn]))
        assert _lengths(cache) == [5]  # the failed steps changed nothing
        q, kn = _step_inputs(1, 7)
        out = steps.step(q, ids, kn, kn)
        ctx.add(ids, kn, kn, [1])
        check_out(out, reference.decode_ref(f64(q), *ctx.packed(ids)), "float32", q)
        assert steps._stream is stream and stream.alive()  # the same connection
        assert _lengths(cache) == [6]


def test_caches_of_another_caller_are_not_found_through_the_socket(authed):
    """Ownership is the token's: b's step on a's caches fails as over gRPC (NOT_FOUND, the
    same class), changes nothing, and b's socket goes on."""
    ids = ["own-a"]
    ctx = Context(ids)
    with AttentionClient(authed.target, token="a", timeout=60) as a, \
            AttentionClient(authed.target, token="b", timeout=60) as b, \
            a.kv_cache(HKV, D, "float32") as cache:
        _prompt(cache, ctx, ids, [6], 4)
        q, kn = _step_inputs(1, 8)
        with pytest.raises(AttentionError) as over_grpc:
            b.decode_step(q, ids, kn, kn)
        assert type(over_grpc.value) is AttentionNotFoundError
        with b.decode_steps(step_socket=True) as steps:
            with pytest.raises(AttentionError) as over_socket:
                steps.step(q, ids, kn, kn)
            assert type(over_socket.value) is type(over_grpc.value)
            assert over_socket.value.code == over_grpc.value.code == grpc.StatusCode.NOT_FOUND
            assert "own-a" in str(over_socket.value)
            stream = steps._stream
            assert isinstance(stream, SocketStream) and stream.alive()
            with b.kv_cache(HKV, D, "float32") as mine:  # b's own cache, same socket
                kb = make("numpy", "float32", 2, HKV, D, seed=9)
                mine.append(["own-b"], kb, kb, [0, 2])
                out = steps.step(q, ["own-b"], kn, kn)
                theirs = Context(["own-b"])
                theirs.add(["own-b"], kb, kb, [2])
                theirs.add(["own-b"], kn, kn, [1])
                check_out(out, reference.decode_ref(f64(q), *theirs.packed(["own-b"])),
                          "float32", q)
                assert steps._stream is stream
        assert _lengths(cache) == [6]
        # a's own steps through the socket see them.
        with a.decode_steps(step_socket=True) as steps:
            out = steps.step(q, ids, kn, kn)
            ctx.add(ids, kn, kn, [1])
            check_out(out, reference.decode_ref(f64(q), *ctx.packed(ids)), "float32", q)
        assert _lengths(cache) == [7]


def test_the_hello_checks_the_token(authed):
    """A wrong or missing token: an UNAUTHENTICATED answer, then the server closes; no hello
    at all (garbage first): closed at once; a right token: an empty answer, and steps."""
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED.value[0]
    for presented in (b"Bearer wrong", b"", b"Bearer a,b"):
        with _connect(authed.path, STEP_SOCKET_HELLO + b"\n" + presented) as sock:
            answer = _result(sock)
            assert answer.HasField("error") and answer.error.code == unauthenticated
            assert "bearer token" in answer.error.details
            assert _closed_by_server(sock)
    with _connect(authed.path, b"GET / HTTP/1.1\r\n\r\n") as sock:
        assert _closed_by_server(sock)
    for token in (b"a", b"b"):
        with _connect(authed.path, STEP_SOCKET_HELLO + b"\nBearer " + token) as sock:
            assert _recv_frame(sock) == b""  # accepted: an empty AttentionResult
            # A step then: an in-band error for a cache it does not have, and still open.
            _send_frame(sock, _step_frame("hello-none", 3)[0])
            answer = _result(sock)
            assert answer.error.code == grpc.StatusCode.NOT_FOUND.value[0]
            assert "hello-none" in answer.error.details
            assert not _closed_by_server(sock, 0.2)


def test_a_wrong_token_through_the_library_is_an_auth_error(authed):
    """The socket's own refusal (info() answered as for a right token, so only the socket's
    hello can refuse): AttentionAuthError naming the socket."""
    with AttentionClient(authed.target, token="a") as good:
        info = good.info()
    assert info["step_socket"] == authed.path
    with AttentionClient(authed.target, token="wrong") as c:
        with pytest.raises(AttentionAuthError):  # gRPC refuses it first
            c.info()
        c.info = lambda *a, **kw: info  # type: ignore[method-assign]
        for way in (True, authed.path):
            with c.decode_steps(step_socket=way) as steps:
                q, kn = _step_inputs(1, 2)
                with pytest.raises(AttentionAuthError, match="step socket") as err:
                    steps.step(q, ["x"], kn, kn)
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
                assert authed.path in str(err.value)


def test_the_async_clients_frames_are_read_whole_in_any_pieces():
    """The asyncio client's protocol reads each answer frame, however the bytes arrive (a
    byte at a time, a head split from its payload, empty frames), into an array of its own,
    in order; a lost connection fails the reader waiting, after the frames that came."""
    from attention_client._call_streams import StreamError, _Frames

    payloads = [b"", b"x" * 70_000, b"ab", b"", bytes(range(256)) * 3]
    wire = b"".join(SOCKET_FRAME.pack(len(p)) + p for p in payloads)

    async def main() -> None:
        frames = _Frames()
        at, step = 0, 1
        while at < len(wire):  # pieces of 1, 2, 3, ... bytes, as the transport may give
            buf = frames.get_buffer(-1)
            n = min(len(buf), step, len(wire) - at)
            buf[:n] = wire[at : at + n]
            frames.buffer_updated(n)
            at, step = at + n, step % 4099 + 1
        got = [await frames.next_frame() for _ in payloads]
        assert [bytes(g) for g in got] == payloads
        assert all(isinstance(g, np.ndarray) and g.flags.writeable for g in got if len(g))
        waiting = asyncio.ensure_future(frames.next_frame())
        await asyncio.sleep(0)
        frames.connection_lost(None)
        with pytest.raises(StreamError, match="closed"):
            await waiting

    asyncio.run(main())


def test_an_async_decode_loop_through_the_step_socket(both):
    """The asyncio client through the socket: steps and 12 sent ahead on the same caches,
    answered in order and right against the float64 reference, an in-band error in between,
    the lengths kept; closing the handle closes the connection."""
    from attention_client._call_streams import AsyncSocketStream

    ids = ["as-a", "as-b"]
    ctx = Context(ids)

    async def main() -> None:
        async with AsyncAttentionClient(both.target, timeout=60) as c:
            cache = c.kv_cache(HKV, D, "float32")
            k = make("numpy", "float32", 9, HKV, D, seed=3)
            await cache.append(ids, k, k, cu([4, 5]))
            ctx.add(ids, k, k, [4, 5])
            async with c.decode_steps(step_socket=True) as steps:
                q, kn = _step_inputs(2, 7)
                out = await steps.step(q, ids, kn, kn)
                ctx.add(ids, kn, kn, [1, 1])
                check_out(out, reference.decode_ref(f64(q), *ctx.packed(ids)), "float32", q)
                stream = steps._stream
                assert isinstance(stream, AsyncSocketStream)
                with pytest.raises(AttentionNotFoundError, match="as-none"):
                    await steps.step(q, ["as-none", "as-b"], kn, kn)
                sent = []
                for n in range(12):
                    q, kn = _step_inputs(2, 200 + 10 * n)
                    sent.append((await steps.submit(q, ids, kn, kn), q))
                    ctx.add(ids, kn, kn, [1, 1])
                    sent[-1] += (reference.decode_ref(f64(q), *ctx.packed(ids)),)
                for n, (pending, q, ref) in enumerate(sent):
                    check_out(await pending.result(), ref, "float32", q)
                    assert c.last_stats["cache_lengths"] == [4 + n + 2, 5 + n + 2]
                assert steps._stream is stream
            assert not stream.alive()
            assert [i["length"] for i in await cache.info()] == [17, 18]
            await cache.release()

    asyncio.run(main())


def test_a_socket_of_another_server_is_refused(one, group):
    """The hello names the server instance meant (ServerInfo.instance_id): another server's
    socket refuses it (FAILED_PRECONDITION) and closes, so steps never run on caches of a
    server the client did not call; a client of one server given the other's path gets that
    error, and no step runs."""
    assert one.path != group.path
    with AttentionClient(one.target) as a, AttentionClient(group.target) as b:
        mine, theirs = a.info()["instance_id"], b.info()["instance_id"]
        assert mine and theirs and mine != theirs
        with _connect(group.path, STEP_SOCKET_HELLO + mine.encode() + b"\n") as sock:
            answer = _result(sock)
            assert answer.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
            assert mine in answer.error.details and theirs in answer.error.details
            assert _closed_by_server(sock)
        with _connect(group.path, STEP_SOCKET_HELLO + theirs.encode() + b"\n") as sock:
            _accepted(sock)
        q, kn = _step_inputs(1, 2)
        with a.decode_steps(step_socket=group.path) as steps, \
                pytest.raises(AttentionError, match="another server") as err:
            steps.step(q, ["x"], kn, kn)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_no_step_socket_or_nothing_there_fails(server, one):
    q, kn = _step_inputs(1, 2)
    with AttentionClient(server.target) as c:
        assert not c.info()["step_socket"]
        with c.decode_steps(step_socket=True) as steps, pytest.raises(AttentionError) as err:
            steps.step(q, ["x"], kn, kn)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "--step-socket" in str(err.value)
    nowhere = os.path.join(os.path.dirname(one.path), "nothing.sock")
    with AttentionClient(one.target) as c:
        with c.decode_steps(step_socket=nowhere) as steps, \
                pytest.raises(AttentionUnavailableError) as err:
            steps.step(q, ["x"], kn, kn)
        assert nowhere in str(err.value)
        with pytest.raises(AttentionInputError, match="step_socket"):
            c.decode_steps(step_socket=1)

    async def main():
        async with AsyncAttentionClient(server.target) as c:
            async with c.decode_steps(step_socket=True) as steps:
                with pytest.raises(AttentionError, match="--step-socket"):
                    await steps.step(q, ["x"], kn, kn)
            async with c.decode_steps(step_socket=nowhere) as steps:
                with pytest.raises(AttentionUnavailableError, match=re.escape(nowhere)):
                    await steps.step(q, ["x"], kn, kn)

    asyncio.run(main())


# A model host: its decode loop through the step socket, two micro-batches' steps in flight
# (several each), until killed. Step n of group g stores _host_kv(g, n).
_HOST = """
import sys, numpy as np
from attention_client import AttentionClient

def _host_kv(g, n, b):
    return np.random.default_rng(1000 * g + n).standard_normal((b, 2, 16)).astype(np.float32)

target, prefix = sys.argv[1], sys.argv[2]
groups = [[f"{prefix}-{i}" for i in range(3)], [f"{prefix}-{i}" for i in range(3, 6)]]
sent = [0, 0]

def send(steps, g):
    ids = groups[g]
    kn = _host_kv(g, sent[g], len(ids))
    q = np.ones((len(ids), 4, 16), np.float32)
    sent[g] += 1
    return steps.submit(q, ids, kn, kn)

with AttentionClient(target) as c, c.decode_steps(step_socket=True) as steps:
    pending = [[send(steps, g) for _ in range(3)] for g in (0, 1)]
    print("looping", flush=True)
    while True:  # until killed
        for g in (0, 1):
            pending[g].pop(0).result()
            pending[g].append(send(steps, g))
"""


def _host_kv(g: int, n: int, b: int) -> np.ndarray:
    return np.random.default_rng(1000 * g + n).standard_normal((b, 2, 16)).astype(np.float32)


def test_a_host_killed_mid_loop_leaves_its_caches_usable(both):
    """A model host killed (SIGKILL) with steps in flight on its step socket: the caches are
    soon idle, each micro-batch's caches kept the same number of the loop's steps (whole or
    not at all), and a step on them through the socket answers right."""
    prefix = f"kill-{both.proc.pid}"
    ids = [f"{prefix}-{i}" for i in range(6)]
    with AttentionClient(both.target, timeout=60) as c:
        cache = c.kv_cache(2, 16, "float32")
        prompt = make("numpy", "float32", 6 * 256, 2, 16, seed=1)
        cache.append(ids, prompt, prompt, [256 * i for i in range(7)])
        host = subprocess.Popen([sys.executable, "-c", _HOST, both.target, prefix],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert host.stdout is not None and host.stdout.readline().strip() == "looping"
            deadline = time.monotonic() + 30
            while min(i["length"] for i in cache.info()) < 256 + 6:  # some steps landed
                assert time.monotonic() < deadline and host.poll() is None
                time.sleep(0.02)
        finally:
            host.kill()
            host.wait(10)
        deadline = time.monotonic() + 20
        while any(i["busy"] for i in cache.info()):
            assert time.monotonic() < deadline, "the caches stayed busy"
            time.sleep(0.05)
        info = cache.info()
        assert [i["cache_id"] for i in info] == ids
        keys = []
        for g in range(2):
            (length,) = {i["length"] for i in info[3 * g: 3 * g + 3]}  # each step whole
            steps_kept = length - 256
            assert steps_kept >= 6
            stored = [_host_kv(g, n, 3) for n in range(steps_kept)]
            for j in range(3):
                row = 3 * g + j
                keys.append(np.concatenate([prompt[256 * row: 256 * (row + 1)],
                                            *[s[j: j + 1] for s in stored]]))
        q = make("numpy", "float32", 6, 4, 16, seed=2)
        kn = make("numpy", "float32", 6, 2, 16, seed=3)
        with c.decode_steps(step_socket=True) as steps:
            out = steps.step(q, ids, kn, kn)
        packed = np.concatenate([np.concatenate([k, kn[j: j + 1]]) for j, k in enumerate(keys)])
        cu_k = torch.tensor([0, *np.cumsum([len(k) + 1 for k in keys])], dtype=torch.int32)
        ref = reference.decode_ref(f64(q), f64(packed), f64(packed), cu_k)
        check_out(out, ref, "float32", q)
        assert [i["length"] for i in cache.info()] == [len(k) + 1 for k in keys]
        cache.release()


def test_a_frame_over_the_limit_closes_its_connection_only(one):
    from attention_service.config import MAX_MESSAGE_BYTES

    with _connect(one.path) as other:  # another connection, open throughout
        _accepted(other)
        with _connect(one.path) as sock:
            _accepted(sock)
            sock.sendall(SOCKET_FRAME.pack(MAX_MESSAGE_BYTES + 1))
            assert _closed_by_server(sock, 5.0)
        with _connect(one.path, hello=None) as sock:  # before the hello, too
            sock.sendall(SOCKET_FRAME.pack(MAX_MESSAGE_BYTES + 1))
            assert _closed_by_server(sock, 5.0)
        with _connect(one.path) as sock:  # at the limit: the server waits for its bytes
            _accepted(sock)
            sock.sendall(SOCKET_FRAME.pack(MAX_MESSAGE_BYTES) + b"x" * 1024)
            assert not _closed_by_server(sock, 0.3)
        assert not _closed_by_server(other, 0.2)
    with AttentionClient(one.target, timeout=60) as c, c.kv_cache(HKV, D, "float32") as cache, \
            c.decode_steps(step_socket=True) as steps:  # the server still serves
        _one_checked_step(steps, cache, Context(["big-a"]), "big-a", 5)


def _region_header(ids, region, q_offset, nbytes=1 << 20):
    """A region step's header (q at ``q_offset``, k and v at the region's start)."""
    qb, kvb = H * D * 4, HKV * D * 4
    return pb.DecodeHeader(
        q=pb.TensorSpec(dtype=pb.FLOAT32, shape=[1, H, D]),
        k=pb.TensorSpec(dtype=pb.FLOAT32, shape=[1, HKV, D]),
        v=pb.TensorSpec(dtype=pb.FLOAT32, shape=[1, HKV, D]),
        cache=pb.CacheTarget(cache_ids=ids, store=True),
        regions=pb.TensorRegions(
            q=pb.RegionSpan(region=region, offset=q_offset, byte_size=qb),
            k=pb.RegionSpan(region=region, offset=0, byte_size=kvb),
            v=pb.RegionSpan(region=region, offset=kvb, byte_size=kvb)))


def test_region_steps_through_the_socket(one):
    """q, k/v and ``out=`` in a registered region: no tensor bytes, the answer written into
    ``out``, the tokens kept; a span past the region's end is refused as over gRPC (same
    code, naming the field) and changes nothing; a step of a kept form whose region has gone
    is refused (NOT_FOUND, naming it) and changes nothing."""
    ids = ["rs-a", "rs-b"]
    ctx = Context(ids)
    with AttentionClient(one.target, timeout=60) as c, c.kv_cache(HKV, D, "float32") as cache:
        region = c.register_shm(1 << 20)
        _prompt(cache, ctx, ids, [3, 5], 40)
        q, kn = region.empty((2, H, D), np.float32), region.empty((2, HKV, D), np.float32)
        out = region.empty((2, H, D), np.float32)
        with c.decode_steps(step_socket=True) as steps:
            for n in range(3):
                q[...] = make("numpy", "float32", 2, H, D, seed=41 + n)
                kn[...] = make("numpy", "float32", 2, HKV, D, seed=51 + n)
                out[...] = np.nan
                assert steps.step(q, ids, kn, kn, out=out, use_regions=True) is out
                assert isinstance(steps._stream, SocketStream)
                ctx.add(ids, kn.copy(), kn.copy(), [1, 1])
                check_out(out, reference.decode_ref(f64(q), *ctx.packed(ids)), "float32", q)
                s = c.last_stats
                assert s["bytes_in"] == 0 and s["region_bytes_in"] > 0 and s["bytes_out"] == 0
                assert s["cache_lengths"] == ctx.lengths(ids)
        lengths = _lengths(cache)
        header = _region_header(ids[:1], region.name, (1 << 20) - 256)
        stub = AttentionServiceStub(c._base_channels[0])
        with pytest.raises(grpc.RpcError) as err:
            list(stub.CacheDecode(iter([pb.DecodeRequest(header=header)]),
                                  metadata=c._metadata or None))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "header.regions.q" in err.value.details()
        with _connect(one.path) as sock:
            _accepted(sock)
            _send_frame(sock, pb.DecodeRequest(header=header).SerializeToString())
            answer = _result(sock)
            assert answer.error.code == err.value.code().value[0]
            assert "header.regions.q" in answer.error.details
            # The same span in bounds, on the same connection: answered (OUT in the answer).
            _send_frame(sock, pb.DecodeRequest(
                header=_region_header(ids[:1], region.name, 2 * HKV * D * 4)
            ).SerializeToString())
            answer = _result(sock)
            assert not answer.HasField("error") and answer.stats.cache_lengths == [lengths[0] + 1]
            # Again: the connection kept that message's form (no tensor bytes: its header
            # alone), and a step of that form still has its regions looked up every time.
            in_bounds = pb.DecodeRequest(
                header=_region_header(ids[:1], region.name, 2 * HKV * D * 4)
            ).SerializeToString()
            _send_frame(sock, in_bounds)
            answer = _result(sock)
            assert not answer.HasField("error") and answer.stats.cache_lengths == [lengths[0] + 2]
            region.close()  # unregistered: the same form's next step is refused
            _send_frame(sock, in_bounds)
            answer = _result(sock)
            assert answer.error.code == grpc.StatusCode.NOT_FOUND.value[0]
            assert region.name in answer.error.details
        assert _lengths(cache) == [lengths[0] + 2, lengths[1]]


def test_a_region_of_another_caller_is_refused_through_the_socket(authed):
    """b naming a's region: refused as over gRPC (same code), through the socket."""
    with AttentionClient(authed.target, token="a") as a, \
            AttentionClient(authed.target, token="b") as b, \
            b.kv_cache(HKV, D, "float32") as cache:
        region = a.register_shm(1 << 16)
        k = make("numpy", "float32", 2, HKV, D, seed=1)
        cache.append(["rb-b"], k, k, [0, 2])
        header = _region_header(["rb-b"], region.name, 2 * HKV * D * 4)
        stub = AttentionServiceStub(b._base_channels[0])
        with pytest.raises(grpc.RpcError) as err:
            list(stub.CacheDecode(iter([pb.DecodeRequest(header=header)]),
                                  metadata=b._metadata or None))
        assert err.value.code() != grpc.StatusCode.OK
        with _connect(authed.path, STEP_SOCKET_HELLO + b"\nBearer b") as sock:
            _accepted(sock)
            _send_frame(sock, pb.DecodeRequest(header=header).SerializeToString())
            answer = _result(sock)
            assert answer.error.code == err.value.code().value[0]
            assert region.name in answer.error.details
        assert _lengths(cache) == [2]
        region.close()


def _requests(running: RunningServer, code: str) -> float:
    text = running.metrics()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("attention_requests_total{") and 'rpc="CacheDecode"' in line \
                and f'code="{code}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_socket_steps_are_counted_as_cache_decode(one):
    ok, missing = _requests(one, "OK"), _requests(one, "NOT_FOUND")
    ids = ["mt-a"]
    with AttentionClient(one.target, timeout=60) as c, c.kv_cache(HKV, D, "float32") as cache, \
            c.decode_steps(step_socket=True) as steps:
        k = make("numpy", "float32", 2, HKV, D, seed=1)
        cache.append(ids, k, k, [0, 2])
        for n in range(5):
            q, kn = _step_inputs(1, 10 + n)
            steps.step(q, ids, kn, kn)
        with pytest.raises(AttentionNotFoundError):
            steps.step(q, ["mt-none"], kn, kn)
        assert isinstance(steps._stream, SocketStream)
    # A step is counted just after its answer is sent: wait for the counts to settle.
    deadline = time.monotonic() + 10
    while (_requests(one, "OK") - ok, _requests(one, "NOT_FOUND") - missing) != (5, 1):
        assert time.monotonic() < deadline, (_requests(one, "OK") - ok,
                                             _requests(one, "NOT_FOUND") - missing)
        time.sleep(0.05)
    time.sleep(0.2)  # and no more come
    assert _requests(one, "OK") - ok == 5
    assert _requests(one, "NOT_FOUND") - missing == 1


@pytest.mark.parametrize("frontends", ["1", "2"])
def test_the_advertised_socket_is_there_once_the_server_answers(frontends):
    """Right after the ready line: a client that reads info() finds the step socket it
    advertises (both process models listen before a front end can answer); until the
    server serves, its steps are answered UNAVAILABLE "warming up", as gRPC calls are."""
    with _socket_server("--frontends", frontends) as running, \
            AttentionClient(running.target, timeout=60) as c:
        info = c.info()
        assert info["step_socket"] == running.path
        with c.decode_steps(step_socket=True) as steps:
            q, kn = _step_inputs(1, 2)
            deadline = time.monotonic() + 30
            while True:
                try:
                    steps.step(q, ["early-none"], kn, kn)
                except AttentionUnavailableError as exc:
                    assert "warming up" in str(exc)
                    assert time.monotonic() < deadline, "never served"
                    time.sleep(0.05)
                    continue
                except AttentionNotFoundError:  # answered by the engine, once serving
                    break
                raise AssertionError("a step on no cache was answered")
