"""tools/engine/bench_engine_steps.py end to end with tiny settings: the real engine side of a
front end under a load process, no gRPC, no device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


# One sequence a step storing its token; a model host's steps of 4 sequences storing nothing,
# their 128-token caches on a page boundary (a fresh page each, every step).
@pytest.mark.parametrize("batch", [1, 4])
def test_bench_engine_steps_drives_the_engine_and_batches(tmp_path: Path, batch: int) -> None:
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "tools" / "engine" / "bench_engine_steps.py"),
           "--clients", "1,8", "--seconds", "0.5", "--warmup", "0.2", "--heads", "4",
           "--kv-heads", "2", "--head-dim", "16", "--context", "100" if batch == 1 else "128",
           "--batch", str(batch), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["clients"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {1, 8}
    for r in rows.values():
        assert r["steps_per_s"] > 0 and r["engine_cpu_us_per_step"] > 0
    assert rows[1]["mean_batch"] == 1.0
    assert rows[8]["mean_batch"] > 1.0  # eight sessions' steps share launches
    assert "| 8 |" in proc.stdout
    assert f"({batch} sequences a step" in proc.stdout
