"""Prometheus metrics, exactly the names in docs/CONTRACTS.md.

Each server owns a CollectorRegistry, so several servers can live in one process (tests).
Histograms (not summaries) so quantiles aggregate across replicas.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    start_http_server,
)

RPCS = ("Prefill", "Decode", "GetServerInfo")
COMPUTE_RPCS = ("Prefill", "Decode")
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


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
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
        self.batches = Counter(
            "attention_batches", "Kernel launches.", ["rpc"], registry=r
        )
        self.input_bytes = Counter(
            "attention_input_bytes", "Tensor bytes received.", ["rpc"], registry=r
        )
        self.output_bytes = Counter(
            "attention_output_bytes", "Tensor bytes sent.", ["rpc"], registry=r
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
            registry=r,
        )
        self.decode_gbps_recent = Gauge(
            "attention_decode_kernel_gbps_recent", "Decode GB/s of the last launch.", registry=r
        )
        self.inflight = Gauge(
            "attention_inflight_requests", "Prefill/Decode calls in progress.", registry=r
        )
        self.queue_depth = Gauge(
            "attention_queue_depth", "Requests waiting for a launch.", ["rpc"], registry=r
        )
        self.gpu_allocated = Gauge(
            "attention_gpu_memory_allocated_bytes", "torch.cuda.memory_allocated (0 on cpu).",
            registry=r,
        )
        self.gpu_reserved = Gauge(
            "attention_gpu_memory_reserved_bytes", "torch.cuda.memory_reserved (0 on cpu).",
            registry=r,
        )
        # Exposed as attention_device_info{...} 1 (prometheus_client adds the _info suffix).
        self.device_info = Info("attention_device", "Device and versions.", registry=r)
        self._http: WSGIServer | None = None
        self._http_thread: threading.Thread | None = None
        # Pre-create label sets so dashboards see zeros before the first call.
        for rpc in COMPUTE_RPCS:
            for m in (self.input_bytes, self.output_bytes, self.tokens, self.flops, self.batches):
                m.labels(rpc=rpc)
            self.requests.labels(rpc=rpc, code="OK")

    def bind(
        self, *, device: str, backend: str, versions: dict[str, str],
        queue_depth: Callable[[str], int], memory: Callable[[], tuple[int, int]],
    ) -> None:
        """Attach the live sources read at scrape time."""
        self.device_info.info({"device": device, "backend": backend, **versions})
        for rpc in COMPUTE_RPCS:
            self.queue_depth.labels(rpc=rpc).set_function(lambda rpc=rpc: queue_depth(rpc))
        self.gpu_allocated.set_function(lambda: memory()[0])
        self.gpu_reserved.set_function(lambda: memory()[1])

    def observe_request(
        self, rpc: str, code: str, seconds: float, *, bytes_in: int = 0, bytes_out: int = 0,
        tokens: int = 0, flops: int = 0, queue_seconds: float | None = None,
    ) -> None:
        self.requests.labels(rpc=rpc, code=code).inc()
        self.duration.labels(rpc=rpc, code=code).observe(seconds)
        if rpc not in COMPUTE_RPCS:
            return
        self.input_bytes.labels(rpc=rpc).inc(bytes_in)
        self.output_bytes.labels(rpc=rpc).inc(bytes_out)
        if code == "OK":
            self.tokens.labels(rpc=rpc).inc(tokens)
            self.flops.labels(rpc=rpc).inc(flops)
        if queue_seconds is not None:
            self.queue_wait.labels(rpc=rpc).observe(queue_seconds)

    def observe_launch(
        self, rpc: str, *, requests: int, tokens: int, flops: int, kv_bytes: int,
        h2d: float, kernel: float, d2h: float,
    ) -> None:
        self.batches.labels(rpc=rpc).inc()
        self.batch_requests.labels(rpc=rpc).observe(requests)
        self.batch_tokens.labels(rpc=rpc).observe(tokens)
        for stage, seconds in zip(STAGES, (h2d, kernel, d2h), strict=True):
            self.stage.labels(rpc=rpc, stage=stage).observe(seconds)
        if kernel <= 0:
            return
        if rpc == "Prefill":
            tflops = flops / kernel / 1e12
            self.prefill_tflops.observe(tflops)
            self.prefill_tflops_recent.set(tflops)
        else:
            gbps = kv_bytes / kernel / 1e9
            self.decode_gbps.observe(gbps)
            self.decode_gbps_recent.set(gbps)

    def serve(self, host: str, port: int) -> int | None:
        """Start /metrics on ``port`` (0 = ephemeral, -1 = off); returns the bound port."""
        if port < 0:
            return None
        self._http, self._http_thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._http.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
