"""benchmarks/bench_features.py --smoke: its code paths on tiny shapes under the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# On a GPU host the ``features`` stage of gpu_checks.sh runs the real benchmark; the smoke run
# is for CI.
pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(torch.cuda.is_available(), reason="CI check; GPUs run the bench")]
ROOT = Path(__file__).resolve().parents[2]


def test_bench_features_smoke_writes_results(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_features.py"), "--smoke",
           "--out", str(tmp_path)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "features_cpu-interpreter.json").read_text())["rows"]
    assert {r["kind"] for r in rows} == {"window", "overhead", "decode"}
    for r in rows:
        checks = [v for k, v in r.items() if k.endswith("_check_rel_err")]
        assert checks and all(c < 2e-2 for c in checks), r
    windows = [r for r in rows if r["kind"] == "window"]
    assert {r["left"] for r in windows} == {-1, 8}
    # Visible pairs of a causal window: row i sees min(i, left) + 1 keys.
    for r in windows:
        n, left = r["N"], r["left"]
        assert r["visible_pairs"] == sum(min(i, left if left >= 0 else i) + 1 for i in range(n))
    assert "sdpa_mask_check_rel_err" in windows[0], "the SDPA-mask peer runs on the CPU too"
    assert {r["feature"] for r in rows if r["kind"] == "overhead"} == {
        "plain", "softcap", "alibi", "softcap+alibi"}
    table = (tmp_path / "features_cpu-interpreter.md").read_text()
    assert "| N | left | ours ms |" in table and "## Decode with a left window" in table
