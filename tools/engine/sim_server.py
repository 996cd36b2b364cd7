"""``attention-server`` with a modelled GPU: the whole real server (front ends, engine, step
socket, batching), whose backend does a cuda launch's host work and lets a device timeline
"run" it instead of computing. For the service's host side on a machine without a GPU: drive
it with ``bench_offload.py --target`` and profile it like the real one (outputs are not
written: no correctness here).

A launch runs on the timeline for ``--kernel-us`` plus ``--row-us`` per query row (a
decode's sequences, a prefill's tokens); a cached decode launch that takes the step graphs
also does the cuda backend's host side first (``host_backend.StagedSteps``: where its
tensors lie, its shape, the staging fill). The defaults model an H200 at B=64, context 2K,
H=32, H_kv=8, D=128 bf16 (issue 61: 136 us for 64 sequences, 957 us for the merged 512). One
launch runs at a time; waiting for one lets the GIL go, as an event synchronize does.

    python tools/engine/sim_server.py [--kernel-us 19] [--row-us 1.83] -- --port 50070 ...

Everything after ``--`` goes to ``attention-server`` (``--device`` is set to cpu).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attention_service import __main__ as server_main
from attention_service import server
from attention_service.engine import backends
from attention_service.engine.jobs import BatchPlan, PendingLaunch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_backend import DeviceTimeline, HostOnlyBackend, StagedSteps, fine_timer_slack


class SimulatedGpu(HostOnlyBackend):
    """Host buffers from torch, launches issued without waiting (two in flight, as cuda's),
    the staging fill of step-graph launches, device time from the model."""

    device_name = "simulated GPU (tools/engine/sim_server.py)"

    def __init__(self, kernel_s: float, row_s: float) -> None:
        self.kernel_s, self.row_s = kernel_s, row_s
        self.steps = StagedSteps()
        self.timeline = DeviceTimeline()

    def launch(self, plan: BatchPlan) -> PendingLaunch:
        self.steps.stage(plan)
        return self.timeline.run(self.kernel_s + self.row_s * plan.q_offsets[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel-us", type=float, default=19.0, help="a launch's fixed time")
    p.add_argument("--row-us", type=float, default=1.83,
                   help="a launch's time per query row")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    fine_timer_slack()  # before the server's threads start: they inherit it

    def make_backend(device: str, cuda_graphs: bool = True) -> SimulatedGpu:
        return SimulatedGpu(args.kernel_us / 1e6, args.row_us / 1e6)

    # The engine process is this one (the process group's front ends are its children, and
    # they make no backend): both places that make one look it up here.
    backends.make_backend = make_backend  # type: ignore[assignment]
    server.make_backend = make_backend  # type: ignore[assignment]
    return server_main.main([*argv[cut + 1 :], "--device", "cpu"])


if __name__ == "__main__":
    sys.exit(main())
