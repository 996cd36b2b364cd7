"""Prometheus metrics, exactly the names in docs/CONTRACTS.md.

Two modes, one set of names:

* single process: each server owns a CollectorRegistry (so several servers can live in one
  process, as in tests) and serves it;
* process group (``--frontends N``): prometheus_client's multiprocess mode. Every process
  (front ends count calls, the engine counts launches) writes its samples to files in
  ``PROMETHEUS_MULTIPROC_DIR``; the engine serves one ``/metrics`` that merges them
  (``MultiProcessCollector``), so counters of a front end that died and was restarted are
  kept, and live gauges of dead processes are dropped (``mark_process_dead``).

Values read at scrape time (queue depth, GPU memory, device info, live front ends, each
process's CPU and memory from /proc, NVML's GPU readings) come from a collector in the serving
process. The client library's own ``process_*``/``python_*`` series describe the serving
process only (multiprocess mode cannot merge them), so every process of a group is also
reported, by ``role`` and ``pid``, in ``attention_process_*``.

Histograms (not summaries) so quantiles aggregate across replicas. Throughput comes from
counters (work and kernel seconds, per rpc): ``rate(work) / rate(seconds)`` weighs each
launch by its time, where a per-launch histogram weighs a tiny launch like a huge one.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from attention_service.errors import StartupError
from attention_service.link import EngineInfo
from attention_service.params import Op
from attention_wire import unary_method
from attention_wire.pb import attention_pb2 as pb

# A `_created` timestamp beside every counter and histogram doubles the output; no query
# reads them (multiprocess mode never had them).
disable_created_metrics()

log = logging.getLogger("attention_service")

COMPUTE_RPCS = tuple(op.rpc for op in Op)
STAGES = ("h2d", "kernel", "d2h")

# A compute rpc's unary twin and step stream -> the rpc (``PrefillSteps`` -> ``Prefill``): the
# op their handlers (add_to_server) serve, hence the ``rpc`` label their calls count under.
_OP_RPC = {unary_method(op.rpc): op.rpc for op in Op} | {
    op.steps_rpc: op.rpc for op in Op if op.steps_rpc}


def metric_rpc(method: str) -> str:
    """The ``rpc`` label of a method's calls: its op's rpc, or the method's own name."""
    return _OP_RPC.get(method, method)


_DURATION = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_WAIT = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_STAGE = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
          0.25, 0.5, 1, 2.5, 5, 10)
_BATCH_REQUESTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_BATCH_TOKENS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
# Per-launch rates in base units: cpu reference launches land in the low buckets, H100/H200
# launches in the high ones (FLOP/s up to 1 PFLOP/s, bytes/s up to 5 TB/s).
_FLOPS_PER_S = tuple(x * 1e12 for x in (0.01, 0.1, 1, 5, 10, 25, 50, 100, 150, 200, 300, 400,
                                        500, 700, 1000))
_BYTES_PER_S = tuple(x * 1e9 for x in (0.1, 1, 10, 50, 100, 250, 500, 1000, 1500, 2000, 2500,
                                       3000, 3500, 4000, 5000))


def _proc_stat(path: str) -> list[bytes]:
    """The fields of a /proc ``stat`` file after the command name (which may hold spaces):
    index 0 is field 3 (state), so field n of proc(5) is index n - 3."""
    with open(path, "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_usage(pid: int) -> tuple[float, float, int] | None:
    """(CPU seconds, CPU seconds of its main thread, resident bytes) of a process, from /proc;
    None when it is gone or there is no /proc (not Linux)."""
    try:
        proc = _proc_stat(f"/proc/{pid}/stat")
        main = _proc_stat(f"/proc/{pid}/task/{pid}/stat")
    except (OSError, IndexError):
        return None
    # utime, stime: fields 14, 15 (clock ticks); rss: field 24 (pages).
    cpu = (int(proc[11]) + int(proc[12])) / _CLK_TCK
    main_cpu = (int(main[11]) + int(main[12])) / _CLK_TCK
    return cpu, main_cpu, int(proc[21]) * _PAGE


def _own_process() -> list[tuple[str, int]]:
    return [("server", os.getpid())]


def _uuid_hex(text: str | bytes) -> str:
    """A GPU UUID as bare hex, whatever its spelling (NVML's ``GPU-8ecf...``, torch's)."""
    if isinstance(text, bytes):
        text = text.decode()
    text = text.lower()
    if text.startswith(("gpu-", "mig-")):
        text = text[4:]
    return text.replace("-", "")


class NvmlGauges:
    """GPU utilisation, memory, power, temperature and SM clock of one GPU, read from NVML
    (``nvidia-ml-py``) at scrape time. Optional: without the library, a driver or the GPU,
    nothing is exported (and nothing fails); a reading the GPU does not support is left out."""

    def __init__(self, uuid_hex: str) -> None:
        """``uuid_hex``: the GPU's UUID as bare hex (``server.gpu_uuid``)."""
        self._uuid = uuid_hex
        self._nvml: Any = None
        self._handle: Any = None
        self._tried = False

    def _open(self) -> None:
        self._tried = True
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                if _uuid_hex(pynvml.nvmlDeviceGetUUID(handle)) == self._uuid:
                    self._nvml, self._handle = pynvml, handle
                    return
            log.info("NVML does not list this GPU (uuid %s): no attention_gpu_* NVML gauges",
                     self._uuid)
        except Exception as exc:  # no library, no driver, no permission
            log.info("NVML unavailable (%s: %s): no attention_gpu_* NVML gauges",
                     type(exc).__name__, exc)

    @staticmethod
    def _query(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception:  # NVMLError_NotSupported and the like: leave this reading out
            return None

    def _read(self, fn: Callable[[], float]) -> float | None:
        value = self._query(fn)
        return None if value is None else float(value)

    def collect(self) -> Iterator[Metric]:
        if not self._tried:
            self._open()
        nv, h = self._nvml, self._handle
        if h is None:
            return
        # In base units: ratios from NVML's percent, watts from mW, hertz from MHz.
        rates = self._query(lambda: nv.nvmlDeviceGetUtilizationRates(h))
        memory = self._query(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        util = None if rates is None else rates.gpu / 100
        mem_busy = None if rates is None else rates.memory / 100
        used = None if memory is None else float(memory.used)
        total = None if memory is None else float(memory.total)
        power = self._read(lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000)
        limit = self._read(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000)
        temp = self._read(lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        clock = self._read(lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM) * 1_000_000)
        readings = [
            ("attention_gpu_utilization_ratio",
             "Fraction of NVML's last sample period in which a kernel ran on the GPU (any "
             "process).", util),
            ("attention_gpu_memory_busy_ratio",
             "Fraction of NVML's last sample period in which device memory was read or "
             "written.", mem_busy),
            ("attention_gpu_memory_used_bytes", "Device memory in use, all processes (NVML).",
             used),
            ("attention_gpu_memory_total_bytes", "Device memory (NVML).", total),
            ("attention_gpu_power_watts", "Power draw (NVML).", power),
            ("attention_gpu_power_limit_watts", "Enforced power limit (NVML).", limit),
            ("attention_gpu_temperature_celsius", "GPU temperature (NVML).", temp),
            ("attention_gpu_sm_clock_hertz", "SM clock (NVML).", clock),
        ]
        for name, doc, value in readings:
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)


class LiveCollector(Collector):
    """Values read when scraped, from the process that owns them (the engine's)."""

    def __init__(
        self, info: EngineInfo, versions: dict[str, str], queue_depth: Callable[[Op], int],
        memory: Callable[[], tuple[int, int]], frontends: Callable[[], int],
        kv_caches: Callable[[], tuple[int, int, int, int]] = lambda: (0, 0, 0, 0),
        regions: Callable[[], tuple[int, int]] = lambda: (0, 0), *,
        queue_capacity: int = 0,
        processes: Callable[[], list[tuple[str, int]]] = _own_process,
        gpu_uuid: str | None = None,
        nixl_transports: Callable[[], list[tuple[str, ...]]] = list,
    ) -> None:
        """``kv_caches``: (pages used, pages total, caches live, caches expired so far);
        ``regions``: (regions registered, regions dropped by the idle TTL so far);
        ``queue_capacity``: requests the queue holds (``--max-queue-size``); ``processes``:
        (role, pid) of every process to report; ``gpu_uuid``: the GPU to read NVML for;
        ``nixl_transports``: the transports UCX picked for NIXL regions (``ucx_choices``)."""
        self._info = info
        self._versions = versions
        self._queue_depth = queue_depth
        self._queue_capacity = queue_capacity
        self._memory = memory
        self._frontends = frontends
        self._kv_caches = kv_caches
        self._regions = regions
        self._processes = processes
        self._nvml = NvmlGauges(gpu_uuid) if gpu_uuid else None
        self._nixl_transports = nixl_transports

    def describe(self) -> list[Metric]:
        return []  # nothing to check for clashes at registration; collect() says it all

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "attention_queue_depth", "Requests waiting for a launch.", labels=["rpc"]
        )
        for op in Op:
            depth.add_metric([op.rpc], self._queue_depth(op))
        yield depth
        yield GaugeMetricFamily(
            "attention_queue_capacity",
            "Requests the queue holds, all rpcs together, before it answers RESOURCE_EXHAUSTED "
            "(--max-queue-size).", value=self._queue_capacity,
        )
        allocated, reserved = self._memory()
        yield GaugeMetricFamily("attention_gpu_memory_allocated_bytes",
                                "torch.cuda.memory_allocated (0 on cpu).", value=allocated)
        yield GaugeMetricFamily("attention_gpu_memory_reserved_bytes",
                                "torch.cuda.memory_reserved (0 on cpu).", value=reserved)
        if self._nvml is not None:
            yield from self._nvml.collect()
        yield GaugeMetricFamily("attention_frontends",
                                "gRPC front-end processes alive (1 in a single process).",
                                value=self._frontends())
        yield from self._process_families()
        used, total, live, expired = self._kv_caches()
        page = self._info.kv_page_bytes
        yield GaugeMetricFamily("attention_kv_pool_used_bytes",
                                "KV-cache pool bytes held by caches (whole pages).",
                                value=used * page)
        yield GaugeMetricFamily("attention_kv_pool_bytes", "KV-cache pool size (0: caches off).",
                                value=total * page)
        yield GaugeMetricFamily("attention_kv_caches", "KV caches alive, all callers.",
                                value=live)
        yield CounterMetricFamily("attention_kv_caches_expired",
                                  "KV caches released by the idle TTL.", value=expired)
        regions, regions_expired = self._regions()
        yield GaugeMetricFamily("attention_regions",
                                "Shared-memory regions registered, all callers.", value=regions)
        yield CounterMetricFamily("attention_regions_expired",
                                  "Regions dropped by the idle TTL (--region-ttl).",
                                  value=regions_expired)
        transports = GaugeMetricFamily(
            "attention_nixl_transport",
            "1 for each transport UCX picked to move NIXL regions' bytes (from its protocol "
            "tables): peer intra-node or inter-node, op read or write, the memory here and "
            "at the peer (host or cuda).",
            labels=[f.name for f in pb.NixlTransport.DESCRIPTOR.fields])
        for choice in self._nixl_transports():
            transports.add_metric(list(choice), 1)
        yield transports
        # Exposed as attention_device_info{...} 1.
        yield InfoMetricFamily(
            "attention_device", "Device and versions.",
            value={"device": self._info.device, "backend": self._info.backend, **self._versions},
        )

    def _process_families(self) -> Iterator[Metric]:
        labels = ["role", "pid"]
        cpu = CounterMetricFamily(
            "attention_process_cpu_seconds",
            "CPU time (user + system) of each process of the server: role server (one "
            "process), engine or frontend.", labels=labels,
        )
        main = CounterMetricFamily(
            "attention_process_main_thread_cpu_seconds",
            "CPU time of each process's main thread: the asyncio event loop of a front end "
            "(and of a single process).", labels=labels,
        )
        rss = GaugeMetricFamily(
            "attention_process_resident_memory_bytes", "Resident memory of each process.",
            labels=labels,
        )
        for role, pid in self._processes():
            usage = process_usage(pid)
            if usage is None:
                continue
            key = [role, str(pid)]
            cpu.add_metric(key, usage[0])
            main.add_metric(key, usage[1])
            rss.add_metric(key, usage[2])
        yield from (cpu, main, rss)


def _standard_collectors(registry: CollectorRegistry) -> None:
    """The client library's process_* (this process: CPU, memory, fds, start time) and
    python_* (version, GC) series."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


class _HeldCounter:
    """A counter series' increments held as a plain number until ``flush``."""

    __slots__ = ("child", "pending")

    def __init__(self, child: Any) -> None:
        self.child, self.pending = child, 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:  # refused at the caller, as prometheus_client's ``inc`` refuses it
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.pending += amount

    def flush(self) -> None:
        if self.pending:
            pending, self.pending = self.pending, 0.0
            self.child.inc(pending)


class _HeldHistogram:
    """A histogram series' observations held as a sum and bucket counts until ``flush``,
    which adds them to the series' own values (prometheus_client's ``_sum``/``_buckets``:
    its ``observe`` has no count argument)."""

    __slots__ = ("child", "bounds", "sum", "counts")

    def __init__(self, child: Any) -> None:
        self.child, self.bounds = child, child._upper_bounds
        self.sum, self.counts = 0.0, [0] * len(self.bounds)

    def observe(self, amount: float) -> None:
        self.sum += amount
        if amount == amount:  # NaN falls in no bucket, as with ``observe``
            self.counts[bisect.bisect_left(self.bounds, amount)] += 1  # first bound >= it

    def flush(self) -> None:
        total, self.sum = self.sum, 0.0
        counts, self.counts = self.counts, [0] * len(self.bounds)
        if total:
            self.child._sum.inc(total)
        for i, n in enumerate(counts):
            if n:
                self.child._buckets[i].inc(n)


class _FlushingRegistry(CollectorRegistry):
    """A registry whose every read (a whole scrape, or one filtered with ``name[]``, which
    prometheus_client serves from ``restricted_registry``) writes the held values first."""

    def __init__(self, flush: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._flush = flush

    def collect(self) -> Iterator[Metric]:
        self._flush()
        return super().collect()

    def restricted_registry(self, names: Any) -> Any:
        self._flush()
        return super().restricted_registry(names)


class Metrics:
    def __init__(self, multiprocess: bool = False, held: bool = False) -> None:
        """``held``: the per-call and per-launch series (``observe_request``,
        ``observe_launch``) are counted in plain numbers and written to prometheus_client's
        values only when this process's ``/metrics`` is read (and at ``close``): the serving
        process's choice. Written at once, a B=64 decode step's ~30 values (a lock, a pid
        check and an mmap write each in multiprocess mode) took ~36 us of the engine's one
        interpreter lock, held ~28 (H200, benchmarks/trace_step.py --socket)."""
        self.multiprocess = multiprocess
        self._held: list[_HeldCounter | _HeldHistogram] | None = [] if held else None
        self._hold = threading.Lock() if held else contextlib.nullcontext()
        self._launch_children: dict[Op, tuple[Any, ...]] = {}  # observe_launch's series
        self._request_children: dict[tuple[str, str], tuple[Any, ...]] = {}  # observe_request's
        self._wait_children: dict[str, tuple[Any, Any]] = {}  # queue wait, engine time
        # Multiprocess samples go to PROMETHEUS_MULTIPROC_DIR, not to a registry.
        r = None if multiprocess else self._registry(auto_describe=True)
        self.registry = r
        if r is not None:
            _standard_collectors(r)
        self.requests = Counter(
            "attention_requests", "Finished calls by rpc and gRPC status code.",
            ["rpc", "code"], registry=r,
        )
        self.duration = Histogram(
            "attention_request_duration_seconds", "Call duration, first message to status.",
            ["rpc", "code"], buckets=_DURATION, registry=r,
        )
        self.queue_wait = Histogram(
            "attention_queue_wait_seconds", "Time from fully received to launch start.",
            ["rpc"], buckets=_WAIT, registry=r,
        )
        self.engine_time = Histogram(
            "attention_engine_seconds",
            "Time from handing a fully received request to the engine to its answer back: "
            "queue, launch, device and, with several front ends, the hops to the engine "
            "process. The rest of a call's duration is its front end's.",
            ["rpc"], buckets=_WAIT, registry=r,
        )
        self.launch_issue = Histogram(
            "attention_launch_issue_seconds",
            "Host time to issue one launch: from leaving the queue to its copies and kernels "
            "queued on the device.",
            ["rpc"], buckets=_STAGE, registry=r,
        )
        self.stage = Histogram(
            "attention_stage_seconds", "Per-launch time of each stage.",
            ["rpc", "stage"], buckets=_STAGE, registry=r,
        )
        self.batch_requests = Histogram(
            "attention_batch_requests", "Requests merged into one launch.",
            ["rpc"], buckets=_BATCH_REQUESTS, registry=r,
        )
        self.batch_tokens = Histogram(
            "attention_batch_tokens", "Tokens per launch (queries for prefill, keys for decode).",
            ["rpc"], buckets=_BATCH_TOKENS, registry=r,
        )
        self.batches = Counter("attention_batches", "Kernel launches.", ["rpc"], registry=r)
        self.input_bytes = Counter(
            "attention_input_bytes", "Tensor bytes received through gRPC.", ["rpc"], registry=r
        )
        self.output_bytes = Counter(
            "attention_output_bytes", "Tensor bytes sent through gRPC.", ["rpc"], registry=r
        )
        self.region_bytes = Counter(
            "attention_region_bytes",
            "Tensor bytes read from (in) or written to (out) registered shared-memory regions.",
            ["rpc", "direction"], registry=r,
        )
        self.tokens = Counter(
            "attention_tokens", "Tokens served (queries for prefill, keys for decode).",
            ["rpc"], registry=r,
        )
        self.flops = Counter(
            "attention_flops", "Floating-point operations served (OK calls).", ["rpc"],
            registry=r,
        )
        self.kernel_seconds = Counter(
            "attention_kernel_seconds",
            "Kernel time of every launch, summed: rate() is the share of time a kernel of "
            "this rpc ran.", ["rpc"], registry=r,
        )
        self.kernel_flops = Counter(
            "attention_kernel_flops",
            "Floating-point operations of every launch: rate(this) / "
            "rate(attention_kernel_seconds_total) is the kernels' FLOP/s.", ["rpc"], registry=r,
        )
        self.kernel_kv_bytes = Counter(
            "attention_kernel_kv_bytes",
            "Key/value bytes every launch's kernel reads: rate(this) / "
            "rate(attention_kernel_seconds_total) is the kernels' bytes/s.", ["rpc"],
            registry=r,
        )
        # NIXL regions' transfers (engine/nixl_agent.py): both directions exported from the
        # start, so the series exist before the first NIXL call.
        nixl_bytes = Counter("attention_nixl_bytes", "Bytes NIXL regions moved, by direction "
                             "(in: pulled from clients, out: pushed back).", ["direction"],
                             registry=r)
        nixl_seconds = Histogram(
            "attention_nixl_transfer_seconds", "One NIXL transfer (a call's spans of one "
            "client, one direction), start to done.", ["direction"], buckets=_WAIT, registry=r)
        self._nixl_children = {d: (nixl_bytes.labels(direction=d),
                                   nixl_seconds.labels(direction=d)) for d in ("in", "out")}
        self.prefill_flops_rate = Histogram(
            "attention_prefill_kernel_flops_per_second",
            "FLOP/s of each prefill launch (each launch counts once, whatever its size: for "
            "throughput use the attention_kernel_* counters).",
            ["rpc"], buckets=_FLOPS_PER_S, registry=r,
        )
        self.decode_bytes_rate = Histogram(
            "attention_decode_kernel_bytes_per_second",
            "K/V bytes/s of each decode launch (each launch counts once, whatever its size: "
            "for throughput use the attention_kernel_* counters).",
            ["rpc"], buckets=_BYTES_PER_S, registry=r,
        )
        self.inflight = Gauge(
            "attention_inflight_requests",
            "Compute calls in progress (every rpc that runs on the engine).", registry=r,
            multiprocess_mode="livesum",
        )
        self.frontend_restarts = Counter(
            "attention_frontend_restarts", "Front-end processes restarted after they died.",
            registry=r,
        )
        # A dead front end's in-flight calls never reach its own request counters (it died
        # before it could count them); the engine counts the ones it had.
        self.frontend_lost_calls = Counter(
            "attention_frontend_lost_calls",
            "Calls in the engine when their front-end process died (their clients saw "
            "UNAVAILABLE); calls the front end had not submitted yet are not counted.",
            registry=r,
        )
        self.arena_overflows = Counter(
            "attention_arena_overflows",
            "Calls (each step of a step stream) whose tensors did not fit their front end's "
            "free arena space and went "
            "through a one-off segment (page faults, pageable copies in the engine): many "
            "mean --arena-bytes is small for the load.",
            registry=r,
        )
        self._live: LiveCollector | None = None
        self._http: WSGIServer | None = None
        self._http_thread: threading.Thread | None = None
        # Pre-create label sets so dashboards see zeros before the first call.
        for rpc in COMPUTE_RPCS:
            for m in (self.input_bytes, self.output_bytes, self.tokens, self.flops, self.batches,
                      self.kernel_seconds, self.kernel_flops, self.kernel_kv_bytes):
                m.labels(rpc=rpc)
            for direction in ("in", "out"):
                self.region_bytes.labels(rpc=rpc, direction=direction)
            self.requests.labels(rpc=rpc, code="OK")

    def bind(self, live: LiveCollector) -> None:
        """Attach the scrape-time values (the serving process only)."""
        self._live = live
        if self.registry is not None:
            self.registry.register(live)

    def observe_request(
        self, rpc: str, code: str, seconds: float, *, bytes_in: int = 0, bytes_out: int = 0,
        region_in: int = 0, region_out: int = 0, tokens: int = 0, flops: int = 0,
        queue_seconds: float | None = None, engine_seconds: float | None = None,
    ) -> None:
        children = self._request_children.get((rpc, code))
        if children is None:
            # The labelled series of one (rpc, code), looked up once: ``labels()`` validates
            # and locks on every call, eight times per compute call here.
            compute = rpc in COMPUTE_RPCS
            children = self._request_children[(rpc, code)] = (
                self._series(self.requests.labels(rpc=rpc, code=code)),
                self._series(self.duration.labels(rpc=rpc, code=code)),
                tuple(map(self._series, (
                    self.input_bytes.labels(rpc=rpc), self.output_bytes.labels(rpc=rpc),
                    self.region_bytes.labels(rpc=rpc, direction="in"),
                    self.region_bytes.labels(rpc=rpc, direction="out"),
                    self.tokens.labels(rpc=rpc), self.flops.labels(rpc=rpc)))
                ) if compute else None,
            )
        waits = None
        if queue_seconds is not None or engine_seconds is not None:
            waits = self._wait_children.get(rpc)
            if waits is None:
                waits = self._wait_children[rpc] = (
                    self._series(self.queue_wait.labels(rpc=rpc)),
                    self._series(self.engine_time.labels(rpc=rpc)))
        requests, duration, compute_children = children
        with self._hold:
            requests.inc()
            duration.observe(seconds)
            if compute_children is not None:
                c_in, c_out, c_region_in, c_region_out, c_tokens, c_flops = compute_children
                c_in.inc(bytes_in)
                c_out.inc(bytes_out)
                if region_in:
                    c_region_in.inc(region_in)
                if region_out:
                    c_region_out.inc(region_out)
                if code == "OK":
                    c_tokens.inc(tokens)
                    c_flops.inc(flops)
            if waits is not None:
                if queue_seconds is not None:
                    waits[0].observe(queue_seconds)
                if engine_seconds is not None:
                    waits[1].observe(engine_seconds)

    def _series(self, child: Any) -> Any:
        """``child`` itself, or with ``held``, its stand-in (kept for ``flush``)."""
        if self._held is None:
            return child
        held = (_HeldHistogram if hasattr(child, "_upper_bounds") else _HeldCounter)(child)
        self._held.append(held)
        return held

    def _registry(self, **kwargs: Any) -> CollectorRegistry:
        """A registry to serve from: one that flushes first on each read when ``held``."""
        if self._held is None:
            return CollectorRegistry(**kwargs)
        return _FlushingRegistry(self.flush, **kwargs)

    def flush(self) -> None:
        """Write what ``held`` series hold to their values (every read of the registry
        calls this first). A series that fails is logged, the rest still written."""
        if self._held is not None:
            with self._hold:
                for held in self._held:
                    try:
                        held.flush()
                    except Exception:
                        log.exception("a held metric could not be written")

    def observe_nixl(self, direction: str, nbytes: int, seconds: float) -> None:
        """One NIXL transfer of ``nbytes``, ``direction`` "in" or "out" (engine process)."""
        moved, took = self._nixl_children[direction]
        moved.inc(nbytes)
        took.observe(seconds)

    def observe_launch(
        self, op: Op, *, requests: int, tokens: int, flops: int, kv_bytes: int,
        h2d: float, kernel: float, d2h: float, issue: float | None = None,
    ) -> None:
        children = self._launch_children.get(op)
        if children is None:
            # The labelled series of one op, looked up once: ``labels()`` validates and locks
            # on every call, ten times per launch here.
            rpc = op.rpc
            rate = self.decode_bytes_rate if op.decode_like else self.prefill_flops_rate
            # AppendKV stores only: no rate series (an empty one reads as NaN on the dashboard).
            rate_child = rate.labels(rpc=rpc) if op.queries else None
            children = self._launch_children[op] = (
                *map(self._series, (self.batches.labels(rpc=rpc),
                                    self.batch_requests.labels(rpc=rpc),
                                    self.batch_tokens.labels(rpc=rpc))),
                tuple(self._series(self.stage.labels(rpc=rpc, stage=stage))
                      for stage in STAGES),
                *map(self._series, (self.kernel_seconds.labels(rpc=rpc),
                                    self.kernel_flops.labels(rpc=rpc),
                                    self.kernel_kv_bytes.labels(rpc=rpc))),
                None if rate_child is None else self._series(rate_child),
                self._series(self.launch_issue.labels(rpc=rpc)),
            )
        (batches, batch_requests, batch_tokens, stages, k_seconds, k_flops, k_bytes, rate,
         issued) = children
        with self._hold:
            batches.inc()
            if issue is not None:
                issued.observe(issue)
            batch_requests.observe(requests)
            batch_tokens.observe(tokens)
            for child, seconds in zip(stages, (h2d, kernel, d2h), strict=True):
                child.observe(seconds)
            if kernel <= 0:
                return  # nothing ran (no keys to attend to): no time, no work
            # Work and time together, so their rates divide into a kernel-time-weighted rate.
            k_seconds.inc(kernel)
            k_flops.inc(flops)
            k_bytes.inc(kv_bytes)
            if rate is not None:  # AppendKV stores only: no attention to rate
                rate.observe((kv_bytes if op.decode_like else flops) / kernel)

    def exposition_registry(self) -> CollectorRegistry:
        """What /metrics serves: this server's registry, or every process's samples merged
        (with this process's standard process_*/python_* series)."""
        if self.registry is not None:
            return self.registry
        from prometheus_client import multiprocess

        registry = self._registry()
        multiprocess.MultiProcessCollector(registry)
        _standard_collectors(registry)
        if self._live is not None:
            registry.register(self._live)
        return registry

    def serve(self, host: str, port: int) -> int | None:
        """Start /metrics on ``port`` (0 = ephemeral, -1 = off); returns the bound port."""
        if port < 0:
            return None
        try:
            self._http, self._http_thread = start_http_server(
                port, addr=host, registry=self.exposition_registry()
            )
        except OSError as exc:  # in use, or not an address of this host
            raise StartupError(f"could not serve /metrics on {host}:{port} (--metrics-host, "
                               f"--metrics-port): {exc}") from None
        return int(self._http.server_port)

    def close(self) -> None:
        self.flush()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
