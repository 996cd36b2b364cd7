"""benchmarks/soak.py end to end on the cpu backend, seconds instead of minutes: the same
checks as the GPU soak (no failed good call, every bad call's documented status, counted
exactly by the server, memory flat, exit 0 on SIGTERM)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy._helpers import CI, REPO
from tests.deploy.test_loadtest import SMALL

if importlib.util.find_spec("locust") is None:
    message = "locust not installed: pip install -r requirements-dev.txt"
    if CI:
        raise ImportError(message)
    pytest.skip(message, allow_module_level=True)

pytestmark = pytest.mark.timeout(180)


def test_a_short_soak_passes_every_check(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOADTEST_", "ATTENTION_"))}
    env.update(SMALL)
    # attention-server is the console script installed next to this interpreter.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--device", "cpu",
         "--duration", "8", "--settle", "2", "--sample-every", "1", "--users", "3",
         "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=170,
    )
    summary = json.loads((tmp_path / "soak_summary.json").read_text())
    assert proc.returncode == 0 and summary["passed"], (summary["checks"], proc.stdout[-3000:])
    assert summary["locust"]["requests"] > 0 and summary["chaos"]["rounds"] >= 1
    # Every case ran and got its status; the server's own counters agree.
    cases = {k.split(" -> ")[0] for k in summary["chaos"]["by_case"]}
    assert {"garbage_bytes", "cancel_mid_upload", "deadline_mid_upload", "unknown_cache",
            "corrupt_unary", "sequences_flood"} <= cases
    assert summary["server_exit"] == 0 and not summary["server_counts_mismatch"]
    assert (tmp_path / "soak.md").read_text().count("| pass |") == len(summary["checks"])
