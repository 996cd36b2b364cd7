"""``client.decode_steps()``: decode loops on one CacheDecodeSteps stream (cpu backend),
checked against the float64 reference; failures, fallbacks and timeouts."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from attention_client import (
    AsyncAttentionClient,
    AttentionClient,
    AttentionInputError,
    AttentionNotFoundError,
    AttentionTimeoutError,
)

from ._fakes import silent_server
from .test_client_e2e import check_lse, check_out, f64, make
from .test_client_kv_cache import HKV, Context, D, H, cu

torch = pytest.importorskip("torch")
reference = pytest.importorskip("attention_kernels.reference")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def client(server):
    with AttentionClient(server.target, timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def _no_leftover_caches(client):
    yield
    client.release_caches(all=True)


def _prompt(cache, ctx, ids, lengths, seed, kind="numpy", dtype="float32"):
    """Each cache of ``ids`` given ``lengths`` tokens (k = v), appended and recorded in
    ``ctx``."""
    k = make(kind, dtype, sum(lengths), HKV, D, seed=seed)
    cache.append(ids, k, k, cu(lengths))
    ctx.add(ids, k, k, lengths)
    return k


@pytest.mark.parametrize(("kind", "dtype"), [("numpy", "float16"), ("torch", "bfloat16")])
def test_a_decode_loop_on_one_stream(client, kind, dtype):
    ids = ["st-a", "st-b"]
    ctx = Context(ids)
    with client.kv_cache(HKV, D, dtype) as cache, client.decode_steps() as steps:
        _prompt(cache, ctx, ids, [5, 18], 1, kind, dtype)
        for step in range(5):
            q = make(kind, dtype, 2, H, D, seed=10 + step)
            kn = make(kind, dtype, 2, HKV, D, seed=20 + step)
            out, lse = steps.step(q, ids, kn, kn, return_lse=True, num_splits=step % 3)
            ctx.add(ids, kn, kn, [1, 1])
            ref, ref_lse = reference.decode_ref(f64(q), *ctx.packed(ids), return_lse=True)
            check_out(out, ref, dtype, q)  # numpy in -> numpy out, torch in -> torch out
            check_lse(lse, ref_lse)
            assert client.last_stats["cache_lengths"] == ctx.lengths(ids)
        # No new tokens, store=False: the layout comes from the handle; nothing is kept.
        q = make(kind, dtype, 2, H, D, seed=40)
        out = steps.step(q, ids, store=False, softmax_scale=0.3)
        check_out(out, reference.decode_ref(f64(q), *ctx.packed(ids), softmax_scale=0.3),
                  dtype, q)
        assert [c["length"] for c in cache.info()] == ctx.lengths(ids)


def test_a_failed_step_raises_and_the_next_one_reopens(client):
    ids = ["re-a"]
    ctx = Context(ids)
    with client.kv_cache(HKV, D, "float32") as cache, client.decode_steps() as steps:
        _prompt(cache, ctx, ids, [4], 3)
        kn = make("numpy", "float32", 1, HKV, D, seed=4)
        q = make("numpy", "float32", 1, H, D, seed=5)
        with pytest.raises(AttentionNotFoundError) as exc:
            steps.step(q, "nope", kn, kn)
        assert "nope" in str(exc.value)
        with pytest.raises(AttentionInputError):  # checked before anything is sent
            steps.step(q, ["re-a", "re-a"], kn, kn)
        out = steps.step(q, ids, kn, kn)
        ctx.add(ids, kn, kn, [1])
        check_out(out, reference.decode_ref(f64(q), *ctx.packed(ids)), "float32", q)
        assert [c["length"] for c in cache.info()] == [5]
    with pytest.raises(Exception, match="closed"):
        steps.step(q, ids, kn, kn)


def test_steps_like_an_earlier_one_reuse_its_request_and_others_do_not(client):
    """A step with an earlier one's ids and options and k/v of its shapes reuses that step's
    checked request with the new tensors (one template per id set: a model host steps its
    layers in turn); any change (ids, their order, store, dtype, shape) takes the whole path.
    Every answer is checked, and so is what each step kept."""
    ids = ["tp-a", "tp-b", "tp-c"]
    ctx = Context(ids)
    with client.kv_cache(HKV, D, "float32") as cache, client.decode_steps() as steps:
        _prompt(cache, ctx, ids, [2, 3, 4], 50)
        plan = [(ids, True), (ids, True), (ids[::-1], True), (ids[::-1], False),
                (ids[:2], False), (list(ids), True), (tuple(ids), True)]
        reused = []
        for n, (names, store) in enumerate(plan):
            names = list(names)
            q = make("numpy", "float32", len(names), H, D, seed=60 + n)
            kn = make("numpy", "float32", len(names), HKV, D, seed=80 + n)
            before = dict(steps._templates)
            out = steps.step(q, names, kn, kn, store=store)
            reused.append(len(steps._templates) == len(before) > 0 and all(
                steps._templates[key] is t for key, t in before.items()))
            check_out(out, reference.decode_ref(f64(q), *ctx.packed(names, kn, kn, 1)),
                      "float32", q)
            if store:
                ctx.add(names, kn, kn, [1] * len(names))
            assert client.last_stats["cache_lengths"] == ctx.lengths(names)
        # A template is the first request of its kind; it stays while others come and go.
        assert reused == [False, True, False, False, False, True, True]
        kn16 = make("numpy", "float16", 3, HKV, D, seed=99)
        with pytest.raises(AttentionInputError, match="dtype"):  # checked the long way again
            steps.step(make("numpy", "float32", 3, H, D), ids, kn16, kn16)
        cache.release(["tp-b"])
        q = make("numpy", "float32", 3, H, D, seed=98)
        kn = make("numpy", "float32", 3, HKV, D, seed=97)
        with pytest.raises(AttentionNotFoundError, match="tp-b"):  # like the last: reused
            steps.step(q, ids, kn, kn)
        out = steps.step(q[:1], ids[:1], kn[:1], kn[:1])
        check_out(out, reference.decode_ref(f64(q[:1]), *ctx.packed(ids[:1], kn[:1], kn[:1], 1)),
                  "float32", q[:1])


def test_a_step_over_one_message_and_a_server_without_the_rpc_take_the_other_path(server):
    """Both go through decode_step's path, with the same answers."""
    ids = ["fb-a"]
    ctx = Context(["fb-a", "fb-b"])
    with AttentionClient(server.target, max_chunk_bytes=4096) as c:
        cache = c.kv_cache(HKV, D, "float32")
        k = make("numpy", "float32", 6, HKV, D, seed=6)
        cache.append(["fb-a", "fb-b"], k, k, [0, 2, 6])
        ctx.add(["fb-a", "fb-b"], k, k, [2, 4])
        kn = make("numpy", "float32", 1, HKV, D, seed=9)
        with c.decode_steps() as steps:
            q = make("numpy", "float32", 2, H, D, seed=8)
            k2 = np.concatenate([kn, kn])  # 4 KiB q + 2 KiB k/v: over one 4 KiB message
            out = steps.step(q, ["fb-a", "fb-b"], k2, k2)
            ctx.add(["fb-a", "fb-b"], k2, k2, [1, 1])
            check_out(out, reference.decode_ref(f64(q), *ctx.packed(["fb-a", "fb-b"])),
                      "float32", q)
            assert steps._stream is None  # never opened
        with AttentionClient(server.target) as old:
            for lane in old._lanes:  # as on a server without CacheDecodeSteps: UNIMPLEMENTED
                lane["CacheDecodeSteps"] = old._base_channels[0].stream_stream(
                    "/attention.v1.AttentionService/NoSuchSteps")
            with old.decode_steps() as steps:
                for seed in (10, 11):
                    q = make("numpy", "float32", 1, H, D, seed=seed)
                    out = steps.step(q, ids, kn, kn)
                    ctx.add(ids, kn, kn, [1])
                    check_out(out, reference.decode_ref(f64(q), *ctx.packed(ids)), "float32",
                              q)
                assert steps._unsupported
        assert [c["length"] for c in cache.info()] == [5, 5]
        cache.release()


def test_a_step_timeout_cancels_the_stream():
    server, port, cancelled, step_timeouts = silent_server("CacheDecodeSteps")
    try:
        with AttentionClient(f"127.0.0.1:{port}") as c, c.decode_steps(timeout=0.5) as steps:
            q = make("numpy", "float32", 1, H, D)
            kn = make("numpy", "float32", 1, HKV, D)
            t0 = time.monotonic()
            with pytest.raises(AttentionTimeoutError):
                steps.step(q, "x", kn, kn)
            assert time.monotonic() - t0 < 5.0
            assert cancelled.wait(5.0)  # the server saw the stream go
            assert len(step_timeouts) == 1 and 0 < step_timeouts[0] <= 500  # what was left

        async def main():
            async with (AsyncAttentionClient(f"127.0.0.1:{port}") as c,
                        c.decode_steps(timeout=0.5) as steps):
                with pytest.raises(AttentionTimeoutError):
                    await steps.step(q, "x", kn, kn)

        cancelled.clear()
        asyncio.run(main())
        assert cancelled.wait(5.0)
        assert len(step_timeouts) == 2 and 0 < step_timeouts[1] <= 500
    finally:
        server.stop(None)


def test_an_async_decode_loop(server):
    ids = ["as-a", "as-b"]
    got = []

    async def main():
        async with (AsyncAttentionClient(server.target) as c,
                    c.kv_cache(HKV, D, "float32") as cache, c.decode_steps() as steps):
            k = make("numpy", "float32", 9, HKV, D, seed=90)
            await cache.append(ids, k, k, [0, 9, 9])
            for step in range(3):
                q = make("numpy", "float32", 2, H, D, seed=91 + step)
                kn = make("numpy", "float32", 2, HKV, D, seed=94 + step)
                got.append((q, kn, await steps.step(q, ids, kn, kn)))
            with pytest.raises(AttentionNotFoundError):
                await steps.step(q, ["as-a", "gone"], kn, kn)
            # concurrent steps on one handle run one after another
            outs = await asyncio.gather(steps.step(q[:1], "as-a", store=False),
                                        steps.step(q[1:], "as-b", store=False))
            return k, q, outs, [c["length"] for c in await cache.info()]

    k, q, outs, lengths = asyncio.run(main())
    ctx = Context(ids)
    ctx.add(ids, k, k, [9, 0])
    for q_step, kn, out in got:
        ctx.add(ids, kn, kn, [1, 1])
        check_out(out, reference.decode_ref(f64(q_step), *ctx.packed(ids)), "float32", q_step)
    check_out(np.concatenate(outs), reference.decode_ref(f64(q), *ctx.packed(ids)), "float32", q)
    assert lengths == [12, 3]


def _step_inputs(n, seed, dtype="float32"):
    return (make("numpy", dtype, n, H, D, seed=seed),
            make("numpy", dtype, n, HKV, D, seed=seed + 1))


def test_steps_sent_ahead_are_answered_in_order_and_fail_alone(client):
    """``submit``: two micro-batches' steps (disjoint caches) sent ahead of their answers and
    read in another order than sent, steps on one cache sent back to back, a step on a cache
    that is gone: every answer right against the float64 reference at the point its step
    ran, the failed step raising from its own ``result()`` and changing nothing, the lengths
    as stored. A step's result is read once it is answered, whoever asks first."""
    a, b = ["sa-a0", "sa-a1"], ["sa-b0"]
    ctx = Context(a + b)
    with client.kv_cache(HKV, D, "float32") as cache, client.decode_steps() as steps:
        _prompt(cache, ctx, a + b, [2, 3, 1], 1)
        sent = []  # (pending, ids, q, expected out)
        for seed in range(10, 70, 20):
            for ids in (a, b):
                q, kn = _step_inputs(len(ids), seed + len(ids))
                pending = steps.submit(q, ids, kn, kn)
                ctx.add(ids, kn, kn, [1] * len(ids))
                sent.append((pending, q, reference.decode_ref(f64(q), *ctx.packed(ids))))
        q, kn = _step_inputs(1, 90)
        gone = steps.submit(q, ["sa-gone"], kn, kn)
        for seed in (100, 110):  # one cache's steps back to back
            q, kn = _step_inputs(2, seed)
            pending = steps.submit(q, a, kn, kn)
            ctx.add(a, kn, kn, [1, 1])
            sent.append((pending, q, reference.decode_ref(f64(q), *ctx.packed(a))))
        last = sent[-1][0]
        check_out(last.result(), sent[-1][2], "float32", sent[-1][1])  # reads all before it
        assert all(p.done() for p, _, _ in sent) and gone.done()
        for pending, q, ref in reversed(sent):
            check_out(pending.result(), ref, "float32", q)
        check_out(sent[0][0].result(), sent[0][2], "float32", sent[0][1])  # read once, kept
        for _ in range(2):
            with pytest.raises(AttentionNotFoundError, match="sa-gone"):
                gone.result()
        assert [c["length"] for c in cache.info()] == ctx.lengths(a + b)
        q, kn = _step_inputs(1, 120)  # the stream goes on after the failed step
        out = steps.step(q, b, kn, kn, store=False)
        check_out(out, reference.decode_ref(f64(q), *ctx.packed(b, kn, kn, 1)), "float32", q)


def test_steps_sent_ahead_to_a_server_that_ends_the_stream_at_a_failure(client, monkeypatch):
    """Without in-band errors (as a server before them answers), the first failing step ends
    the stream: it raises its own error, the steps sent after it raise saying they were not
    answered (and there did not run), the steps before it are answered, and the next step
    opens a new stream."""
    from attention_client import AttentionError, _steps

    monkeypatch.setattr(_steps, "_in_band", lambda settings: settings)
    ids = ["lg-a"]
    ctx = Context(ids)
    with client.kv_cache(HKV, D, "float32") as cache, client.decode_steps() as steps:
        _prompt(cache, ctx, ids, [3], 2)
        q, kn = _step_inputs(1, 30)
        first = steps.submit(q, ids, kn, kn)
        ref = reference.decode_ref(f64(q), *ctx.packed(ids, kn, kn, 1))
        ctx.add(ids, kn, kn, [1])
        failing = steps.submit(q, ["lg-gone"], kn, kn)
        after = steps.submit(q, ids, kn, kn)
        check_out(first.result(), ref, "float32", q)
        with pytest.raises(AttentionError, match="not run") as err:
            after.result()
        assert err.value.code == grpc.StatusCode.ABORTED
        with pytest.raises(AttentionNotFoundError, match="lg-gone"):
            failing.result()
        assert [c["length"] for c in cache.info()] == ctx.lengths(ids)
        out = steps.step(q, ids, kn, kn, store=False)
        check_out(out, reference.decode_ref(f64(q), *ctx.packed(ids, kn, kn, 1)), "float32", q)


def test_async_micro_batches_on_one_handle(server):
    """Two coroutines stepping their own caches on one async handle, each keeping its next
    step sent while it reads the last (ping-pong): answers right, lengths as stored."""
    groups = {"pp-a": ["pp-a0", "pp-a1"], "pp-b": ["pp-b0"]}
    every = [i for ids in groups.values() for i in ids]
    ctx = Context(every)
    k = make("numpy", "float32", 4, HKV, D, seed=3)
    ctx.add(every, k, k, [1, 2, 1])
    checks = []

    async def loop(steps, ids, seed):
        pending = None
        for n in range(4):
            q, kn = _step_inputs(len(ids), seed + 10 * n)
            nxt = await steps.submit(q, ids, kn, kn)
            ctx.add(ids, kn, kn, [1] * len(ids))
            want = (q, reference.decode_ref(f64(q), *ctx.packed(ids)))
            if pending is not None:
                checks.append((await pending[0].result(), *pending[1]))
            pending = (nxt, want)
        checks.append((await pending[0].result(), *pending[1]))

    async def main():
        async with (AsyncAttentionClient(server.target) as c,
                    c.kv_cache(HKV, D, "float32") as cache, c.decode_steps() as steps):
            await cache.append(every, k, k, cu([1, 2, 1]))
            await asyncio.gather(loop(steps, groups["pp-a"], 200), loop(steps, groups["pp-b"], 300))
            return [c["length"] for c in await cache.info()]

    assert asyncio.run(main()) == ctx.lengths(every)
    assert len(checks) == 8
    for out, q, ref in checks:
        check_out(out, ref, "float32", q)


_HOST = """
import sys, numpy as np
from attention_client import AttentionClient
target, n = sys.argv[1], int(sys.argv[2])
groups = [[f"dead-{i}" for i in range(n // 2)], [f"dead-{i}" for i in range(n // 2, n)]]
rng = np.random.default_rng(0)

def send(steps, ids):
    q = rng.standard_normal((len(ids), 4, 16)).astype(np.float32)
    kn = rng.standard_normal((len(ids), 2, 16)).astype(np.float32)
    return steps.submit(q, ids, kn, kn)

with AttentionClient(target) as c, c.decode_steps() as steps:
    pending = [send(steps, ids) for ids in groups]  # two micro-batches in flight
    print("looping", flush=True)
    while True:  # until killed
        for g, ids in enumerate(groups):
            pending[g].result()
            pending[g] = send(steps, ids)
"""


@pytest.mark.parametrize("frontends", ["1", "2"])
def test_a_host_killed_mid_loop_leaves_its_caches_usable(frontends, tmp_path):
    """A model host killed (SIGKILL) while its decode loop runs, two micro-batches' steps in
    flight on its stream: the server keeps serving, the caches are soon idle again (a cut
    step holds them only until its launch ends), and every cache of a micro-batch kept the
    same number of the loop's tokens (a step is stored whole or not at all); the next step
    on them answers right."""
    import subprocess
    import sys

    from ._server import require_server, start_server

    require_server()
    running = start_server("--frontends", frontends)
    ids = [f"dead-{i}" for i in range(6)]
    try:
        with AttentionClient(running.target, timeout=60) as c:
            cache = c.kv_cache(2, 16, "float32")
            prompt = make("numpy", "float32", 6 * 512, 2, 16, seed=1)
            cache.append(ids, prompt, prompt, [512 * i for i in range(7)])  # steps take a while
            host = subprocess.Popen([sys.executable, "-c", _HOST, running.target, "6"],
                                    stdout=subprocess.PIPE, text=True)
            try:
                assert host.stdout is not None and host.stdout.readline().strip() == "looping"
                deadline = time.monotonic() + 30
                while min(i["length"] for i in c.list_caches(ids)) < 520:  # some steps landed
                    assert time.monotonic() < deadline and host.poll() is None
                    time.sleep(0.05)
            finally:
                host.kill()
                host.wait(10)
            deadline = time.monotonic() + 20
            while any(i["busy"] for i in c.list_caches(ids)):
                assert time.monotonic() < deadline, "the caches stayed busy"
                time.sleep(0.05)
            for group in (ids[:3], ids[3:]):  # each step stored on all its caches, or none
                assert len({i["length"] for i in c.list_caches(group)}) == 1
            q = make("numpy", "float32", 6, 4, 16, seed=2)
            kn = make("numpy", "float32", 6, 2, 16, seed=3)
            out = c.decode_step(q, ids, kn, kn, store=False)
            assert out.shape == (6, 4, 16) and np.isfinite(out).all()
            assert c.info()["device"]  # still serving
            c.release_caches(ids)
    finally:
        running.stop()


def test_templates_are_bounded(client, monkeypatch):
    """At most MAX_TEMPLATES requests are kept; the oldest goes first."""
    from attention_client import _steps

    monkeypatch.setattr(_steps, "MAX_TEMPLATES", 2)
    sets = [[f"tb-{i}"] for i in range(3)]
    with client.kv_cache(HKV, D, "float32") as cache, client.decode_steps() as steps:
        k = make("numpy", "float32", 3, HKV, D, seed=5)
        cache.append([s[0] for s in sets], k, k, cu([1, 1, 1]))
        for names in sets:
            q = make("numpy", "float32", 1, H, D, seed=6)
            kn = make("numpy", "float32", 1, HKV, D, seed=7)
            steps.step(q, names, kn, kn, store=False)
        assert [key[0] for key in steps._templates] == [("tb-1",), ("tb-2",)]


def _spy_send(monkeypatch):
    """Every step message a sync handle sends, and every answer it reads back."""
    from attention_client import _steps
    from attention_client._call_streams import StreamCall

    sent, answers = [], []
    send, receive = StreamCall.send, _steps.DecodeSteps._receive

    def spy_send(self, message):
        sent.append(message)
        return send(self, message)

    def spy_receive(self, stream, settings):
        answers.append(receive(self, stream, settings))
        return answers[-1]

    monkeypatch.setattr(StreamCall, "send", spy_send)
    monkeypatch.setattr(_steps.DecodeSteps, "_receive", spy_receive)
    return sent, answers


def _answer_with(monkeypatch, answer):
    """A sync handle's steps answered with ``answer`` (nothing sent)."""
    from attention_client import _steps
    from attention_client._call_streams import StreamCall

    monkeypatch.setattr(StreamCall, "send", lambda self, message: None)
    monkeypatch.setattr(_steps.DecodeSteps, "_receive", lambda self, stream, settings: answer)


@pytest.mark.parametrize(("kind", "dtype"), [("numpy", "float16"), ("numpy", "float32"),
                                             ("numpy", "bfloat16"), ("torch", "bfloat16"),
                                             ("torch", "float16")])
def test_compiled_steps_send_the_long_ways_bytes_and_read_its_answers(server, monkeypatch,
                                                                      kind, dtype):
    """After its first step, a step like it is joined into the template's frame and its
    answer read at the known offset: byte for byte the message the general path builds, and
    answers right against the float64 reference (store on, so every step sees new keys)."""
    sent, _ = _spy_send(monkeypatch)
    ids = ["cp-a", "cp-b", "cp-c"]
    ctx = Context(ids)
    with AttentionClient(server.target, timeout=None) as c, \
            c.kv_cache(HKV, D, dtype) as cache, c.decode_steps() as steps:
        _prompt(cache, ctx, ids, [3, 4, 5], 1, kind, dtype)
        for n in range(4):
            q = make(kind, dtype, 3, H, D, seed=30 + n)
            kn = make(kind, dtype, 3, HKV, D, seed=40 + n)
            out = steps.step(q, ids, kn, kn)
            ctx.add(ids, kn, kn, [1, 1, 1])
            check_out(out, reference.decode_ref(f64(q), *ctx.packed(ids)), dtype, q)
            assert c.last_stats["cache_lengths"] == ctx.lengths(ids)
            (template,) = steps._templates.values()
            assert template.compiled is not None
            long_way = c._one_message(steps._reused(template.prep, q, kn, kn))
            assert sent[-1] == long_way
            if n:  # the compiled path answered (out is a fresh array, not the answer's view)
                assert template.compiled.views(q, kn, kn) is not None
        assert [i["length"] for i in cache.info()] == [7, 8, 9]


def test_steps_unlike_the_compiled_template_take_the_general_path(client):
    """Tensors that differ from the template's in any way the frame depends on (layout,
    grad, type, dtype) are sent the general way, with right answers; return_lse and
    ``out=`` steps are never compiled."""
    ids = ["cu-a", "cu-b"]
    ctx = Context(ids)
    with client.kv_cache(HKV, D, "float32") as cache, client.decode_steps() as steps:
        _prompt(cache, ctx, ids, [2, 4], 2, "torch", "float32")
        kn = make("torch", "float32", 2, HKV, D, seed=3)
        steps.step(make("torch", "float32", 2, H, D, seed=4), ids, kn, kn, store=False)
        (template,) = steps._templates.values()
        compiled = template.compiled
        q = make("torch", "float32", 2, H, D, seed=5)
        others = {
            "non-contiguous": make("torch", "float32", H, 2, D, seed=5).transpose(0, 1),
            "requires grad": q.clone().requires_grad_(True),
            "numpy": q.numpy(),
            "float64": q.double(),
            "big-endian": q.numpy().astype(">f4"),  # sent little-endian (a copy)
        }
        for what, x in others.items():
            assert compiled.views(x, kn, kn) is None, what
            if what in ("requires grad", "float64"):
                continue  # refused by the general path's checks (other tests)
            out = steps.step(x, ids, kn, kn, store=False)
            like = x.astype("<f4") if what == "big-endian" else x  # answers: little-endian
            check_out(out, reference.decode_ref(f64(x), *ctx.packed(ids, kn, kn, 1)),
                      "float32", like)
        out, lse = steps.step(q, ids, kn, kn, store=False, return_lse=True)
        ref, ref_lse = reference.decode_ref(f64(q), *ctx.packed(ids, kn, kn, 1),
                                            return_lse=True)
        check_out(out, ref, "float32", q)
        check_lse(lse, ref_lse)
        assert all(t.compiled is None for key, t in steps._templates.items() if key[4])
        # A template of big-endian arrays is not compiled; its steps are sent right.
        big = ["cu-b"]
        kb = kn[:1].numpy().astype(">f4")
        for seed in (6, 7):
            qb = make("numpy", "float32", 1, H, D, seed=seed).astype(">f4")
            out = steps.step(qb, big, kb, kb, store=False)
            check_out(out, reference.decode_ref(f64(qb), *ctx.packed(big, kb, kb, 1)),
                      "float32", qb.astype("<f4"))
        assert steps._templates[(tuple(big), False, None, 0, False, (-1, -1), 0.0, None)
                                ].compiled is None


def test_an_answer_unlike_the_template_is_read_the_general_way(client, monkeypatch):
    """The compiled reader takes one OUT chunk of every row and the stats alone; an answer
    in two chunks is read the general way (right), one without its stats is DATA_LOSS."""
    from attention_client._errors import ProtocolError
    from attention_wire.messages import chunk_head, output_chunk_parts, parse_result
    from attention_wire.pb import attention_pb2 as pb

    ids = ["ca-a", "ca-b"]
    ctx = Context(ids)
    _, answers = _spy_send(monkeypatch)
    with client.kv_cache(HKV, D, "float32") as cache, client.decode_steps() as steps:
        _prompt(cache, ctx, ids, [2, 3], 6)
        q = make("numpy", "float32", 2, H, D, seed=7)
        kn = make("numpy", "float32", 2, HKV, D, seed=8)
        ref = reference.decode_ref(f64(q), *ctx.packed(ids, kn, kn, 1))
        steps.step(q, ids, kn, kn, store=False)
        out_slice, stats = parse_result(answers[-1])
        data = np.frombuffer(bytes(out_slice.data), np.uint8)
        half = data.size // 2
        shape = out_slice.shape

        def chunk(start, count, part):
            head = chunk_head(pb.OUT, out_slice.dtype, shape, start, count)
            return b"".join(output_chunk_parts(head, memoryview(part)))

        stats_bytes = pb.AttentionResponse(stats=stats).SerializeToString()
        split = chunk(0, 1, data[:half]) + chunk(1, 1, data[half:]) + stats_bytes
        _answer_with(monkeypatch, split)
        check_out(steps.step(q, ids, kn, kn, store=False), ref, "float32", q)
        whole = chunk(0, 2, data)
        _answer_with(monkeypatch, whole)
        with pytest.raises(ProtocolError, match="without RequestStats"):
            steps.step(q, ids, kn, kn, store=False)


def test_region_steps_on_the_same_tensors_send_one_kept_message(client, monkeypatch):
    """A step whose q, k/v and ``out=`` lie in a registered region (nothing staged) keeps its
    message: later steps on the same tensors, new values written into them, send it again
    without building a request. Every answer matches the float64 reference and every step's
    tokens are kept; a tensor outside the region, or the region closed, takes the whole path."""
    from attention_client import _steps

    built, sent = [], []
    real_request = type(client)._decode_step_request
    monkeypatch.setattr(type(client), "_decode_step_request",
                        lambda self, *a: built.append(1) or real_request(self, *a))
    real_send = _steps._StepsBase._send
    monkeypatch.setattr(_steps._StepsBase, "_send",
                        lambda self, prep, compiled, message, *a: sent.append(message)
                        or real_send(self, prep, compiled, message, *a))
    ids = ["rg-a", "rg-b"]
    ctx = Context(ids)
    region = client.register_shm(1 << 20)
    with client.kv_cache(HKV, D, "float32") as cache, client.decode_steps() as steps:
        _prompt(cache, ctx, ids, [3, 5], 40)
        q, kn = region.empty((2, H, D), np.float32), region.empty((2, HKV, D), np.float32)
        out = region.empty((2, H, D), np.float32)
        for n in range(3):
            q[...], kn[...] = make("numpy", "float32", 2, H, D, seed=41 + n), make(
                "numpy", "float32", 2, HKV, D, seed=51 + n)
            assert steps.step(q, ids, kn, kn, out=out) is out
            check_out(out, reference.decode_ref(f64(q), *ctx.packed(ids, kn, kn, 1)),
                      "float32", q)
            ctx.add(ids, kn.copy(), kn.copy(), [1, 1])
            assert client.last_stats["bytes_in"] == 0
            assert client.last_stats["cache_lengths"] == ctx.lengths(ids)
        assert len(built) == 1 and len(sent) == 3
        kept = next(t for t in steps._templates.values() if t.message is not None)
        assert all(m.startswith(kept.message) for m in sent)  # + each step's timeout field
        outside = make("numpy", "float32", 2, H, D, seed=60)  # staged: the whole path
        steps.step(outside, ids, kn, kn, out=out)
        ctx.add(ids, kn.copy(), kn.copy(), [1, 1])
        assert len(built) == 2
        region.close()  # its tensors now go as bytes: the whole path again
        got = steps.step(np.array(q), ids, np.array(kn), np.array(kn))
        check_out(got, reference.decode_ref(f64(q), *ctx.packed(ids, kn, kn, 1)), "float32", q)
        assert len(built) == 3 and client.last_stats["bytes_in"] > 0
