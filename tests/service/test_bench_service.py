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
        # The started server's CPU use from /proc: busy, and one thread at most all of it.
        assert row["server_cpu"] > 0
        assert 0 < row["server_busiest_thread"] <= row["server_cpu"] + 1e-9
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
    assert "path shm, send steps, 2 front end(s)" in proc.stdout
    report = json.loads((tmp_path / "service_prefill_shm_fe2_cpu.json").read_text())
    assert report["server"]["frontends"] == 2
    for row in report["results"]:
        assert row["completed"] > 0 and row["errors"] == 0
        # Every tensor byte went through the region: none through gRPC.
        assert row["region_MBps"] > 0 and row["wire_in_MBps"] == 0
