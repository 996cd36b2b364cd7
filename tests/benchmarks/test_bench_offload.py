"""benchmarks/bench_offload.py end to end on the cpu backend, with tiny settings."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


ASYNC = (("bytes", "socket-shm", "nixl", "socket-nixl") if importlib.util.find_spec("nixl_cu13")
         else ("bytes", "socket-shm"))


# Every point with the sync client; the asyncio client's round on the fewest (and a NIXL
# region, where NIXL is installed, through gRPC and the step socket); both through the step
# socket too.
@pytest.mark.parametrize(("client", "hosts", "transports"),
                         [("sync", (1, 2), ("bytes", "shm", "socket")), ("async", (1,), ASYNC)])
def test_bench_offload_measures_every_point(tmp_path: Path, client: str, hosts: tuple[int, ...],
                                            transports: tuple[str, ...]) -> None:
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "bench_offload.py"), "--device", "cpu",
        "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--context", "16",
        "--batch", "2", "--hosts", ",".join(map(str, hosts)), "--inflight", "1,2",
        "--layers", "2", "--client", client, "--steps", "8", "--warmup", "2",
        "--transport", ",".join(transports), "--out", str(tmp_path),
    ] + (["--spin-us", "100"] if client == "sync" else [])  # the socket's answers polled for
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| B | context | hosts | transport | inflight |" in proc.stdout
    [path] = tmp_path.glob("bench_offload_*.json")
    report = json.loads(path.read_text())
    assert report["device"] == "cpu" and report["kernel"] is False
    assert report["args"]["spin_us"] == (100 if client == "sync" else 0)
    rows = report["rows"]
    assert [(r["hosts"], r["transport"], r["inflight"]) for r in rows] == [
        (h, t, k) for h in hosts for t in transports for k in (1, 2)]
    for r in rows:
        assert "errors" not in r
        assert r["steps"] == 8 * r["hosts"]  # every measured step of every host
        assert 0 < r["p50_ms"] <= r["p99_ms"] and r["steps_per_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(2 * r["steps_per_s"])
        assert r["client_cpu_ms"] > 0 and r["server_cpu_ms"] >= 0
        assert 1 <= r["calls_per_launch"] <= r["hosts"] * r["inflight"]
        assert r["wire_out_bytes"] == 2 * (4 + 2 * 2) * 32 * 2  # q + one k/v token, bf16
        assert r["wire_back_bytes"] == 2 * 4 * 32 * 2
        # The engine's mean NIXL transfer per direction, in the rows whose tensors NIXL moved.
        nixl = [r.get("nixl_in_us"), r.get("nixl_out_us")]
        assert all(0 < us < r["p99_ms"] * 1e3 for us in nixl) if "nixl" in r["transport"] else (
            nixl == [None, None])
    assert list(tmp_path.glob("bench_offload_*.md"))
    # The transports UCX picked, where a NIXL region moved the steps' tensors.
    ops = {(t["op"], t["local_memory"]) for t in report["nixl_transports"]}
    assert ops == ({("read", "host"), ("write", "host")} if "nixl" in transports else set())



def test_bench_offload_spreads_its_steps_over_several_targets(tmp_path: Path) -> None:
    """``--target A,B --spread layers``: each host's layer i on server i mod 2 (e.g. its two
    micro-batches on two engine processes of one GPU): every step is measured, and each
    server ran decode steps with regions (its log); ``--spread hosts`` (the default) puts
    host i on server i mod 2."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tests" / "client"))
    from _server import start_server
    from bench_offload import servers_of

    assert [servers_of(i, ["a", "b"], "hosts") for i in range(3)] == [["a"], ["b"], ["a"]]
    assert servers_of(1, ["a", "b"], "layers") == ["a", "b"]
    servers = [start_server("--frontends", "1", "--access-log") for _ in range(2)]
    try:
        cmd = [
            sys.executable, str(ROOT / "benchmarks" / "bench_offload.py"),
            "--target", ",".join(s.target for s in servers), "--spread", "layers",
            "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--context", "16",
            "--batch", "2", "--hosts", "1", "--inflight", "2", "--layers", "2",
            "--steps", "6", "--warmup", "2", "--transport", "shm", "--out", str(tmp_path),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        [path] = tmp_path.glob("bench_offload_*.json")
        [row] = json.loads(path.read_text())["rows"]
        assert row["steps"] == 6 and "errors" not in row
        for server in servers:
            log = "".join(server.lines)
            assert "rpc=CacheDecode" in log and "regions=" in log, server.log()
    finally:
        for server in servers:
            server.stop()
