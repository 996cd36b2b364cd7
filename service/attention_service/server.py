"""Server assembly: servicer, health, reflection, auth, TLS, metrics, warm-up and draining."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from pathlib import Path

import grpc
import torch
from attention_client.pb import attention_pb2 as pb
from attention_kernels._checks import supported_head_dim
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

import attention_service
from attention_service.auth import BearerTokenInterceptor
from attention_service.backends import Backend, make_backend
from attention_service.codec import PB_DTYPES
from attention_service.config import MAX_MESSAGE_BYTES, ServerConfig
from attention_service.execution import Executor, make_executor
from attention_service.metrics import Metrics
from attention_service.servicer import AttentionServicer, CallTracker
from attention_service.wire import SERVICE_NAME, add_to_server

log = logging.getLogger("attention_service")

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
HEAD_DIMS = [d for d in range(1, 257) if supported_head_dim(d)]


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def versions() -> dict[str, str]:
    return {
        "server_version": attention_service.__version__,
        "torch_version": torch.__version__,
        "triton_version": _dist_version("triton"),
    }


def server_info(config: ServerConfig, backend: Backend, executor: Executor) -> pb.ServerInfo:
    v = versions()
    return pb.ServerInfo(
        device=backend.device_name, backend=backend.name, dtypes=list(PB_DTYPES.values()),
        head_dims=HEAD_DIMS, max_request_bytes=config.max_request_bytes,
        chunk_bytes=config.chunk_bytes, max_message_bytes=MAX_MESSAGE_BYTES,
        server_version=v["server_version"], torch_version=v["torch_version"],
        triton_version=v["triton_version"],
        cuda_version=(torch.version.cuda or "") if backend.name == "cuda" else "",
        batching=executor.batching,
    )


def _address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"{host}:{port}"


class AttentionServer:
    """A running server: ``port``, ``metrics_port`` (None when off), ``stop``, ``wait``."""

    def __init__(
        self, *, config: ServerConfig, grpc_server: grpc.aio.Server,
        health_servicer: health.aio.HealthServicer, servicer: AttentionServicer,
        executor: Executor, metrics: Metrics, backend: Backend, port: int,
    ) -> None:
        self.config = config
        self.grpc_server = grpc_server
        self.health = health_servicer
        self.servicer = servicer
        self.executor = executor
        self.metrics = metrics
        self.backend = backend
        self.port = port
        self.metrics_port: int | None = None
        self._stop_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """No-op: create_server returns a started server (kept for grpc.aio.Server parity)."""

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace: float | None = None) -> None:
        """Drain: health NOT_SERVING, refuse new calls, let in-flight calls finish within
        ``grace`` seconds (None = 0), then cancel what is left and release resources."""
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._drain(grace or 0.0))
        await asyncio.shield(self._stop_task)

    async def _drain(self, grace: float) -> None:
        t0 = time.monotonic()
        await self.health.enter_graceful_shutdown()
        tracker = self.servicer.tracker
        tracker.accepting = False
        tracker.refusal = "server is shutting down"
        drained = await tracker.wait_idle(grace)
        if not drained:
            log.warning("grace period over with %d call(s) in flight: cancelling them",
                        tracker.inflight)
        # A short grace lets just-finished calls flush their status; health watchers and
        # anything left are cancelled after it.
        left = max(0.0, grace - (time.monotonic() - t0))
        await self.grpc_server.stop(min(left, 1.0) if drained else 0)
        await self.executor.close()
        self.metrics.close()

    async def wait_for_termination(self) -> None:
        await self.grpc_server.wait_for_termination()


async def create_server(
    config: ServerConfig, *, backend: Backend | None = None
) -> tuple[AttentionServer, int]:
    """Build, bind, warm up and start a server; returns it once SERVING, with its gRPC port.

    ``config.port == 0`` binds an ephemeral port; ``server.metrics_port`` is the bound metrics
    port. ``backend`` overrides the one ``config.device`` selects (tests inject fakes).
    """
    backend = backend or make_backend(config.device)
    metrics = Metrics()
    executor = make_executor(config, backend, metrics)
    metrics.bind(
        device=backend.device_name, backend=backend.name, versions=versions(),
        queue_depth=executor.queue_depth, memory=backend.memory,
    )
    tracker = CallTracker()
    servicer = AttentionServicer(
        config=config, executor=executor, alloc=backend.alloc_host, metrics=metrics,
        info=server_info(config, backend, executor), tracker=tracker,
    )
    interceptors = [BearerTokenInterceptor(config.auth_token, metrics)] if config.auth_token else []
    grpc_server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            # Default-sized messages on both sides: streams carry any request size.
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # Fail loudly if the port is taken instead of sharing it.
            ("grpc.so_reuseport", 0),
        ],
    )
    add_to_server(servicer, grpc_server)  # raw bytes on the compute rpcs (see wire.py)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), grpc_server
    )
    address = _address(config.host, config.port)
    if config.tls_cert and config.tls_key:
        creds = grpc.ssl_server_credentials(
            [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())]
        )
        port = grpc_server.add_secure_port(address, creds)
    else:
        port = grpc_server.add_insecure_port(address)
    if not port:
        raise RuntimeError(f"could not bind {address}")
    server = AttentionServer(
        config=config, grpc_server=grpc_server, health_servicer=health_servicer,
        servicer=servicer, executor=executor, metrics=metrics, backend=backend, port=port,
    )
    # Health answers NOT_SERVING while the kernels compile; compute calls get UNAVAILABLE.
    await server._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    await grpc_server.start()
    try:
        server.metrics_port = metrics.serve(config.host, config.metrics_port)
        if config.warmup:
            t0 = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(None, backend.warmup)
            log.info("warm-up on %s took %.2fs", backend.name, time.perf_counter() - t0)
    except BaseException:
        await grpc_server.stop(0)
        metrics.close()
        await executor.close()
        raise
    tracker.accepting = True
    await server._set_health(health_pb2.HealthCheckResponse.SERVING)
    return server, port
