"""tools/tuning/tune_transfer.py end to end on the cpu backend, with tiny settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]


def test_tune_transfer_measures_every_setting(tmp_path: Path) -> None:
    cmd = [
        sys.executable, str(ROOT / "tools" / "tuning" / "tune_transfer.py"), "--mib-in", "2",
        "--mib-out", "1", "--chunks", "262144,1048576", "--iters", "1", "--tokens", "64",
        "--heads", "2", "--head-dim", "16", "--device", "cpu", "--frontends", "2",
        "--concurrency", "2", "--seconds", "0.5", "--channels", "1,2", "--agg-tokens", "32",
        "--out", str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "tune_transfer_cpu.json").read_text())
    assert set(report["raw_GBps"]) == {"default", "frame-16M", "window-64M", "write-buffer-8M"}
    assert all(g > 0 for row in report["raw_GBps"].values() for g in row.values())
    assert set(report["service_ms"]) == {"262144", "1048576"}
    assert set(report["channels_GBps"]) == {"1", "2"}
    assert all(v > 0 for v in report["channels_GBps"].values())
