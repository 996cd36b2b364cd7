"""Timestamps at each hand-off of a request, in every server process (benchmarks/trace_step.py).

Loaded by Python at start-up when this folder is on PYTHONPATH; does nothing unless
ATTENTION_STEP_TRACE names a folder. Then it wraps a fixed list of the service's functions
(front end, step socket, channel, engine, executor, launch) so that each call records (label,
entry or exit, perf_counter_ns, thread) in this process, and writes them to
``<folder>/trace_<pid>.json`` every half second and at exit. perf_counter is CLOCK_MONOTONIC
on Linux: one clock for every process of the host, so a step's events line up across
processes. Not for production: each wrapped call costs about a microsecond.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import json
import os
import threading
import time

_DIR = os.environ.get("ATTENTION_STEP_TRACE")
_MAX_EVENTS = 400_000

# (module, attribute path): what to time. Entry and exit are both recorded (">" and "<").
TARGETS = [
    ("attention_service.frontend.servicer", "receive_request"),
    ("attention_service.frontend.servicer", "stats_message"),
    ("attention_service.frontend.servicer", "AttentionServicer._finish"),
    ("attention_service.ipc.remote_link", "RemoteLink.run"),
    ("attention_service.ipc.remote_link", "RemoteLink.on_message"),
    ("attention_service.engine.local_link", "LocalLink.run"),
    ("attention_service.ipc.channel", "Channel.send"),
    ("attention_service.ipc.channel", "Channel._send_data"),
    ("attention_service.ipc.channel", "Channel._deliver"),
    ("attention_service.engine.core", "FrontendConnection.on_message"),
    ("attention_service.engine.core", "FrontendConnection._done"),
    ("attention_service.engine.core", "EngineCore.submit"),
    ("attention_service.engine.executor", "Executor.submit"),
    ("attention_service.engine.executor", "Executor._issue"),
    ("attention_service.engine.executor", "Executor._complete"),
    ("attention_service.engine.executor", "Executor._deliver"),
    ("attention_service.engine.executor", "_settle"),
    ("attention_service.engine.backends", "CudaBackend.launch"),
    ("attention_service.engine.backends", "CpuBackend.launch"),
    ("attention_service.engine.decode_steps", "_StepLaunch.wait"),
    ("attention_service.engine.cuda_launch", "_CudaLaunch.wait"),
    # The step socket (--step-socket): its reader thread checks, submits and (an idle GPU's
    # launch, run from that thread) answers each step; ``start_upload`` twice, as the module
    # imports the name (``_install`` wraps a function once).
    ("attention_service.step_socket", "_SocketConnection._read"),
    ("attention_service.step_socket", "_SocketConnection._start"),
    ("attention_service.step_socket", "_SocketConnection._done"),
    ("attention_service.step_socket", "_SocketConnection._answer"),
    ("attention_service.step_socket", "_SocketConnection._account"),
    ("attention_service.frontend.streams", "start_upload"),
    ("attention_service.step_socket", "start_upload"),
    ("attention_service.ipc.channel", "Channel.send_raw"),
    ("attention_service.engine.kv_caches", "CacheRegistry._finish"),
    ("attention_service.metrics", "Metrics.observe_launch"),
    ("attention_service.metrics", "Metrics.observe_request"),
    # Inside the steps above: the front end's parse and checks, the engine's cache
    # reservation and plan, the decode-step launch's parts (torch's own calls included).
    ("attention_service.frontend.streams", "parse_request"),
    ("attention_service.frontend.streams", "checked_header"),
    ("attention_service.frontend.streams", "_allocate"),
    ("attention_service.frontend.streams", "Upload.check_complete"),
    ("attention_service.engine.kv_caches", "CacheRegistry.begin"),
    ("attention_service.engine.executor", "BatchPlan"),
    ("attention_service.engine.decode_steps", "StepShape.of"),
    ("attention_service.engine.decode_steps", "DecodeSteps._graph"),
    ("attention_service.engine.decode_steps", "Staging.fill"),
    ("torch.cuda.graphs", "CUDAGraph.replay"),
    ("torch.cuda.streams", "Event.record"),
    ("torch", "Tensor.copy_"),
    # The general launch path (prefill, regions).
    ("attention_service.engine.regions", "RegionRegistry.acquire"),
    ("attention_service.engine.cuda_launch", "launch_on_stream"),
    ("attention_service.engine.cuda_launch", "_cu_seqlens"),
    ("attention_kernels", "prefill"),
    ("torch.cuda.streams", "Event.synchronize"),
]

# (module, function, label): functions that make a handler; the handlers they return are timed.
FACTORIES = [("attention_service.frontend.servicer", "_compute_unary", "unary_handler")]

events: list[tuple[str, int, int]] = []  # (label, perf_counter_ns, thread ident)
_lock = threading.Lock()


def _mark(label: str) -> None:
    if len(events) < _MAX_EVENTS:
        events.append((label, time.perf_counter_ns(), threading.get_ident()))


def _wrap(label: str, fn):  # noqa: ANN001, ANN202
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def timed_async(*a, **k):  # noqa: ANN002, ANN003, ANN202
            _mark(label + ">")
            try:
                return await fn(*a, **k)
            finally:
                _mark(label + "<")
        timed_async._step_trace = True  # type: ignore[attr-defined]
        return timed_async

    @functools.wraps(fn)
    def timed(*a, **k):  # noqa: ANN002, ANN003, ANN202
        _mark(label + ">")
        try:
            return fn(*a, **k)
        finally:
            _mark(label + "<")
    timed._step_trace = True  # type: ignore[attr-defined]
    return timed


def _install(targets: list[tuple[str, str]] = TARGETS) -> None:
    for module_name, path in targets:
        try:
            owner = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 (e.g. a process without torch: skip its hooks)
            continue
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part, None)  # a class this version lacks: skipped
        original = owner.__dict__.get(name) if isinstance(owner, type) else None
        original = original or getattr(owner, name, None)  # e.g. inherited from a C base
        # Missing, or a name bound to one already wrapped (imported from the module wrapped).
        if original is None or getattr(getattr(original, "__func__", original), "_step_trace",
                                       False):
            continue
        if isinstance(original, staticmethod):
            setattr(owner, name, staticmethod(_wrap(path, original.__func__)))
        else:
            setattr(owner, name, _wrap(path, original))


def _install_factories() -> None:
    for module_name, name, label in FACTORIES:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001
            continue
        factory = getattr(module, name)

        def timed_factory(*a, _factory=factory, _label=label, **k):  # noqa: ANN002, ANN003, ANN202
            return _wrap(_label, _factory(*a, **k))

        setattr(module, name, timed_factory)


def _dump() -> None:
    with _lock:  # the dump thread and atexit: one writer at a time
        tmp = os.path.join(_DIR, f".trace_{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "events": list(events)}, f)
        os.replace(tmp, os.path.join(_DIR, f"trace_{os.getpid()}.json"))


def _dump_loop() -> None:
    while True:
        time.sleep(0.5)
        if events:
            _dump()


def _start() -> None:
    import sys

    # Only the server's processes: "python -m attention_service" and its spawned children.
    argv = " ".join(sys.orig_argv)  # sys.argv lacks the -m module name at this point
    if "attention_service" not in argv and "multiprocessing" not in argv:
        return
    _install()
    _install_factories()
    threading.Thread(target=_dump_loop, name="step-trace-dump", daemon=True).start()
    atexit.register(lambda: events and _dump())


if _DIR:
    _start()
