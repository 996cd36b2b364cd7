"""benchmarks/bench_engine_prefill.py end to end (the engine model: no gRPC, no GPU), tiny."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def test_bench_engine_prefill_runs_each_gate_and_side_and_writes_rows(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "bench_engine_prefill.py"),
        "--gates", "off,all", "--batching", "on,off", "--frontends", "2",
        "--clients-per-front", "4", "--seconds", "0.6", "--warmup", "0.2", "--max-len", "64",
        "--out", str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [(r["batching"], r["gate"]) for r in rows] == [
        (True, "off"), (True, "all"), (False, "off"), (False, "all")]
    for r in rows:
        assert r["req_per_s"] > 0 and r["engine_cpu_us_per_req"] > 0
        # Each launch spends --issue-us (250) of Python before it returns: the issue time
        # the executor reports holds at least that.
        assert math.isfinite(r["issue_ms_mean"]) and r["issue_ms_mean"] >= 0.25
        if r["batching"]:
            assert r["mean_batch"] >= 1.0
        else:
            assert r["mean_batch"] == 1.0  # batching off: every launch alone
    assert "| on | all |" in proc.stdout and "| off | off |" in proc.stdout
