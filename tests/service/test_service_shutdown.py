"""The real entry point: ``python -m attention_service``, SIGTERM with a call in flight."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from attention_wire.pb import attention_pb2_grpc as pb_grpc

from .svc_helpers import health_status, small_prefill, wait_until

pytestmark = pytest.mark.timeout(90)


class ServerProcess:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "attention_service", "--host", "127.0.0.1", "--port", "0",
             "--device", "cpu", "--no-batching", *args],
            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())

    def port(self, what: str, timeout: float = 60) -> int:
        pattern = re.compile(rf"{what} on port (\d+)")
        found: list[int] = []

        def scan() -> bool:
            found.extend(int(m.group(1)) for ln in self.lines if (m := pattern.search(ln)))
            return bool(found) or self.proc.poll() is not None

        wait_until(scan, timeout)
        assert found, f"no '{what} on port' line; log:\n" + "\n".join(self.lines)
        return found[0]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _inflight(metrics_port: int) -> float:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return families["attention_inflight_requests"].samples[0].value


@pytest.fixture
def server_process() -> Iterator[type[ServerProcess]]:
    procs: list[ServerProcess] = []

    class Tracked(ServerProcess):
        def __init__(self, *args: str) -> None:
            super().__init__(*args)
            procs.append(self)

    yield Tracked
    for p in procs:
        p.kill()


def test_sigterm_drains_in_flight_call_and_exits_0(server_process) -> None:  # type: ignore[no-untyped-def]
    srv = server_process("--metrics-port", "0", "--grace-seconds", "30", "--access-log")
    port = srv.port("listening")
    metrics_port = srv.port("metrics")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.AttentionServiceStub(channel)
    assert health_status(channel) == "SERVING"

    # A slow call: the client holds back its bytes until after SIGTERM.
    msgs, release, sent_header = small_prefill(), threading.Event(), threading.Event()

    def slow_stream():  # type: ignore[no-untyped-def]
        yield msgs[0]
        sent_header.set()
        release.wait(30)
        yield from msgs[1:]

    inflight = stub.Prefill(slow_stream(), timeout=60)
    assert sent_header.wait(10)
    assert wait_until(lambda: _inflight(metrics_port) == 1)  # the handler has the call
    srv.proc.send_signal(signal.SIGTERM)

    assert wait_until(lambda: health_status(channel) == "NOT_SERVING")
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Prefill(iter(small_prefill()), timeout=5))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    release.set()
    responses = list(inflight)
    assert responses[-1].HasField("stats")
    assert srv.proc.wait(30) == 0
    channel.close()
    log = "\n".join(srv.lines)
    assert "rpc=Prefill code=OK" in log and "shutting down" in log


def test_sigint_idle_server_exits_0(server_process) -> None:  # type: ignore[no-untyped-def]
    srv = server_process("--metrics-port", "-1", "--no-warmup")
    srv.port("listening")
    srv.proc.send_signal(signal.SIGINT)
    assert srv.proc.wait(30) == 0
    assert not any("metrics on port" in ln for ln in srv.lines)


def test_bad_flag_value_exits_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "attention_service", "--device", "tpu"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "device" in proc.stderr


def _start_refused(*args: str) -> str:
    """stderr of a server that must refuse to start: exit 2, one line, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "attention_service", "--device", "cpu", "--no-warmup",
         "--metrics-port", "-1", *args],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("attention-server: "), proc.stderr
    return last


@pytest.mark.parametrize("frontends", ["1", "2"])
def test_start_up_failures_are_one_line(frontends: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert "--port" in _start_refused("--frontends", frontends, "--host", "127.0.0.1",
                                          "--port", port)
        assert "--metrics-port" in _start_refused(
            "--frontends", frontends, "--host", "127.0.0.1", "--port", "0",
            "--metrics-port", port)
    missing = str(tmp_path / "nope.pem")
    assert "--tls-cert" in _start_refused("--frontends", frontends, "--port", "0",
                                          "--tls-cert", missing, "--tls-key", missing)
    assert "--kv-cache-bytes" in _start_refused("--frontends", frontends, "--port", "0",
                                                "--kv-cache-bytes", str(1 << 62))


@pytest.mark.parametrize("frontends", ["1", "2"])
def test_cuda_asked_without_a_gpu_is_one_line_not_a_traceback(frontends: str) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run(
        [sys.executable, "-m", "attention_service", "--device", "cuda", "--port", "0",
         "--frontends", frontends],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("attention-server: --device cuda requested but torch sees "
                                   "no CUDA device"), proc.stderr


_SLOW_WARMUP = '''
import os, sys, time
if os.environ.get("ATTENTION_TEST_SLOW_WARMUP"):
    import attention_service.engine.core as core

    def warmup(self):  # a long compile, in the engine
        print("slow warm-up started", file=sys.stderr, flush=True)
        time.sleep(120)

    core.EngineCore.warmup = warmup
'''


@pytest.mark.parametrize("frontends", ["1", "2"], ids=["one-process", "group"])
def test_sigterm_during_warmup_exits_0_at_once(tmp_path, frontends) -> None:  # type: ignore[no-untyped-def]
    """A server stopped while it warms up (a pod stopped during start-up): exit 0 in seconds,
    not after the warm-up (the single process used to wait it out: ~60 s on an H100 with an
    empty Triton cache; the group aborted on cuda, gpu_checks.sh sigterm-warmup)."""
    (tmp_path / "sitecustomize.py").write_text(_SLOW_WARMUP)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ATTENTION_TEST_SLOW_WARMUP": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "attention_service", "--host", "127.0.0.1", "--port", "0",
         "--device", "cpu", "--metrics-port", "-1", "--frontends", frontends],
        stderr=subprocess.PIPE, text=True, env=env,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(ln.rstrip() for ln in proc.stderr),  # type: ignore[union-attr]
                     daemon=True).start()
    try:
        assert wait_until(lambda: any("slow warm-up started" in ln for ln in lines), 60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert wait_until(lambda: any("warm-up cut short" in ln for ln in lines), 5), lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
