"""benchmarks/bench_service.py end to end on the cpu backend, with tiny settings."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("send", ["steps", "unary"])
def test_bench_service_runs_both_sides_and_writes_results(tmp_path: Path, send: str) -> None:
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "bench_service.py"), "--device", "cpu",
        "--clients", "1,3", "--duration", "1", "--warmup", "0.3", "--prime", "0",
        "--max-len", "48", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
        "--verify", "4", "--workers", "2", "--pool", "4", "--send", send, "--out", str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 concurrent requests match the reference" in proc.stdout
    assert f"send {send}," in proc.stdout
    assert "req/s on/off" in proc.stdout  # the side-by-side table

    report = json.loads((tmp_path / "service_prefill_cpu.json").read_text())
    assert report["server"]["device"] == "cpu"
    rows = {(r["side"], r["clients"]): r for r in report["results"]}
    assert set(rows) == {("on", 1), ("on", 3), ("off", 1), ("off", 3)}
    for row in rows.values():
        assert row["completed"] > 0 and row["rps"] > 0 and row["errors"] == 0
        assert row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"]
        assert row["mean_batch_requests"] >= 1  # read from the server's /metrics
        assert 0 < row["server_mean_ms"] <= row["mean_ms"]  # the wire and the client add
        # The started server's CPU use from /proc: busy, and one thread at most all of it.
        assert row["server_cpu"] > 0
        assert 0 < row["server_busiest_thread"] <= row["server_cpu"] + 1e-9
        # and the load processes' own (they must not be the limit unseen).
        assert 0 < row["load_busiest_thread"] <= row["load_cpu"] + 1e-9
    assert rows[("off", 3)]["mean_batch_requests"] == 1
    with (tmp_path / "service_prefill_cpu.csv").open() as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == 4 and {"side", "clients", "rps", "p99_ms"} <= set(lines[0])


def test_bench_service_shm_path_through_a_process_group(tmp_path: Path) -> None:
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "bench_service.py"), "--device", "cpu",
        "--clients", "1,3", "--duration", "1", "--warmup", "0.3", "--prime", "0",
        "--max-len", "48", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
        "--verify", "4", "--workers", "2", "--pool", "4", "--batching", "on",
        "--frontends", "2", "--path", "shm", "--out", str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "path shm, send steps, 1 connection(s) per client, 2 front end(s)" in proc.stdout
    report = json.loads((tmp_path / "service_prefill_shm_fe2_cpu.json").read_text())
    assert report["server"]["frontends"] == 2
    for row in report["results"]:
        assert row["completed"] > 0 and row["errors"] == 0
        # Every tensor byte went through the region: none through gRPC.
        assert row["region_MBps"] > 0 and row["wire_in_MBps"] == 0


@pytest.mark.parametrize("connections", [1, 3])
def test_each_load_client_has_connections_of_its_own(connections: int) -> None:
    """A server with several front ends is handed connections, not calls (SO_REUSEPORT): the
    load's clients must not share one, as equal grpc channels of a process otherwise do; with
    ``--connections N`` each client's calls go round-robin over N of its own."""
    import asyncio
    import time
    from concurrent import futures

    import grpc

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import service_load

    peers: set[str] = set()

    def echo(requests, context):  # PrefillSteps: one answer per message
        for message in requests:
            peers.add(context.peer())
            yield message

    server = grpc.server(futures.ThreadPoolExecutor(32))  # a thread per open stream
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "attention.v1.AttentionService",
        {"PrefillSteps": grpc.stream_stream_rpc_method_handler(echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        spec = service_load.LoadSpec(
            mode="prefill", heads=2, kv_heads=1, head_dim=8, dtype="bf16", min_len=1,
            max_len=4, decode_seqs=1, causal=True, pool=2, seed=0)
        now = time.time()
        result = asyncio.run(service_load._run_point(
            target=f"127.0.0.1:{port}", pool=service_load.build_requests(spec, 0),
            n_clients=5, seed=0, t_start=now, t_measure=now, t_end=now + 0.5,
            connections=connections))
    finally:
        server.stop(0)
    assert result["errors"] == {} and result["latencies"]
    assert len(peers) == 5 * connections  # round-robin: every connection carried calls


def test_load_requests_are_packed_as_the_client_packs_them() -> None:
    """Header and tensor bytes share messages up to 1 MiB, as attention_client sends them: a
    small request is one message (a call on a kept-open steps stream), a large one several."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import service_load

    from attention_wire.pb import attention_pb2 as pb

    spec = service_load.LoadSpec(
        mode="prefill", heads=16, kv_heads=8, head_dim=128, dtype="bf16", min_len=16,
        max_len=2048, decode_seqs=1, causal=True, pool=32, seed=0)
    sizes = set()
    for req in service_load.build_requests(spec, 0):
        msgs = [pb.PrefillRequest.FromString(m) for m in req.messages]
        # The first message carries the header and 1 MiB less its size, the others 1 MiB.
        header_and_bytes = len(msgs[0].header.SerializeToString()) + req.tokens * 8192
        assert len(msgs) == -(-header_and_bytes // service_load.CHUNK_BYTES)
        assert msgs[0].header.q.shape == [req.tokens, 16, 128]
        got = {f: sum(len(c.data) for m in msgs for c in m.chunks if c.field == f)
               for f in (pb.Q, pb.K, pb.V)}
        assert got == {pb.Q: req.tokens * 4096, pb.K: req.tokens * 2048,
                       pb.V: req.tokens * 2048}
        sizes.add(len(req.messages))
    assert 1 in sizes and max(sizes) > 1
