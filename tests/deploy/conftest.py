"""Fixture of the deployment tests: the real server, started like the container starts it.

One server process per session (cpu backend, ports picked here), shared by the metrics and
load tests: the same entry point as the image (`python -m attention_service`, configured by
ATTENTION_* variables like docker-compose.yml does), so what passes here is what ships.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ._helpers import REPO, free_ports

START_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Server:
    target: str  # host:port of gRPC
    metrics_url: str
    log: Path


def _serving(target: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_ports(2)  # two free ports in a row: distinct
    metrics_port = port + 1
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTENTION_")}
    env.update(
        ATTENTION_HOST="127.0.0.1",
        ATTENTION_PORT=str(port),
        ATTENTION_METRICS_PORT=str(metrics_port),
        ATTENTION_DEVICE="cpu",
        ATTENTION_GRACE_SECONDS="5",
        PYTHONUNBUFFERED="1",
    )
    target = f"127.0.0.1:{port}"
    with open(log, "wb") as out:
        # A file, not a pipe: a chatty server must never block on a full pipe.
        proc = subprocess.Popen(
            [sys.executable, "-m", "attention_service"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _serving(target):
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"server not SERVING after {START_TIMEOUT_S}s:\n{log.read_text()}")
            time.sleep(0.5)
        yield Server(target, f"http://127.0.0.1:{metrics_port}/metrics", log)
    finally:
        proc.send_signal(signal.SIGTERM)  # graceful stop, as `docker stop` does
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
