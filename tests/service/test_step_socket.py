"""The step socket's reader answering its own pipelined steps (``Executor.holding``): a cpu
backend that launches as cuda's does (the launch only queued, waited for later, two slots), so
a model host's second step in flight launches on the reader thread while its first runs, and
the reader answers both. Checked against the float64 reference, with the executor's counts and
the caches' state after, and a host that goes away with held steps in flight."""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attention_client import AttentionClient
from attention_client._call_streams import _framed
from attention_wire.messages import SOCKET_FRAME, STEP_SOCKET_HELLO

from ..client.test_client_e2e import check_out, f64, make
from ..client.test_client_kv_cache import HKV, Context, D, H
from .batch_helpers import AsyncCpu

torch = pytest.importorskip("torch")
reference = pytest.importorskip("attention_kernels.reference")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def queued(start_server: Any) -> Any:
    path = str(Path(tempfile.mkdtemp(prefix="hold-")) / "step.sock")
    backend = AsyncCpu(device_s=0.003)
    server = start_server(backend=backend, step_socket=path)
    return server, backend


def _prompt(cache: Any, ctx: Context, ids: list[str], lengths: list[int], seed: int) -> None:
    k = make("numpy", "float32", sum(lengths), HKV, D, seed=seed)
    cache.append(ids, k, k, np.cumsum([0, *lengths]).astype(np.int32))
    ctx.add(ids, k, k, lengths)


def test_two_steps_in_flight_are_launched_and_answered_by_the_reader(queued: Any) -> None:
    """A host's two layers' steps, two in flight, stored: every answer right against the
    reference at the point it ran; the steps after the first launched on the socket's reader
    thread (the second while the first ran) and answered there, none by the completer; the
    executor idle and no cache busy at the end."""
    server, backend = queued
    layers = [[f"h-{layer}-{i}" for i in range(3)] for layer in range(2)]
    ctx = Context([cid for ids in layers for cid in ids])
    answered_on: list[str] = []
    with AttentionClient(server.target, timeout=60) as c, \
            c.kv_cache(HKV, D, "float32") as cache:
        for n, ids in enumerate(layers):
            _prompt(cache, ctx, ids, [5, 16, 31], 1 + n)
        engine = server.server.core
        done = engine.executor._deliver

        def deliver(jobs: Any, values: Any) -> None:
            answered_on.append(threading.current_thread().name)
            done(jobs, values)

        engine.executor._deliver = deliver
        backend.threads.clear()
        with c.decode_steps(step_socket=True) as steps:
            sent = []
            for n in range(12):
                ids = layers[n % 2]
                q = make("numpy", "float32", 3, H, D, seed=100 + n)
                kn = make("numpy", "float32", 3, HKV, D, seed=200 + n)
                if len(sent) == 2:  # two in flight: the oldest is read before the next goes
                    pending, q0, ref = sent.pop(0)
                    check_out(pending.result(), ref, "float32", q0)
                pending = steps.submit(q, ids, kn, kn)
                ctx.add(ids, kn, kn, [1, 1, 1])
                sent.append((pending, q, reference.decode_ref(f64(q), *ctx.packed(ids))))
            for pending, q0, ref in sent:
                check_out(pending.result(), ref, "float32", q0)
        assert [i["length"] for i in cache.info()] == ctx.lengths(
            [cid for ids in layers for cid in ids])
        assert not any(i["busy"] for i in cache.info())
        deadline = time.monotonic() + 5
        while not engine.executor.idle and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.executor.idle
    readers = [t for t in backend.threads if t.startswith("attention-step-socket-")]
    assert len(backend.threads) == 12 and len(readers) >= 10, backend.threads
    socket_answers = [t for t in answered_on if t.startswith("attention-step-socket-")]
    assert len(socket_answers) >= 10 and "attention-completer" not in answered_on, answered_on


def test_a_host_gone_with_a_held_step_running_stores_nothing_of_it(queued: Any) -> None:
    """A raw host sends a stored step on caches A, then one on caches B, and goes while B's
    launch runs (held by the reader: its client had a step unanswered). A's step ran before
    the reader saw the host go: stored. B's is cancelled like any step of a host that went:
    its tokens are not kept, no cache stays busy, and the next host's steps run right."""
    server, backend = queued
    a, b = ["gone-a0", "gone-a1"], ["gone-b0", "gone-b1"]
    ctx = Context(a + b)
    frames: list[bytes] = []
    with AttentionClient(server.target, timeout=60) as c, \
            c.kv_cache(HKV, D, "float32") as cache:
        _prompt(cache, ctx, a, [4, 9], 3)
        _prompt(cache, ctx, b, [6, 2], 4)
        q = make("numpy", "float32", 2, H, D, seed=5)
        kn = make("numpy", "float32", 2, HKV, D, seed=6)
        with c.decode_steps(step_socket=True) as steps:  # the frames a host sends
            steps.step(q, a, kn, kn)  # a first message: its form is kept
            stream = steps._stream
            send = stream.send

            def record(message: Any) -> None:
                frames.append(b"".join(bytes(p) for p in _framed(message)[0]))
                send(message)

            stream.send = record
            for ids in (a, b):
                steps.step(q, ids, kn, kn)
                ctx.add(ids, kn, kn, [1, 1])
        ctx.add(a, kn, kn, [1, 1])
        assert [i["length"] for i in cache.info()] == [6, 11, 7, 3]
        backend.device_s = 0.3  # B's launch still runs when the host goes
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(c.info()["step_socket"])
        hello = STEP_SOCKET_HELLO + b"\n"
        raw.sendall(SOCKET_FRAME.pack(len(hello)) + hello)
        raw.recv(64)
        raw.sendall(frames[0] + frames[1])  # A's step, then B's while A's is unanswered
        time.sleep(0.45)  # A answered (0.3 s), B launched and held
        raw.close()
        deadline = time.monotonic() + 5
        while any(i["busy"] for i in cache.info()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(i["busy"] for i in cache.info())
        assert [i["length"] for i in cache.info()] == [7, 12, 7, 3]  # A stored, B not
        backend.device_s = 0.0
        with c.decode_steps(step_socket=True) as steps:
            out = steps.step(q, b, kn, kn, store=False)
        ref = reference.decode_ref(f64(q), *ctx.packed(b, kn, kn, per_seq=1))
        check_out(out, ref, "float32", q)
        assert engine_idle(server)


def engine_idle(server: Any) -> bool:
    deadline = time.monotonic() + 5
    while not server.server.core.executor.idle and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.server.core.executor.idle
