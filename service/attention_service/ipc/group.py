"""The process group (``attention-server --frontends N``, N > 1): this process is the engine.

It owns CUDA, the executor (batching spans every front end) and the region registry, and it
supervises N front-end processes (``ipc.frontend_main``) that do all the gRPC work on one port
(``SO_REUSEPORT``). Per front end: a channel (a socketpair) and an arena (shared memory the
engine page-locks once), so tensor bytes are written once by the front end and DMA'd to the
GPU from there. Lifecycle:

* start: reserve the port (fail loudly if taken), start the front ends, wait until each
  listens, warm up, then tell them to serve (health SERVING);
* a front end dies (kill -9, a crash): its calls are cancelled (its clients see UNAVAILABLE as
  their connections drop), the engine waits until no copy into its arena is pending, and
  starts a new one in its place (backing off if it keeps dying);
* SIGTERM/SIGINT: forwarded to every front end (each drains for ``--grace-seconds`` and exits
  0) while the engine keeps serving their in-flight calls; then the engine stops, exit 0. A
  second signal is forwarded too (cancel in-flight calls now);
* the engine dies: every front end sees its channel close, logs it and exits 1. Nothing hangs.

Metrics: prometheus_client's multiprocess mode, in a private directory made here before the
library is imported; the engine serves the merged ``/metrics``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from attention_service.config import ServerConfig, auto_arena_bytes
from attention_service.cpus import Placement, pin_process
from attention_service.errors import StartupError
from attention_service.heap import freeze_startup_heap

log = logging.getLogger("attention_service")

START_TIMEOUT_S = 120.0
RESTART_WINDOW_S = 60.0
# A draining front end gets --grace-seconds and this much more to exit (a process stopped by
# SIGSTOP, or wedged, would otherwise keep the engine waiting for good); then it is killed.
DRAIN_MARGIN_S = 5.0


def reserve_port(host: str, port: int, names: str = "--host, --port"
                 ) -> tuple[list[socket.socket], int]:
    """Hold ``port`` (0: a free one) on every address ``host`` resolves to, with SO_REUSEPORT,
    so the front ends can bind it too; fail loudly if anything else listens there. ``host``
    may be bracketed (``[::1]``, as grpc takes it). SO_REUSEADDR as well: connections of an
    earlier server in TIME_WAIT on the port must not refuse it (grpc's own bind sets it)."""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"could not resolve --host {host!r}: {exc}") from None
    held: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in infos:
            if port:  # a probe without SO_REUSEPORT: refused while another server listens
                with socket.socket(family, kind, proto) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    try:
                        probe.bind(addr[:2])
                    except OSError as exc:
                        raise StartupError(f"could not bind {host}:{port} ({names}): "
                                           f"{exc}") from None
            s = socket.socket(family, kind, proto)
            held.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((addr[0], port) + tuple(addr[2:]))
            port = s.getsockname()[1]
    except BaseException:
        for s in held:
            s.close()
        raise
    return held, port


class _ControlPool(ThreadPoolExecutor):
    """The control calls' threads (cache and region rpcs: they bypass the executor), with a
    count of those running: the channel readers must not poll while one does (a polling
    reader keeps the GIL from it, ~2 ms a call at one client)."""

    def __init__(self) -> None:
        super().__init__(2, thread_name_prefix="attention-control")
        self._lock = threading.Lock()
        self._running = 0

    @property
    def busy(self) -> bool:
        return self._running > 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._running += 1

        def run() -> Any:
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self._running -= 1

        try:
            return super().submit(run)
        except BaseException:
            with self._lock:
                self._running -= 1
            raise


@dataclass
class _Slot:
    index: int
    arena_fd: int
    arena: Any  # torch uint8 tensor over the engine's mapping
    unpin: Any
    proc: subprocess.Popen[bytes] | None = None
    conn: Any = None
    bound: bool = False
    deaths: list[float] = field(default_factory=list)


class Group:
    def __init__(self, config: ServerConfig, count: int, place: Placement) -> None:
        self.config = config
        self.count = count
        self.arena_bytes = config.arena_bytes or auto_arena_bytes(count)  # per front end
        self.placement = place
        self.events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.slots: list[_Slot] = []
        self.draining = False
        self.warmup_thread: threading.Thread | None = None
        self._control_pool = _ControlPool()
        self._spinner: Any = None  # the readers' Spinner, made with the engine core

    # ---- events (signal handlers and helper threads post here) ---------------------------

    def _post(self, *event: Any) -> None:
        self.events.put(event)

    def _watch(self, slot: _Slot, proc: subprocess.Popen[bytes]) -> None:
        rc = proc.wait()
        self._post("exited", slot.index, proc, rc)

    # ---- front ends ---------------------------------------------------------------------

    def _spawn(self, slot: _Slot) -> None:
        from attention_service.engine.core import FrontendConnection
        from attention_service.ipc.channel import Channel, Hello

        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [sys.executable, "-m", "attention_service.ipc.frontend_main",
               "--sock-fd", str(theirs.fileno()), "--arena-fd", str(slot.arena_fd)]
        try:
            proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(), slot.arena_fd))
        finally:
            theirs.close()
        conn = FrontendConnection(
            slot.index, self.core, slot.arena, self._control_pool,
            on_bound=lambda msg: self._post("bound", msg),
        )
        channel = Channel(mine, conn.on_message, conn.on_channel_close, f"engine-{slot.index}",
                          batch_scope=self.core.executor.deferring, spinner=self._spinner)
        conn.attach(channel)
        channel.start()
        slot.proc, slot.conn, slot.bound = proc, conn, False
        config = self.config.replace(port=self.port)
        channel.send(Hello(config, self.core.info, slot.index, self.arena_bytes,
                           self.placement.frontends))
        threading.Thread(target=self._watch, args=(slot, proc), daemon=True,
                         name=f"attention-watch-{slot.index}").start()

    def _replace(self, slot: _Slot) -> None:
        """A front end died: cancel its calls, wait until its arena is quiet, start another."""
        conn = slot.conn
        conn.cancel_all()
        if not conn.wait_idle(60.0):
            log.error("front end %d: calls still in the engine after 60 s", slot.index)
        conn.channel.close()
        now = time.monotonic()
        slot.deaths = [t for t in slot.deaths if now - t < RESTART_WINDOW_S] + [now]
        # At once the first time; then 0.5, 1, 2 ... 30 s while it keeps dying within a minute.
        repeats = len(slot.deaths) - 1
        time.sleep(min(30.0, 0.5 * 2 ** (repeats - 1)) if repeats else 0.0)
        self._post("respawn", slot.index)

    def _signal_all(self, sig: int) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(sig)

    def _processes(self) -> list[tuple[str, int]]:
        """(role, pid) of the engine and every live front end, for the per-process metrics."""
        live = [s.proc for s in self.slots if s.proc is not None and s.proc.poll() is None]
        return [("engine", os.getpid())] + [("frontend", p.pid) for p in live]

    # ---- the engine process -------------------------------------------------------------

    def run(self) -> int:
        from prometheus_client import multiprocess

        from attention_service.engine.backends import make_backend
        from attention_service.engine.core import EngineCore
        from attention_service.ipc import arena as arenas
        from attention_service.ipc.channel import Serving, Spinner, corked
        from attention_service.metrics import LiveCollector, Metrics
        from attention_service.server import gpu_uuid, versions
        from attention_service.step_socket import StepSocket, start_step_socket

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: self._post("signal", signum))
        cfg = self.config
        backend = make_backend(cfg.device, cfg.cuda_graphs)
        metrics = Metrics(multiprocess=True, held=True)
        self.core = core = EngineCore(cfg, backend, observer=metrics, frontends=self.count,
                                      delivery_scope=corked)
        # The readers poll for the next request only while the engine is idle: with launches
        # or control calls in flight, a polling reader would take the GIL from the threads
        # doing the work.
        control = self._control_pool
        self._spinner = Spinner(cfg.spin_seconds,
                                lambda: core.executor.idle and not control.busy)
        held, self.port = reserve_port(cfg.host, cfg.port)
        try:
            held += self._reserve_frontend_ports(cfg)
        except BaseException:
            for s in held:
                s.close()
            raise
        alive = lambda: sum(1 for s in self.slots if s.bound and s.proc and s.proc.poll() is None)  # noqa: E731
        metrics.bind(LiveCollector(core.info, versions(core), core.queue_depth, backend.memory,
                                   alive, core.caches.gauges, core.regions.gauges,
                                   queue_capacity=cfg.max_queue_size,
                                   processes=self._processes, gpu_uuid=gpu_uuid(backend),
                                   nixl_transports=core.regions.nixl.transports))
        metrics_port = None
        step_socket: StepSocket | None = None
        try:
            for i in range(self.count):
                try:
                    fd = arenas.create(self.arena_bytes)
                    tensor, unpin = _engine_view(fd, self.arena_bytes, backend.name)
                except (OSError, RuntimeError) as exc:
                    raise StartupError(f"--arena-bytes: could not map front end {i}'s arena of "
                                       f"{self.arena_bytes} bytes: {exc}") from None
                self.slots.append(_Slot(i, fd, tensor, unpin))
            metrics_port = metrics.serve(cfg.metrics_host, cfg.metrics_port)
            if cfg.step_socket:  # listening before any front end can advertise it
                step_socket = start_step_socket(cfg, core, metrics)
            for slot in self.slots:
                self._spawn(slot)
            warm = threading.Event()
            failed: list[BaseException] = []

            def warmup() -> None:
                try:
                    if cfg.warmup:
                        t0 = time.perf_counter()
                        core.warmup()
                        log.info("warm-up on %s took %.2fs", backend.name,
                                 time.perf_counter() - t0)
                    freeze_startup_heap()
                except BaseException as exc:
                    failed.append(exc)
                finally:
                    warm.set()
                    self._post("warm")

            started = False
            serving = False
            forced = False
            failed_drain = False
            reported: set[int] = set()  # pids whose exit this loop has handled
            deadline = time.monotonic() + START_TIMEOUT_S
            drain_deadline = math.inf
            while True:
                if time.monotonic() > drain_deadline and not forced:
                    forced = True
                    stuck = [s.proc.pid for s in self.slots
                             if s.proc is not None and s.proc.poll() is None]
                    log.error("front ends %s still running %.1fs after the drain began (the "
                              "grace period and %.0fs more): killing them", stuck,
                              cfg.grace_seconds + DRAIN_MARGIN_S, DRAIN_MARGIN_S)
                    self._signal_all(signal.SIGKILL)
                try:
                    event = self.events.get(timeout=1.0)
                except queue.Empty:
                    if not started and time.monotonic() > deadline:
                        raise RuntimeError("front ends did not start in time") from None
                    continue
                kind = event[0]
                if kind == "bound":
                    msg = event[1]
                    self.slots[msg.slot].bound = True
                    # Parseable: tests find each front end's pid here.
                    log.info("front end %d listening (pid %d)%s", msg.slot, msg.pid,
                             ", restarted" if started else "")
                    if serving:
                        self.slots[msg.slot].conn.send(Serving())
                    if not started and all(s.bound for s in self.slots):
                        started = True
                        # Parseable lines: tests and scripts read the bound ports from them.
                        log.info("listening on port %d (backend %s, device %s, %d front ends, "
                                 "polling %.0f us, %s)", self.port, backend.name,
                                 backend.device_name, self.count, cfg.spin_seconds * 1e6,
                                 self.placement.describe())
                        log.info("%s", cfg.describe_access(self.port))
                        if metrics_port is not None:
                            log.info("metrics on port %d", metrics_port)
                        self.warmup_thread = threading.Thread(
                            target=warmup, daemon=True, name="attention-warmup")
                        self.warmup_thread.start()
                elif kind == "warm":
                    if failed:
                        raise failed[0]
                    if self.placement.engine:
                        # After the warm-up: its compile workers are this process's children
                        # and would inherit the engine's few CPUs.
                        pin_process(self.placement.engine)
                    if not self.draining:
                        serving = True
                        if step_socket is not None:
                            step_socket.serve()
                        for slot in self.slots:
                            if slot.bound:
                                slot.conn.send(Serving())
                elif kind == "signal":
                    if not self.draining:
                        self.draining = True
                        if step_socket is not None:
                            step_socket.drain()
                        drain_deadline = time.monotonic() + cfg.grace_seconds + DRAIN_MARGIN_S
                        log.info("shutting down: front ends drain in-flight calls for up to "
                                 "%.1fs", cfg.grace_seconds)
                        self._signal_all(signal.SIGTERM)
                    else:
                        log.warning("second signal: front ends cancel in-flight calls")
                        self._signal_all(signal.SIGTERM)
                elif kind == "exited":
                    index, proc, rc = event[1], event[2], event[3]
                    reported.add(proc.pid)
                    slot = self.slots[index]
                    if proc is not slot.proc:
                        continue
                    multiprocess.mark_process_dead(proc.pid)
                    if self.draining:
                        if rc != 0 and not forced:
                            # Its calls still draining are lost: the group must not say 0.
                            failed_drain = True
                            log.error("front end %d (pid %d) exited with code %s while "
                                      "draining: its in-flight calls are lost", index,
                                      proc.pid, rc)
                        # Every exit handled, not every process dead: a front end killed
                        # while another's exit is handled must still count as lost calls.
                        if all(s.proc is None or s.proc.pid in reported for s in self.slots):
                            break
                        continue
                    if not started:
                        raise RuntimeError(f"front end {index} exited with code {rc} while "
                                           "starting (see its log above)")
                    lost = slot.conn.inflight if slot.conn is not None else 0
                    log.error("front end %d (pid %d) exited with code %s: its in-flight calls "
                              "are lost (%d of them had reached the engine; their clients see "
                              "UNAVAILABLE); restarting it", index, proc.pid, rc, lost)
                    metrics.frontend_restarts.inc()
                    metrics.frontend_lost_calls.inc(lost)
                    slot.bound = False
                    threading.Thread(target=self._replace, args=(slot,), daemon=True).start()
                elif kind == "respawn" and not self.draining:
                    self._spawn(self.slots[event[1]])
            log.info("front ends stopped; stopping the engine")
            return 1 if forced or failed_drain else 0
        except StartupError:  # attention-server says why on one line
            self._signal_all(signal.SIGKILL)
            raise
        except BaseException:
            log.exception("engine failed: stopping every front end")
            self._signal_all(signal.SIGKILL)
            return 1
        finally:
            for slot in self.slots:
                if slot.proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        slot.proc.wait(5)
                    if slot.proc.poll() is None:
                        slot.proc.kill()
                if slot.conn is not None and slot.conn.channel is not None:
                    slot.conn.channel.close()
            if step_socket is not None:
                step_socket.drain()
            core.close()  # answers what the step_socket had started
            if step_socket is not None:
                step_socket.close()
            metrics.close()
            self._control_pool.shutdown(wait=False)
            for slot in self.slots:
                slot.unpin()
                os.close(slot.arena_fd)
            for s in held:
                s.close()
            log.info("stopped")


    def _reserve_frontend_ports(self, cfg: ServerConfig) -> list[socket.socket]:
        """``--frontend-ports``: each front end's own port, held as the shared one is (a port
        another server listens on fails startup; a front end restarting finds its own
        free). Refused where the range takes in the shared or the metrics port."""
        if not cfg.frontend_ports:
            return []
        ports = range(cfg.frontend_ports, cfg.frontend_ports + self.count)
        clash = sorted({self.port, cfg.metrics_port} & set(ports))
        if clash:
            raise StartupError(f"--frontend-ports {cfg.frontend_ports}: the front ends' ports "
                               f"{ports[0]}..{ports[-1]} take in {clash[0]} (--port or "
                               "--metrics-port)")
        held: list[socket.socket] = []
        try:
            for port in ports:
                held += reserve_port(cfg.host, port, f"--frontend-ports: front end "
                                                     f"{port - ports[0]}'s")[0]
        except BaseException:
            for s in held:
                s.close()
            raise
        return held


def _engine_view(fd: int, size: int, backend: str) -> tuple[Any, Any]:
    """The engine's uint8 tensor over an arena, page-locked for the GPU on cuda."""
    import mmap

    import torch

    from attention_service.engine.regions import pin

    tensor = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
    unpin = pin(tensor, size) if backend == "cuda" else (lambda: None)
    return tensor, unpin


METRICS_DIR_PREFIX = "attention-metrics-"


def _remove_stale_metrics_dirs() -> None:
    """Metrics directories of engines that died without cleaning up (kill -9, OOM): named
    ``attention-metrics-<pid>-*``; a pid that is gone, or is this process's (a restarted
    container's engine often gets its predecessor's pid), marks one stale."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid_text = name[len(METRICS_DIR_PREFIX):].split("-", 1)[0]
        if not name.startswith(METRICS_DIR_PREFIX) or not pid_text.isdigit():
            continue
        pid = int(pid_text)
        if pid != os.getpid():
            try:
                os.kill(pid, 0)
                continue  # a live engine's (or another user's: not ours to judge)
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def run_group(config: ServerConfig, place: Placement | None = None) -> int:
    """``place``: where the processes run (``cpus.placement``; None: not placed)."""
    count = config.process_count
    _remove_stale_metrics_dirs()
    metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-")
    # Before prometheus_client is imported anywhere in this process or its children.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    group = Group(config, count, place or Placement(None, None))
    try:
        rc = group.run()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if group.warmup_thread is not None and group.warmup_thread.is_alive():
        from attention_service.engine.warmup import exit_during_warmup

        exit_during_warmup(rc)
    return rc
