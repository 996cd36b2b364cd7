"""The engine-side models' stand-in for a backend (bench_engine_steps.py,
bench_engine_prefill.py, engine_request_path.py): what the engine asks of one besides
``launch``, with no device behind it."""

from __future__ import annotations

import os

import torch


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class HostOnlyBackend:
    """Host buffers from torch, no device memory, nothing to warm up; launches as on cuda
    (two in flight, issued on the submitting thread when the device is idle). Subclasses
    give ``launch``."""

    name = "cpu"
    device_name = "none (host cost only)"
    device = torch.device("cpu")
    max_inflight = 2
    async_launch = True
    warmup_dtypes = ()

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def memory(self) -> tuple[int, int]:
        return (0, 0)

    def warmup(self) -> None:
        pass
