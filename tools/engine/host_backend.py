"""The engine-side models' stand-in for a backend (bench_engine_steps.py,
bench_engine_prefill.py, engine_request_path.py, sim_server.py): what the engine asks of one
besides ``launch``, with no device behind it; a modelled device's timeline; the cuda backend's
host side of a cached decode launch."""

from __future__ import annotations

import ctypes
import os
import time

import torch

from attention_service.engine.decode_steps import Staging, StepShape, places, step_shape
from attention_service.engine.jobs import BatchPlan, LaunchTimes


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


def fine_timer_slack() -> None:
    """Sleeps in this thread and the threads it starts later wake within ~1 us of their time,
    not the default 50 us timer slack (a modelled 136 us kernel would run ~40% long)."""
    PR_SET_TIMERSLACK = 29
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)


class Timed:
    """A launch on the modelled device, done at ``until`` (perf_counter seconds)."""

    def __init__(self, until: float) -> None:
        self.until = until

    def wait(self) -> LaunchTimes:
        # One wait with the GIL let go, as an event synchronize spins in the driver without
        # it (polling with time.sleep(0) would take the GIL back thousands of times a second
        # and compete with the threads this models).
        left = self.until - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return LaunchTimes()


class DeviceTimeline:
    """One launch at a time, as one GPU runs full-occupancy kernels: a launch starts when it
    is issued or when the previous one ends, whichever is later."""

    def __init__(self) -> None:
        self.busy_until = 0.0

    def run(self, seconds: float) -> Timed:
        start = max(time.perf_counter(), self.busy_until)
        self.busy_until = start + seconds
        return Timed(self.busy_until)


class StagedSteps:
    """The cuda backend's host side of a cached decode launch that takes the step graphs:
    where its tensors lie, its shape, and the staging fill (``decode_steps.Staging``) into
    buffers in host memory, a staging per shape and set of caches as ``DecodeSteps`` keeps
    them; the copies and the kernel are device work, left out."""

    MAX_STAGINGS = 256  # past it the oldest goes (merged launches of 8 hosts: many sets)

    def __init__(self) -> None:
        self._staging: dict[tuple[StepShape, tuple], tuple[Staging, dict[str, int]]] = {}
        self._buffers: dict[StepShape, torch.Tensor] = {}

    def stage(self, plan: BatchPlan) -> None:
        """``plan``'s tables staged, when it takes the step graphs."""
        where = places(plan)
        if where is None:
            return
        shape = step_shape(plan, where)
        key = (shape, tuple(job.params.cache_ids for job in plan.jobs))
        got = self._staging.get(key)
        if got is None:
            buffers = self._buffers.get(shape)
            if buffers is None:  # the graph's buffers, in host memory here
                buffers = self._buffers[shape] = torch.empty(shape.buffers[1],
                                                             dtype=torch.uint8)
            at = {name: buffers.data_ptr() + off for name, _, _, off in shape.buffers[0]}
            if len(self._staging) >= self.MAX_STAGINGS:
                del self._staging[next(iter(self._staging))]
            got = self._staging[key] = (Staging(shape, pin=False), at)
        got[0].fill(plan, shape, where, got[1])
