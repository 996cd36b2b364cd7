"""benchmarks/trace_step.py end to end on the cpu backend: the hooks load in every server
process and a step's hops come out in order, front end and engine both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_trace_step_times_every_hop_of_a_step(tmp_path: Path, stream: bool) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "trace_step.py"), "--device", "cpu",
           "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--context", "40",
           "--steps", "40", "--warm-steps", "10", "--frontends", "2", "--out", str(tmp_path)]
    cmd += ["--stream", "--layers", "2"] if stream else []  # steps alternate over 2 layers
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [path] = tmp_path.glob("trace_step_*.json")
    got = json.loads(path.read_text())
    assert got["steps"] == 40 and got["frontends"] == 2
    assert got["args"]["layers"] == (2 if stream else 1)
    assert f"{got['args']['layers']} layer(s)" in proc.stdout
    hops = [hop for hop, _ in got["rows"]]
    assert hops[0] == "client call" and hops[-1] == "reply"
    labels = " ".join(hops)
    # The front end received, the engine got it over the channel and launched, the answer
    # came back to the front end: in that order.
    order = ["receive_request>@fe", "FrontendConnection.on_message>@engine",
             "CpuBackend.launch>@engine", "RemoteLink.on_message>@fe", "stats_message<@fe"]
    at = [labels.index(x) for x in order]
    assert at == sorted(at), labels
    assert all(us >= 0 for _, us in got["rows"])
    assert got["median_total_us"] >= sum(us for _, us in got["rows"]) * 0.5
