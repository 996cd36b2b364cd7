"""benchmarks/bench_batching.py end to end on the cpu backend, with tiny settings."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_bench_batching_runs_both_sides_and_writes_results(tmp_path: Path, mode: str) -> None:
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "bench_batching.py"), "--device", "cpu",
        "--mode", mode,
        "--clients", "1,4", "--duration", "0.6", "--warmup", "0.2", "--prime", "0",
        "--max-len", "48", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
        "--verify", "4", "--pool", "8", "--out", str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Four jobs submitted together: batching merges them, the direct executor never does.
    assert "4 concurrent jobs match the reference" in proc.stdout
    assert "largest launch 4 requests" in proc.stdout
    assert "largest launch 1 requests" in proc.stdout
    assert "req/s on/off" in proc.stdout

    report = json.loads((tmp_path / f"batching_{mode}_cpu.json").read_text())
    assert report["device"] == "cpu"
    rows = {(r["side"], r["clients"]): r for r in report["results"]}
    assert set(rows) == {("on", 1), ("on", 4), ("off", 1), ("off", 4)}
    for row in rows.values():
        assert row["completed"] > 0 and row["rps"] > 0 and row["errors"] == 0
        assert row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"]
        assert row["mean_queue_ms"] >= 0
    assert rows[("off", 4)]["mean_batch_requests"] == 1
    assert rows[("on", 4)]["mean_batch_requests"] > 1  # 4 closed-loop clients on a busy device
    with (tmp_path / f"batching_{mode}_cpu.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 4


def test_tune_batching_measures_every_setting(tmp_path: Path) -> None:
    cmd = [
        sys.executable, str(ROOT / "tools" / "tuning" / "tune_batching.py"), "--device", "cpu",
        "--clients", "3", "--tokens", "64,256", "--delays-ms", "0,2", "--duration", "0.4",
        "--warmup", "0.1", "--prime", "0", "--max-len", "48", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "32", "--pool", "8", "--out", str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "tune_batching_cpu.json").read_text())["results"]
    settings = {(r["side"], r["max_batch_tokens"], r["max_queue_delay_ms"]) for r in rows}
    assert settings == {("off", None, None), ("on", 64, 0.0), ("on", 64, 2.0), ("on", 256, 0.0),
                        ("on", 256, 2.0)}
    assert all(r["completed"] > 0 and r["errors"] == 0 for r in rows)
