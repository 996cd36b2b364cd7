"""``--busy-poll-ms``: the pollers' placement, when they spin, and that they never outlive
the engine (engine/busy_poll.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attention_service.config import ServerConfig, load_config
from attention_service.engine.busy_poll import BusyPoll

from .group_helpers import Group
from .svc_helpers import small_prefill, wait_until

TICK = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(x) for x in f.read().split()]
    return kids


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def gone(pid: int) -> bool:
    """Exited and reaped, or a zombie (its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def pollers(helper: int, count: int) -> list[int]:
    assert wait_until(lambda: len(children(helper)) == count, 10), children(helper)
    return children(helper)


def test_flag_and_env() -> None:
    assert ServerConfig().busy_poll_ms == 0
    assert load_config(["--busy-poll-ms", "20"]).busy_poll_ms == 20
    assert load_config([], {"ATTENTION_BUSY_POLL_MS": "5"}).busy_poll_ms == 5
    with pytest.raises(ValueError, match="busy_poll_ms"):
        ServerConfig(busy_poll_ms=-1)


def test_one_poller_per_cpu_pinned_at_sched_idle() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    bp = BusyPoll(50)
    try:
        kids = pollers(bp.pid, len(cpus))
        assert sorted(next(iter(os.sched_getaffinity(k))) for k in kids) == cpus
        assert all(len(os.sched_getaffinity(k)) == 1 for k in kids)
        assert all(os.sched_getscheduler(k) == os.SCHED_IDLE for k in kids)
    finally:
        bp.close()


def test_spins_only_within_the_window_after_a_touch() -> None:
    cpu = min(os.sched_getaffinity(0))
    bp = BusyPoll(300, cpus=[cpu])
    try:
        (kid,) = pollers(bp.pid, 1)
        before = cpu_seconds(kid)
        time.sleep(0.4)
        assert cpu_seconds(kid) - before < 0.05  # never touched: asleep
        bp.touch()
        before = cpu_seconds(kid)
        time.sleep(0.25)  # inside the window (this thread sleeps: the CPU is the poller's)
        assert cpu_seconds(kid) - before > 0.1
        time.sleep(0.15)  # the window ends
        before = cpu_seconds(kid)
        time.sleep(0.4)
        assert cpu_seconds(kid) - before < 0.05
    finally:
        bp.close()


def test_close_stops_helper_and_pollers() -> None:
    bp = BusyPoll(50)
    helper = bp.pid
    kids = pollers(helper, len(os.sched_getaffinity(0)))
    bp.touch()
    bp.close()
    assert gone(helper)
    assert wait_until(lambda: all(gone(k) for k in kids), 5)


def test_a_killed_engine_leaves_no_poller_behind() -> None:
    code = ("import os, sys, time\n"
            "from attention_service.engine.busy_poll import BusyPoll\n"
            "bp = BusyPoll(10_000)\nbp.touch()\nprint(bp.pid, flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        helper = int(proc.stdout.readline())
        kids = pollers(helper, len(os.sched_getaffinity(0)))
        proc.send_signal(signal.SIGKILL)  # spinning: a 10 s window was just opened
        proc.wait()
        assert wait_until(lambda: gone(helper) and all(gone(k) for k in kids), 5)
    finally:
        proc.kill()
        proc.wait()


def test_process_group_polls_and_stops_with_sigterm() -> None:
    group = Group(2, "--busy-poll-ms", "200")
    try:
        group.wait_for(r"busy poll: \d+ CPUs")
        engine = group.proc.pid
        frontends = set(group.frontend_pids().values())
        (helper,) = [p for p in children(engine) if p not in frontends
                     and b"busy_poll" in Path(f"/proc/{p}/cmdline").read_bytes()]
        kids = pollers(helper, len(os.sched_getaffinity(0)))
        stub = group.stub()
        before = sum(cpu_seconds(k) for k in kids)
        assert list(stub.Prefill(iter(small_prefill()), timeout=30))[-1].HasField("stats")
        time.sleep(0.15)  # the call opened a 200 ms window
        assert sum(cpu_seconds(k) for k in kids) - before > 0.05
        assert group.stop(signal.SIGTERM, 30) == 0
        assert wait_until(lambda: gone(helper) and all(gone(k) for k in kids), 5)
    finally:
        group.stop(signal.SIGKILL)
