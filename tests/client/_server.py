"""Run the real server (``python -m attention_service``) as a subprocess on a free port."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import pytest

_PORT_LINE = re.compile(r"listening on port (\d+)")


def require_server() -> None:
    """Skip when the service package is not installed (e.g. a client-only checkout)."""
    if importlib.util.find_spec("attention_service") is None or (
        importlib.util.find_spec("attention_service.server") is None
    ):
        pytest.skip("attention_service is not installed")


@dataclass
class RunningServer:
    proc: subprocess.Popen
    port: int
    lines: list[str] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return "".join(self.lines[-60:])

    def metrics_port(self) -> int:
        """The metrics port the server logged (started with ``--metrics-port 0``)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(r"metrics on port (\d+)", line):
                    return int(m.group(1))
            time.sleep(0.05)
        raise AssertionError("no 'metrics on port' line:\n" + self.log())

    def metrics(self) -> str:
        """Its /metrics page, as text."""
        url = f"http://127.0.0.1:{self.metrics_port()}/metrics"
        return urllib.request.urlopen(url, timeout=10).read().decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(*extra: str, startup_timeout: float = 120.0) -> RunningServer:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTENTION_")}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [
        sys.executable, "-m", "attention_service", "--host", "127.0.0.1", "--port", "0",
        "--device", "cpu", "--metrics-port", "-1", "--no-warmup", "--grace-seconds", "1",
        *extra,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        stdin=subprocess.DEVNULL,
    )
    lines: list[str] = []
    found: list[int] = []
    ready = threading.Event()

    def drain() -> None:  # keep reading so the server never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = _PORT_LINE.search(line)
            if m and not found:
                found.append(int(m.group(1)))
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    ready.wait(startup_timeout)
    if not found:
        proc.kill()
        proc.wait()
        raise RuntimeError(
            f"server did not print 'listening on port N' ({' '.join(cmd)}):\n" + "".join(lines)
        )
    return RunningServer(proc, found[0], lines)
