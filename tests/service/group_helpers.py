"""The process group (``attention-server --frontends N``) as the tests drive it: a real server
process, its front ends' pids from its log, and which front end serves which connection (read
from /proc: the kernel, not the server, says where SO_REUSEPORT put a connection)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]


class Group:
    """``python -m attention_service`` with ``--frontends n``; its log is kept in memory."""

    def __init__(self, n: int = 2, *args: str, env: dict[str, str] | None = None,
                 timeout: float = 60.0, device: str = "cpu") -> None:
        cmd = [sys.executable, "-m", "attention_service", "--frontends", str(n), "--device",
               device, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self._eof = False
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.port = int(self.wait_for(r"listening on port (\d+) ", timeout).group(1))
        self.metrics_port = int(self.wait_for(r"metrics on port (\d+)", timeout).group(1))
        self.wait_until_serving(timeout)
        self.channels: list[grpc.Channel] = []

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 30.0, start: int = 0) -> re.Match[str]:
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[start:]:
                    m = rx.search(line)
                    if m:
                        return m
                left = end - time.monotonic()
                if left <= 0 or self._eof:
                    raise AssertionError(
                        f"no log line matching {pattern!r}:\n" + "\n".join(self.lines)
                    )
                self._cond.wait(min(left, 0.2))

    def log(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def frontend_pids(self) -> dict[int, int]:
        """Slot -> pid of its latest incarnation."""
        pids: dict[int, int] = {}
        with self._cond:
            for line in self.lines:
                m = re.search(r"front end (\d+) listening \(pid (\d+)\)", line)
                if m:
                    pids[int(m.group(1))] = int(m.group(2))
        return pids

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self) -> grpc.Channel:
        """A channel with a connection of its own (not shared with other channels)."""
        ch = grpc.insecure_channel(self.target, options=[("grpc.use_local_subchannel_pool", 1)])
        self.channels.append(ch)
        return ch

    def stub(self) -> Any:
        from attention_wire.pb import attention_pb2_grpc as pb_grpc

        return pb_grpc.AttentionServiceStub(self.channel())

    def wait_until_serving(self, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if serving(self.target):
                return
            time.sleep(0.1)
        raise AssertionError("group never SERVING:\n" + self.log())

    def scrape(self) -> dict[str, Any]:
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        for ch in self.channels:
            ch.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def serving(target: str) -> bool:
    """Whether the server at ``target`` answers its health check SERVING now."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


def scrape(url: str) -> dict[str, Any]:
    """The metric families a Prometheus endpoint serves, by name."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _tcp_table() -> Iterator[tuple[int, int, int, int]]:
    """(local port, remote port, state, inode) of every TCP socket in this network namespace."""
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for row in f:
                    cols = row.split()
                    local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
                    yield (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16),
                           int(state, 16), int(inode))
        except FileNotFoundError:
            continue


ESTABLISHED = 1


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def client_ports(server_port: int) -> set[int]:
    """Local ports of every established connection to ``server_port`` (client sides)."""
    return {lp for lp, rp, st, _ in _tcp_table() if rp == server_port and st == ESTABLISHED}


def serving_pid(server_port: int, client_port: int, pids: list[int]) -> int | None:
    """Which of ``pids`` holds the server side of the connection from ``client_port``."""
    inodes = {ino for lp, rp, st, ino in _tcp_table()
              if lp == server_port and rp == client_port and st == ESTABLISHED}
    for pid in pids:
        if inodes & socket_inodes(pid):
            return pid
    return None


def connect_to(group: Group, pid: int, tries: int = 40, metadata: Any = None) -> grpc.Channel:
    """A new channel whose connection the kernel gave to front end ``pid`` (``metadata``: the
    token, on a group with auth on)."""
    from attention_wire.pb import attention_pb2 as pb
    from attention_wire.pb import attention_pb2_grpc as pb_grpc

    pids = list(group.frontend_pids().values())
    for _ in range(tries):
        before = client_ports(group.port)
        ch = grpc.insecure_channel(group.target,
                                   options=[("grpc.use_local_subchannel_pool", 1)])
        pb_grpc.AttentionServiceStub(ch).GetServerInfo(pb.GetServerInfoRequest(), timeout=10,
                                                       metadata=metadata)
        new = client_ports(group.port) - before
        if len(new) == 1 and serving_pid(group.port, new.pop(), pids) == pid:
            group.channels.append(ch)
            return ch
        ch.close()
    raise AssertionError(f"no connection landed on front end pid {pid} in {tries} tries")
