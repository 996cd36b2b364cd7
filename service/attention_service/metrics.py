"""Prometheus metrics, exactly the names in docs/CONTRACTS.md.

Two modes, one set of names:

* single process: each server owns a CollectorRegistry (so several servers can live in one
  process, as in tests) and serves it;
* process group (``--frontends N``): prometheus_client's multiprocess mode. Every process
  (front ends count calls, the engine counts launches) writes its samples to files in
  ``PROMETHEUS_MULTIPROC_DIR``; the engine serves one ``/metrics`` that merges them
  (``MultiProcessCollector``), so counters of a front end that died and was restarted are
  kept, and live gauges of dead processes are dropped (``mark_process_dead``).

Values read at scrape time (queue depth, GPU memory, device info, live front ends) come from a
collector in the serving process. Histograms (not summaries) so quantiles aggregate across
replicas.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from attention_service.link import EngineInfo
from attention_service.params import Op

COMPUTE_RPCS = tuple(op.rpc for op in Op)
STAGES = ("h2d", "kernel", "d2h")

_DURATION = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_WAIT = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_STAGE = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
          0.25, 0.5, 1, 2.5, 5, 10)
_BATCH_REQUESTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_BATCH_TOKENS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
# cpu reference launches land in the low buckets, H100/H200 launches in the high ones.
_TFLOPS = (0.01, 0.1, 1, 5, 10, 25, 50, 100, 150, 200, 300, 400, 500, 700, 1000)
_GBPS = (0.1, 1, 10, 50, 100, 250, 500, 1000, 1500, 2000, 2500, 3000, 3500, 4000, 5000)


class LiveCollector(Collector):
    """Values read when scraped, from the process that owns them (the engine's)."""

    def __init__(
        self, info: EngineInfo, versions: dict[str, str], queue_depth: Callable[[Op], int],
        memory: Callable[[], tuple[int, int]], frontends: Callable[[], int],
        kv_caches: Callable[[], tuple[int, int, int, int]] = lambda: (0, 0, 0, 0),
    ) -> None:
        """``kv_caches``: (pages used, pages total, caches live, caches expired so far)."""
        self._info = info
        self._versions = versions
        self._queue_depth = queue_depth
        self._memory = memory
        self._frontends = frontends
        self._kv_caches = kv_caches

    def describe(self) -> list[Metric]:
        return []  # nothing to check for clashes at registration; collect() says it all

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "attention_queue_depth", "Requests waiting for a launch.", labels=["rpc"]
        )
        for op in Op:
            depth.add_metric([op.rpc], self._queue_depth(op))
        yield depth
        allocated, reserved = self._memory()
        yield GaugeMetricFamily("attention_gpu_memory_allocated_bytes",
                                "torch.cuda.memory_allocated (0 on cpu).", value=allocated)
        yield GaugeMetricFamily("attention_gpu_memory_reserved_bytes",
                                "torch.cuda.memory_reserved (0 on cpu).", value=reserved)
        yield GaugeMetricFamily("attention_frontends",
                                "gRPC front-end processes alive (1 in a single process).",
                                value=self._frontends())
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
        # Exposed as attention_device_info{...} 1.
        yield InfoMetricFamily(
            "attention_device", "Device and versions.",
            value={"device": self._info.device, "backend": self._info.backend, **self._versions},
        )


class Metrics:
    def __init__(self, multiprocess: bool = False) -> None:
        self.multiprocess = multiprocess
        # Multiprocess samples go to PROMETHEUS_MULTIPROC_DIR, not to a registry.
        r = None if multiprocess else CollectorRegistry(auto_describe=True)
        self.registry = r
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
            "attention_flops", "Floating-point operations served.", ["rpc"], registry=r
        )
        self.prefill_tflops = Histogram(
            "attention_prefill_kernel_tflops", "Prefill kernel TFLOP/s per launch.",
            buckets=_TFLOPS, registry=r,
        )
        self.decode_gbps = Histogram(
            "attention_decode_kernel_gbps", "Decode kernel GB/s (K+V bytes) per launch.",
            buckets=_GBPS, registry=r,
        )
        self.prefill_tflops_recent = Gauge(
            "attention_prefill_kernel_tflops_recent", "Prefill TFLOP/s of the last launch.",
            registry=r, multiprocess_mode="livemostrecent",
        )
        self.decode_gbps_recent = Gauge(
            "attention_decode_kernel_gbps_recent", "Decode GB/s of the last launch.",
            registry=r, multiprocess_mode="livemostrecent",
        )
        self.inflight = Gauge(
            "attention_inflight_requests", "Prefill/Decode calls in progress.", registry=r,
            multiprocess_mode="livesum",
        )
        self.frontend_restarts = Counter(
            "attention_frontend_restarts", "Front-end processes restarted after they died.",
            registry=r,
        )
        self._live: LiveCollector | None = None
        self._http: WSGIServer | None = None
        self._http_thread: threading.Thread | None = None
        # Pre-create label sets so dashboards see zeros before the first call.
        for rpc in COMPUTE_RPCS:
            for m in (self.input_bytes, self.output_bytes, self.tokens, self.flops, self.batches):
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
        queue_seconds: float | None = None,
    ) -> None:
        self.requests.labels(rpc=rpc, code=code).inc()
        self.duration.labels(rpc=rpc, code=code).observe(seconds)
        if rpc not in COMPUTE_RPCS:
            return
        self.input_bytes.labels(rpc=rpc).inc(bytes_in)
        self.output_bytes.labels(rpc=rpc).inc(bytes_out)
        if region_in:
            self.region_bytes.labels(rpc=rpc, direction="in").inc(region_in)
        if region_out:
            self.region_bytes.labels(rpc=rpc, direction="out").inc(region_out)
        if code == "OK":
            self.tokens.labels(rpc=rpc).inc(tokens)
            self.flops.labels(rpc=rpc).inc(flops)
        if queue_seconds is not None:
            self.queue_wait.labels(rpc=rpc).observe(queue_seconds)

    def observe_launch(
        self, op: Op, *, requests: int, tokens: int, flops: int, kv_bytes: int,
        h2d: float, kernel: float, d2h: float,
    ) -> None:
        rpc = op.rpc
        self.batches.labels(rpc=rpc).inc()
        self.batch_requests.labels(rpc=rpc).observe(requests)
        self.batch_tokens.labels(rpc=rpc).observe(tokens)
        for stage, seconds in zip(STAGES, (h2d, kernel, d2h), strict=True):
            self.stage.labels(rpc=rpc, stage=stage).observe(seconds)
        if kernel <= 0:
            return
        if op is Op.APPEND_KV:
            return  # stores only: no attention to rate
        if not op.decode_like:
            tflops = flops / kernel / 1e12
            self.prefill_tflops.observe(tflops)
            self.prefill_tflops_recent.set(tflops)
        else:
            gbps = kv_bytes / kernel / 1e9
            self.decode_gbps.observe(gbps)
            self.decode_gbps_recent.set(gbps)

    def exposition_registry(self) -> CollectorRegistry:
        """What /metrics serves: this server's registry, or every process's samples merged."""
        if self.registry is not None:
            return self.registry
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        if self._live is not None:
            registry.register(self._live)
        return registry

    def serve(self, host: str, port: int) -> int | None:
        """Start /metrics on ``port`` (0 = ephemeral, -1 = off); returns the bound port."""
        if port < 0:
            return None
        self._http, self._http_thread = start_http_server(
            port, addr=host, registry=self.exposition_registry()
        )
        return int(self._http.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
