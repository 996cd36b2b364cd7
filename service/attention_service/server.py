"""The single-process model (``--frontends 1``): one gRPC front end and the engine in one
process, joined by a ``LocalLink``. ``create_server`` is also what tests use (port 0 works)."""

from __future__ import annotations

import asyncio
import logging
import time

import attention_service
from attention_service.config import ServerConfig
from attention_service.engine.backends import Backend, make_backend
from attention_service.engine.core import EngineCore
from attention_service.engine.local_link import LocalLink
from attention_service.frontend.server import FrontEnd, start_frontend
from attention_service.metrics import LiveCollector, Metrics
from attention_service.step_socket import StepSocket, start_step_socket

log = logging.getLogger("attention_service")


def versions(core: EngineCore) -> dict[str, str]:
    info = core.info
    return {
        "server_version": attention_service.__version__,
        "torch_version": info.torch_version,
        "triton_version": info.triton_version,
    }


def gpu_uuid(backend: Backend) -> str | None:
    """The UUID (bare hex) of the GPU a cuda backend runs on, for the metrics' NVML readings;
    None for any other backend (or a torch that does not say)."""
    if getattr(backend, "name", "") != "cuda":
        return None
    import torch

    try:
        return bytes(torch.cuda.get_device_properties(backend.device).uuid.bytes).hex()
    except Exception:  # no NVML gauges rather than no server
        return None


class AttentionServer:
    """A running server: ``port``, ``metrics_port`` (None when off), ``stop``."""

    def __init__(
        self, *, frontend: FrontEnd, core: EngineCore, metrics: Metrics, port: int
    ) -> None:
        self.frontend = frontend
        self.core = core
        self.backend = core.backend
        self.executor = core.executor
        self.metrics = metrics
        self.port = port
        self.metrics_port: int | None = None
        self.step_socket: StepSocket | None = None  # --step-socket
        self._stopped = False

    @property
    def servicer(self):  # type: ignore[no-untyped-def]
        return self.frontend.servicer

    @property
    def grpc_server(self):  # type: ignore[no-untyped-def]
        return self.frontend.grpc_server

    async def stop(self, grace: float | None = None) -> None:
        """Drain the front end (``grace`` seconds for in-flight calls), then stop the engine."""
        if self.step_socket is not None:
            self.step_socket.drain()
        await self.frontend.stop(grace)
        if not self._stopped:
            self._stopped = True
            await asyncio.to_thread(self.core.close)  # answers what the step_socket had started
            if self.step_socket is not None:
                self.step_socket.close()
            self.metrics.close()


async def create_server(
    config: ServerConfig, *, backend: Backend | None = None
) -> tuple[AttentionServer, int]:
    """Build, bind, warm up and start a single-process server; returns it once SERVING, with
    its gRPC port. ``config.port == 0`` binds an ephemeral port; ``server.metrics_port`` is the
    bound metrics port. ``backend`` overrides the one ``config.device`` selects (tests inject
    fakes)."""
    backend = backend or make_backend(config.device, config.cuda_graphs)
    metrics = Metrics(held=True)
    core = EngineCore(config, backend, observer=metrics, frontends=1)
    metrics.bind(LiveCollector(core.info, versions(core), core.queue_depth, backend.memory,
                               lambda: 1, core.caches.gauges, core.regions.gauges,
                               queue_capacity=config.max_queue_size, gpu_uuid=gpu_uuid(backend),
                               nixl_transports=core.regions.nixl.transports))
    # Listening before the front end can advertise it (GetServerInfo answers during warm-up).
    step_socket = start_step_socket(config, core, metrics) if config.step_socket else None
    try:
        frontend = await start_frontend(config, LocalLink(core), metrics)
    except BaseException:
        if step_socket is not None:
            step_socket.close()
        raise
    server = AttentionServer(frontend=frontend, core=core, metrics=metrics, port=frontend.port)
    server.step_socket = step_socket
    try:
        server.metrics_port = metrics.serve(config.metrics_host, config.metrics_port)
        if config.warmup:
            t0 = time.perf_counter()
            await asyncio.to_thread(core.warmup)
            log.info("warm-up on %s took %.2fs", backend.name, time.perf_counter() - t0)
    except BaseException:
        await server.stop(0)
        raise
    if step_socket is not None:
        step_socket.serve()
    await frontend.set_serving()
    return server, frontend.port
