"""One gRPC front end: servicer, health, reflection, auth, TLS, draining. Engine-agnostic: it
talks to whatever ``EngineLink`` it is given (same process, or the engine process)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

import attention_service
from attention_service.config import MAX_MESSAGE_BYTES, ServerConfig
from attention_service.errors import StartupError
from attention_service.frontend.auth import BearerTokenInterceptor, Principals
from attention_service.frontend.servicer import (
    SERVICE_NAME,
    STEPS_IN_FLIGHT,
    AttentionServicer,
    CallTracker,
    add_to_server,
)
from attention_service.frontend.stock_services import add_stock_services
from attention_service.frontend.validation import supported_head_dim
from attention_service.heap import freeze_startup_heap
from attention_service.link import EngineInfo, EngineLink
from attention_service.metrics import Metrics
from attention_service.params import ELEMENT_BYTES
from attention_wire.pb import attention_pb2 as pb

log = logging.getLogger("attention_service")

HTTP2_MAX_FRAME = (1 << 24) - 1  # the HTTP/2 maximum
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
HEAD_DIMS = [d for d in range(1, 257) if supported_head_dim(d)]


def server_info(config: ServerConfig, info: EngineInfo, frontend: int = 0) -> pb.ServerInfo:
    return pb.ServerInfo(
        device=info.device, backend=info.backend, dtypes=list(ELEMENT_BYTES),
        head_dims=HEAD_DIMS, max_request_bytes=config.max_request_bytes,
        chunk_bytes=config.chunk_bytes, max_message_bytes=MAX_MESSAGE_BYTES,
        server_version=attention_service.__version__, torch_version=info.torch_version,
        triton_version=info.triton_version, cuda_version=info.cuda_version,
        batching=info.batching, regions=info.regions, frontends=info.frontends,
        kv_cache_bytes=info.kv_cache_bytes, kv_page_bytes=info.kv_page_bytes,
        max_regions_per_caller=config.max_regions_per_caller,
        system_region_bytes_per_caller=config.system_region_bytes_per_caller,
        gpu_region_bytes_per_caller=config.gpu_region_bytes_per_caller,
        frontend=frontend, nixl=info.nixl, nixl_backend=info.nixl_backend,
        steps_in_flight=STEPS_IN_FLIGHT, step_socket=config.step_socket,
        instance_id=info.instance,
    )


def address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"{host}:{port}"


class FrontEnd:
    """A started gRPC server: ``port``, ``set_serving``, ``stop`` (drain)."""

    def __init__(
        self, *, config: ServerConfig, grpc_server: grpc.aio.Server,
        health_servicer: health.aio.HealthServicer, servicer: AttentionServicer, port: int,
    ) -> None:
        self.config = config
        self.grpc_server = grpc_server
        self.health = health_servicer
        self.servicer = servicer
        self.port = port
        self._stop_task: asyncio.Task[None] | None = None

    @property
    def tracker(self) -> CallTracker:
        return self.servicer.tracker

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def set_serving(self) -> None:
        """Accept compute calls and answer health SERVING (once the engine is warm)."""
        freeze_startup_heap()  # this process's start-up objects (the engine's too, in-process)
        self.tracker.accepting = True
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float | None = None) -> None:
        """Drain: health NOT_SERVING, refuse new calls, let in-flight calls finish within
        ``grace`` seconds (None = 0), then cancel what is left."""
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._drain(grace or 0.0))
        await asyncio.shield(self._stop_task)

    async def cut(self) -> None:
        """A second signal during the drain: cancel the calls in flight now. They count as
        UNAVAILABLE, as their clients see them (as calls the grace period's end cuts)."""
        if self.tracker.inflight:
            self.tracker.cutting = True
        await self.grpc_server.stop(0)

    async def _drain(self, grace: float) -> None:
        t0 = time.monotonic()
        await self.health.enter_graceful_shutdown()
        tracker = self.tracker
        tracker.accepting = False
        tracker.refusal = "server is shutting down"
        drained = await tracker.wait_idle(grace)
        if not drained:
            log.warning("grace period over with %d call(s) in flight: cancelling them",
                        tracker.inflight)
            tracker.cutting = True  # they count as UNAVAILABLE, as their clients see them
        # A short grace lets just-finished calls flush their status; health watchers and
        # anything left are cancelled after it.
        left = max(0.0, grace - (time.monotonic() - t0))
        await self.grpc_server.stop(min(left, 1.0) if drained else 0)


def _bind(grpc_server: Any, where: str, creds: Any, names: str) -> int:
    """Listen on ``where`` (TLS with ``creds``); a port that cannot be bound fails startup
    naming the flags (``names``)."""
    try:
        port = (grpc_server.add_secure_port(where, creds) if creds is not None
                else grpc_server.add_insecure_port(where))
    except RuntimeError as exc:  # grpc's "Failed to bind"
        raise StartupError(f"could not bind {where} ({names}): {exc}") from None
    if not port:
        raise StartupError(f"could not bind {where} ({names})")
    return int(port)


async def start_frontend(
    config: ServerConfig, link: EngineLink, metrics: Metrics, *, reuse_port: bool = False,
    slot: int = 0,
) -> FrontEnd:
    """Build, bind and start a front end (health NOT_SERVING, compute calls UNAVAILABLE
    until ``set_serving``). ``reuse_port``: share the port with sibling front-end processes
    (``SO_REUSEPORT``); otherwise a taken port fails loudly. ``slot``: this front end's
    number in the group (GetServerInfo's ``frontend``)."""
    principals = Principals(config.tokens)
    servicer = AttentionServicer(
        config=config, link=link, metrics=metrics, info=server_info(config, link.info, slot),
        tracker=CallTracker(), principals=principals,
    )
    interceptors = [BearerTokenInterceptor(principals, metrics)] if principals.enabled else []
    grpc_server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            # Default-sized messages on both sides: streams carry any request size.
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 1 if reuse_port else 0),
            # Let peers send 1 MiB messages in one HTTP/2 frame instead of 64 of 16 KiB: raw
            # gRPC of 96 MiB up / 32 down went 1.43 -> 1.66 GB/s (tools/tuning/tune_transfer.py).
            ("grpc.http2.max_frame_size", HTTP2_MAX_FRAME),
        ],
    )
    add_to_server(servicer, grpc_server)  # raw bytes on the compute rpcs (see servicer.py)
    health_servicer = add_stock_services(
        grpc_server, (SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME)
    )
    where = address(config.host, config.port)
    try:
        creds = None
        if config.tls_cert and config.tls_key:
            client_ca = (Path(config.tls_client_ca).read_bytes() if config.tls_client_ca
                         else None)
            creds = grpc.ssl_server_credentials(
                [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())],
                root_certificates=client_ca, require_client_auth=client_ca is not None,
            )
    except OSError as exc:
        raise StartupError(f"TLS files (--tls-cert, --tls-key, --tls-client-ca): {exc}") from None
    port = _bind(grpc_server, where, creds, "--host, --port")
    if config.frontend_ports:  # this front end's own port, for a balancing proxy
        _bind(grpc_server, address(config.host, config.frontend_ports + slot), creds,
              f"--frontend-ports: front end {slot}'s")
    frontend = FrontEnd(
        config=config, grpc_server=grpc_server, health_servicer=health_servicer,
        servicer=servicer, port=port,
    )
    await frontend._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    await grpc_server.start()
    return frontend
