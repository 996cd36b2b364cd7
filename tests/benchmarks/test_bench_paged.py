"""benchmarks/bench_paged.py --smoke: its code paths on tiny shapes under the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# On a GPU host the ``paged`` stage of gpu_checks.sh runs the real benchmark; the smoke run is
# for CI (its numpy may also be too new for the interpreter there).
pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(torch.cuda.is_available(), reason="CI check; GPUs run the bench")]
ROOT = Path(__file__).resolve().parents[2]


def test_bench_paged_smoke_writes_results(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_paged.py"), "--smoke",
           "--page-tokens", "5,16", "--out", str(tmp_path)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "paged_cpu-interpreter.json").read_text())
    rows = report["rows"]
    assert {r["kind"] for r in rows} == {"decode", "prefill"}
    assert {r["page_tokens"] for r in rows} == {5, 16}
    for r in rows:
        assert r["check_rel_err"] < 2e-2
        assert r["paged_over_contiguous"] > 0
    table = (tmp_path / "paged_cpu-interpreter.md").read_text()
    assert "| B | ctx | D | page |" in table and "## Prefill" in table
