"""Engine benchmarks without gRPC or GPU, tiny: bench_engine_prefill, engine_request_path."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def test_bench_engine_prefill_runs_each_round_and_side_and_writes_rows(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    cmd = [
        sys.executable, str(ROOT / "tools" / "engine" / "bench_engine_prefill.py"),
        "--rounds", "2", "--batching", "on,off", "--frontends", "2",
        "--clients-per-front", "4", "--seconds", "0.6", "--warmup", "0.2", "--max-len", "64",
        "--out", str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [(r["round"], r["batching"]) for r in rows] == [
        (1, True), (1, False), (2, True), (2, False)]
    for r in rows:
        assert r["req_per_s"] > 0 and r["engine_cpu_us_per_req"] > 0
        # Each launch spends --issue-us (250) of Python before it returns: the issue time
        # the executor reports holds at least that.
        assert math.isfinite(r["issue_ms_mean"]) and r["issue_ms_mean"] >= 0.25
        if r["batching"]:
            assert r["mean_batch"] >= 1.0
        else:
            assert r["mean_batch"] == 1.0  # batching off: every launch alone
    assert "| on | 2 |" in proc.stdout and "| off | 1 |" in proc.stdout


def test_engine_request_path_prints_each_stage() -> None:
    cmd = [sys.executable, str(ROOT / "tools" / "engine" / "engine_request_path.py"),
           "--batch", "4", "--rounds", "20", "--repeats", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stages = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("stage", "---"):
            stages[cells[0]] = (float(cells[1]), float(cells[2]))
    assert set(stages) == {"read + submit", "queue + plan", "complete + answer", "total"}
    for best, median in stages.values():
        assert 0 < best <= median
    parts = sum(stages[s][0] for s in ("read + submit", "queue + plan", "complete + answer"))
    assert stages["total"][0] == pytest.approx(parts, abs=0.2)
