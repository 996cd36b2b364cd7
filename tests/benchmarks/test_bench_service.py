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


# The side-by-side table (both sides, two client counts) once, with steps; unary sends on one
# point (the table's rows do not depend on how requests are sent).
@pytest.mark.parametrize(("send", "clients", "sides"), [
    ("steps", "1,3", "on,off"), ("unary", "3", "on")])
def test_bench_service_runs_both_sides_and_writes_results(
        tmp_path: Path, send: str, clients: str, sides: str) -> None:
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "bench_service.py"), "--device", "cpu",
        "--clients", clients, "--batching", sides, "--duration", "1", "--warmup", "0.3",
        "--prime", "0", "--max-len", "48", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
        "--verify", "4", "--workers", "2", "--pool", "4", "--send", send, "--out", str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 concurrent requests match the reference" in proc.stdout
    assert f"send {send}," in proc.stdout
    if sides == "on,off":
        assert "req/s on/off" in proc.stdout  # the side-by-side table

    report = json.loads((tmp_path / "service_prefill_cpu.json").read_text())
    assert report["server"]["device"] == "cpu"
    rows = {(r["side"], r["clients"]): r for r in report["results"]}
    assert set(rows) == {(side, int(n)) for side in sides.split(",") for n in clients.split(",")}
    for row in rows.values():
        assert row["completed"] > 0 and row["rps"] > 0 and row["errors"] == 0
        assert row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"]
        assert row["mean_batch_requests"] >= 1  # read from the server's /metrics
        assert 0 < row["server_mean_ms"] <= row["mean_ms"]  # the wire and the client add
        # The engine's share of the server's time, and its host time per launch.
        assert 0 < row["engine_mean_ms"] <= row["server_mean_ms"]
        assert row["launch_issue_ms"] > 0
        # The started server's CPU use from /proc: busy, and one thread at most all of it.
        assert row["server_cpu"] > 0
        assert 0 < row["server_busiest_thread"] <= row["server_cpu"] + 1e-9
        # and the load processes' own (they must not be the limit unseen).
        assert 0 < row["load_busiest_thread"] <= row["load_cpu"] + 1e-9
    if ("off", 3) in rows:
        assert rows[("off", 3)]["mean_batch_requests"] == 1
    with (tmp_path / "service_prefill_cpu.csv").open() as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == len(rows) and {"side", "clients", "rps", "p99_ms"} <= set(lines[0])


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
    assert ("path shm, send steps, 1 connection(s) per client (spread), 2 front end(s)"
            in proc.stdout)
    report = json.loads((tmp_path / "service_prefill_shm_fe2_cpu.json").read_text())
    assert report["server"]["frontends"] == 2
    for row in report["results"]:
        assert row["completed"] > 0 and row["errors"] == 0
        # Counted from /proc per front end as the window starts; spread leaves at most one
        # connection between the most and the least held.
        held = row["frontend_connections"]
        assert len(held) == 2 and sum(held) >= row["clients"] and held[0] - held[1] <= 1
        # Every tensor byte went through the region: none through gRPC.
        assert row["region_MBps"] > 0 and row["wire_in_MBps"] == 0
        # The front ends time the engine's share, the engine its launches: one scrape.
        assert 0 < row["engine_mean_ms"] <= row["server_mean_ms"]
        assert row["launch_issue_ms"] > 0


def _run_load_point(handlers: dict, n_clients: int, **point: object) -> dict:
    """One load point of ``n_clients`` against a fake server of ``handlers`` for 0.5 s."""
    import asyncio
    import time
    from concurrent import futures

    import grpc

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import service_load

    server = grpc.server(futures.ThreadPoolExecutor(32))  # a thread per open stream
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "attention.v1.AttentionService", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        spec = service_load.LoadSpec(
            mode="prefill", heads=2, kv_heads=1, head_dim=8, dtype="bf16", min_len=1,
            max_len=4, decode_seqs=1, causal=True, pool=2, seed=0)
        now = time.time()
        return asyncio.run(service_load._run_point(
            target=f"127.0.0.1:{port}", pool=service_load.build_requests(spec, 0),
            n_clients=n_clients, seed=0, t_start=now, t_measure=now, t_end=now + 0.5,
            **point))
    finally:
        server.stop(0)


def _echo_steps(peers: set[str]):  # PrefillSteps: one answer per message
    import grpc

    def echo(requests, context):
        for message in requests:
            peers.add(context.peer())
            yield message

    return grpc.stream_stream_rpc_method_handler(echo)


@pytest.mark.parametrize("connections", [1, 3])
def test_each_load_client_has_connections_of_its_own(connections: int) -> None:
    """A server with several front ends is handed connections, not calls (SO_REUSEPORT): the
    load's clients must not share one, as equal grpc channels of a process otherwise do; with
    ``--connections N`` each client's calls go round-robin over N of its own."""
    peers: set[str] = set()
    result = _run_load_point({"PrefillSteps": _echo_steps(peers)}, 5, connections=connections)
    assert result["errors"] == {} and result["latencies"]
    assert len(peers) == 5 * connections  # round-robin: every connection carried calls


@pytest.mark.parametrize("spread", [True, False])
def test_load_places_its_connections_as_the_client_spreads_them(spread: bool) -> None:
    """With spread (bench_service's default) a load client replaces a connection that a server
    of several front ends calls crowded, as the client library does; without, it asks nothing
    and keeps the connection the kernel hashed."""
    import grpc

    from attention_wire.pb import attention_pb2 as pb

    asked: list[str] = []

    def info(request: pb.GetServerInfoRequest, context: grpc.ServicerContext) -> pb.ServerInfo:
        assert request.connections
        asked.append(context.peer())
        # The first two connections land on a front end holding 3 against the fewest's 1.
        held = 3 if len(asked) <= 2 else 1
        return pb.ServerInfo(frontends=2, frontend_connections=held,
                             fewest_frontend_connections=1)

    peers: set[str] = set()
    result = _run_load_point({
        "PrefillSteps": _echo_steps(peers),
        "GetServerInfo": grpc.unary_unary_rpc_method_handler(
            info, request_deserializer=pb.GetServerInfoRequest.FromString,
            response_serializer=pb.ServerInfo.SerializeToString),
    }, 1, spread=spread)
    assert result["errors"] == {} and result["latencies"]
    if spread:
        assert len(set(asked)) == 3  # a new connection per look
        assert peers == {asked[-1]}  # the calls went on the one that was not crowded
    else:
        assert asked == [] and len(peers) == 1


def test_load_requests_are_packed_as_the_client_packs_them() -> None:
    """Header and tensor bytes share messages up to a chunk, as attention_client sends them: a
    small request is one message (a call on a kept-open steps stream), a large one several."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import service_load

    from attention_wire.pb import attention_pb2 as pb

    for chunk in (1 << 20, 3 << 20):  # the client's default, and a larger --chunk-bytes
        spec = service_load.LoadSpec(
            mode="prefill", heads=16, kv_heads=8, head_dim=128, dtype="bf16", min_len=16,
            max_len=2048, decode_seqs=1, causal=True, pool=32, seed=0, chunk_bytes=chunk)
        sizes = set()
        for req in service_load.build_requests(spec, 0):
            msgs = [pb.PrefillRequest.FromString(m) for m in req.messages]
            # The first message carries the header and a chunk less its size, the others a
            # chunk each.
            header_and_bytes = len(msgs[0].header.SerializeToString()) + req.tokens * 8192
            assert len(msgs) == -(-header_and_bytes // chunk)
            assert msgs[0].header.q.shape == [req.tokens, 16, 128]
            got = {f: sum(len(c.data) for m in msgs for c in m.chunks if c.field == f)
                   for f in (pb.Q, pb.K, pb.V)}
            assert got == {pb.Q: req.tokens * 4096, pb.K: req.tokens * 2048,
                           pb.V: req.tokens * 2048}
            sizes.add(len(req.messages))
        assert 1 in sizes and max(sizes) > 1


def test_a_server_whose_port_was_taken_starts_again_on_new_ports(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The port a bench picks may be taken before its server binds it (tests run servers side
    by side): ``Server`` sees the bind refused and starts again on new ports."""
    import socket

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_service

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    ports = iter([busy])
    real = bench_service._free_port
    monkeypatch.setattr(bench_service, "_free_port", lambda: next(ports, None) or real())
    args = bench_service.parse_args(["--device", "cpu", "--frontends", "0"])
    args.server_args = "--no-warmup"
    try:
        server = bench_service.Server(args, True, tmp_path / "server.log")
    finally:
        taken.close()
    try:
        assert server.target != f"127.0.0.1:{busy}"
        assert bench_service.server_info(server.target).device
    finally:
        server.stop()
