"""Where one client's decode step spends its time: a timestamp at every hand-off, every process.

Starts a server (``python -m attention_service``, batching on) with the hooks of
``benchmarks/step_trace_hooks`` loaded in each of its processes, creates ``--batch`` KV caches
(per ``--layers`` layer), appends a ``--context``-token prompt to each and runs ``--steps``
CacheDecode steps over all of a layer's (one new token per cache a step; the layers in turn)
one after another from one client (a unary call each,
or ``--stream``: one CacheDecodeSteps stream, as ``decode_steps()`` sends them, or ``--socket``:
through the server's step socket, ``--step-socket``, from a raw blocking client). The client
times each step; the server's processes record entry (``>``) and exit (``<``) of the functions
a step passes through (front end, step socket, channel, engine, executor, launch) on one
clock. For every step, the events inside its client interval are put in time order; the most
common order is the step's path, and the table gives the median time between consecutive
events over the steps that took that path, plus the client's own share (call start to the
first server event, last event to the reply).

    python benchmarks/trace_step.py --out OUT                                # GPU defaults
    python benchmarks/trace_step.py --device cpu --heads 4 --kv-heads 2 --head-dim 32 \
        --context 64 --steps 300                                              # quick cpu run

Wrapped calls cost ~1 us each (some 30 per step), so the total is a little above an untraced
step's; the breakdown is what this is for, not the total.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from attention_wire import grpc_defaults

grpc_defaults.apply()  # the client library's grpc I/O settings, before grpc loads

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_service import Server, server_info
from bench_sessions import (
    METHOD,
    Shapes,
    _bytes,
    _call,
    _requests,
    _StepStream,
    _tensor_messages,
    add_shape_args,
)

from attention_wire.messages import SOCKET_FRAME, STEP_SOCKET_HELLO
from attention_wire.pb import attention_pb2 as pb

HOOKS = Path(__file__).resolve().parent / "step_trace_hooks"


def _batch_step(s: Shapes, ids: list[str], store: bool) -> list[bytes]:
    """One decode step over the caches ``ids`` (one new token each), as the client sends it."""
    rng = np.random.default_rng(1)
    b = len(ids)
    header = pb.DecodeHeader(q=s.spec(b, s.h, s.d), k=s.spec(b, s.hkv, s.d, kv=True),
                             v=s.spec(b, s.hkv, s.d, kv=True),
                             cache=pb.CacheTarget(cache_ids=ids, store=store))
    kv = b * s.hkv * s.d
    return _tensor_messages(header, _bytes(rng, b * s.h * s.d, s.dtype),
                            _bytes(rng, kv, s.kv_dtype), _bytes(rng, kv, s.kv_dtype))


def _exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("the server closed the step socket")
        got += k
    return buf


def _answer(sock: socket.socket) -> pb.AttentionResult:
    """The step socket's next frame: a step's AttentionResult messages, which parse as one
    (chunks appended, the last one's stats), or the hello's (empty when accepted)."""
    (size,) = SOCKET_FRAME.unpack(_exactly(sock, SOCKET_FRAME.size))
    result = pb.AttentionResult.FromString(_exactly(sock, size))
    if result.HasField("error"):
        raise RuntimeError(f"step socket: code {result.error.code}: {result.error.details}")
    return result


def _socket_steps(path: str, messages: list[bytes], n: int) -> list[tuple[int, int, float]]:
    """``n`` steps through the step socket at ``path``, one at a time, step i sending
    ``messages[i % len(messages)]``."""
    hello = STEP_SOCKET_HELLO + b"\n"  # any server instance, no token
    # Built once: the loop times the trip.
    frames = [SOCKET_FRAME.pack(len(m)) + m for m in messages]
    out = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        sock.sendall(SOCKET_FRAME.pack(len(hello)) + hello)
        _answer(sock)
        for i in range(n):
            t0 = time.perf_counter_ns()
            sock.sendall(frames[i % len(frames)])
            kernel = _answer(sock).stats.kernel_seconds
            out.append((t0, time.perf_counter_ns(), kernel))
    return out


async def _drive(target: str, s: Shapes, steps: int, warm: int, stream: bool, batch: int,
                 store: bool, socket_path: str | None = None,
                 layers: int = 1) -> list[tuple[int, int, float]]:
    """(t0 ns, t1 ns, kernel seconds) of each measured step; ``stream``: the steps go on one
    CacheDecodeSteps stream (``client.decode_steps()``), ``socket_path``: through that step
    socket, else a unary call each; ``batch`` caches per step, step i on layer ``i % layers``
    (each layer its own caches, as a model host's layers alternate)."""
    per_layer = [[f"trace-l{j}-{i}" for i in range(batch)] for j in range(layers)]
    async with grpc.aio.insecure_channel(target) as ch:
        create = ch.unary_unary(METHOD + "CreateCaches",
                                request_serializer=pb.CreateCachesRequest.SerializeToString,
                                response_deserializer=pb.CreateCachesResponse.FromString)
        layer_steps = []
        for ids in per_layer:
            await create(pb.CreateCachesRequest(cache_ids=ids, layout=s.layout()), timeout=60)
            for cache_id in ids:
                setup, step = _requests(s, "sessions", cache_id, 0)
                await _call(ch, "AppendKV", setup)
            layer_steps.append(_batch_step(s, ids, store) if batch > 1 or not store else step)
        if socket_path is not None:  # a blocking client: off the event loop
            return (await asyncio.to_thread(_socket_steps, socket_path,
                                            [step[0] for step in layer_steps],
                                            warm + steps))[warm:]
        out = []
        steps_stream = _StepStream(ch) if stream else None
        try:
            for i in range(warm + steps):
                step = layer_steps[i % layers]
                t0 = time.perf_counter_ns()
                if steps_stream is not None:
                    stats = await steps_stream.step(step[0])
                else:
                    stats = await _call(ch, "CacheDecode", step, unary=True)
                t1 = time.perf_counter_ns()
                if i >= warm:
                    out.append((t0, t1, stats.kernel_seconds))
        finally:
            if steps_stream is not None:
                steps_stream.close()
        return out


def _load(trace_dir: Path) -> list[tuple[int, str]]:
    """Every server event as (ns, label@role); role: fe (a front end), engine, or server
    (the single-process model), told apart by the functions each process ran."""
    merged: list[tuple[int, str]] = []
    for f in trace_dir.glob("trace_*.json"):
        data = json.loads(f.read_text())
        labels = {label for label, *_ in data["events"]}
        if any(x.startswith("RemoteLink.") for x in labels):
            role = "fe"
        elif any(x.startswith(("FrontendConnection.", "_SocketConnection.")) for x in labels):
            role = "engine"
        else:
            role = "server"
        merged += [(t, f"{label}@{role}") for label, t, *_ in data["events"]]
    merged.sort()
    return merged


def breakdown(steps: list[tuple[int, int, float]], events: list[tuple[int, str]]
              ) -> dict[str, Any]:
    import bisect

    times = [t for t, _ in events]
    paths: list[tuple[tuple[str, ...], list[int], int, int]] = []
    for t0, t1, _ in steps:
        lo, hi = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
        inside = events[lo:hi]
        paths.append((tuple(lab for _, lab in inside), [t for t, _ in inside], t0, t1))
    common, n = collections.Counter(p for p, *_ in paths).most_common(1)[0]
    rows: list[tuple[str, float]] = []
    chosen = [(ts, t0, t1) for p, ts, t0, t1 in paths if p == common]
    hops = ["client call"] + [f"{a} -> {b}" for a, b in zip(common, common[1:], strict=False)]
    hops.append("reply")
    for i, hop in enumerate(hops):
        deltas = []
        for ts, t0, t1 in chosen:
            points = [t0, *ts, t1]
            deltas.append(points[i + 1] - points[i])
        rows.append((hop, statistics.median(deltas) / 1e3))
    total = statistics.median([(t1 - t0) / 1e3 for _, t0, t1 in chosen])
    return {"path_share": n / len(paths), "rows": rows, "median_total_us": total}


def traced_run(args: argparse.Namespace, out_dir: Path, name: str,
               drive: Callable[[str], Any]) -> tuple[Any, Any, list[tuple[int, str]]]:
    """Start the server (``args``' settings) with the hooks in each of its processes, run
    ``drive(target)``, stop it: (what ``drive`` returned, the server's info, its events as
    ``_load`` gives them; empty when the hooks did not load). Its log: ``<name>_server.log``."""
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        trace_dir = Path(tmp)
        env_before = dict(os.environ)
        os.environ["ATTENTION_STEP_TRACE"] = str(trace_dir)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(HOOKS)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
        try:
            server = Server(args, True, out_dir / f"{name}_server.log")
        finally:
            os.environ.clear()
            os.environ.update(env_before)
        try:
            info = server_info(server.target)
            got = drive(server.target)
            time.sleep(1.2)  # the hooks write every 0.5 s
        finally:
            server.stop()
        return got, info, _load(trace_dir)


def write_report(out_dir: Path, script: str, stem: str, info: Any, argv: list[str] | None,
                 summary: str, result: dict[str, Any], extra: dict[str, Any]) -> None:
    """Print and write (``<stem>_<time>.md`` / ``.json``) the hop table of ``breakdown``'s
    ``result`` under a title naming the device, the command (``benchmarks/<script>.py``) and
    ``summary``."""
    lines = [
        f"# {script}: {info.device} ({info.backend}, {info.frontends} front end(s)), "
        f"{datetime.now(timezone.utc):%Y-%m-%d}", "",
        f"`python benchmarks/{script}.py "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}`", "", summary, "",
        "| hop | median us |", "|---|---|",
    ]
    lines += [f"| {hop} | {us:.1f} |" for hop, us in result["rows"]]
    table = "\n".join(lines) + "\n"
    print(table)
    stamp = f"{datetime.now(timezone.utc):%Y%m%d_%H%M%S}"
    (out_dir / f"{stem}_{stamp}.md").write_text(table)
    (out_dir / f"{stem}_{stamp}.json").write_text(json.dumps(
        {"device": info.device, "frontends": info.frontends, **extra, **result}, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warm-steps", type=int, default=200)
    p.add_argument("--frontends", type=int, help="passed to the server (default: its own)")
    p.add_argument("--stream", action="store_true",
                   help="steps on one CacheDecodeSteps stream (default: a unary call each)")
    p.add_argument("--socket", action="store_true",
                   help="steps through the server's step socket (--step-socket): no gRPC, no "
                   "front end")
    p.add_argument("--batch", type=int, default=1, help="caches (sequences) per step")
    p.add_argument("--layers", type=int, default=1,
                   help="cache sets the steps alternate over, as a model host's layers")
    p.add_argument("--store", action=argparse.BooleanOptionalAction, default=True,
                   help="keep each step's token in the caches (--no-store: the caches stay "
                   "at --context)")
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(kv_dtype=None, max_batch_tokens=None, max_queue_delay_ms=None,
                   server_log_level="WARNING", startup_timeout=600.0)
    args = p.parse_args(argv)
    if args.stream and args.socket:
        p.error("--stream or --socket, not both")
    if args.layers < 1:
        p.error(f"--layers must be at least 1, got {args.layers}")
    socket_path = None
    if args.socket:  # the server started here listens there too
        socket_path = os.path.join(tempfile.gettempdir(), f"trace-step-{os.getpid()}.sock")
        args.server_args = f"--step-socket {socket_path}"
    s = Shapes(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps, info, events = traced_run(
        args, out_dir, "trace_step",
        lambda target: asyncio.run(_drive(target, s, args.steps, args.warm_steps, args.stream,
                                       args.batch, args.store, socket_path,
                                       args.layers)))
    if not events:
        print("no server events: were the hooks loaded? (see trace_step_server.log)")
        return 1
    result = breakdown(steps, events)
    kernel_us = statistics.median(k for *_, k in steps) * 1e6
    mode = "socket" if args.socket else "stream" if args.stream else "unary"
    summary = (f"B={args.batch}, {args.layers} layer(s), H={s.h}, H_kv={s.hkv}, D={s.d} "
               f"{s.dtype}, context {s.ctx}, "
               f"store={args.store}, {mode}; {len(steps)} "
               f"steps, {result['path_share']:.0%} took the path below. Step p50 "
               f"{result['median_total_us']:.0f} us, kernel p50 {kernel_us:.1f} us.")
    write_report(out_dir, "trace_step", "trace_step", info, argv, summary, result,
                 {"args": vars(args), "steps": len(steps), "kernel_p50_us": kernel_us})
    return 0


if __name__ == "__main__":
    sys.exit(main())
