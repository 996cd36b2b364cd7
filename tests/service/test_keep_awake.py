"""attention-keep-awake: one SCHED_IDLE spinner per CPU, pinned; gone with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from attention_service import keep_awake

T = TypeVar("T")

pytestmark = [pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling only"),
              pytest.mark.timeout(60)]


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _wait_for(check: Callable[[], T], timeout: float = 10.0) -> T:
    end = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)
    return got


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _start(cpus: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "attention_service.keep_awake", "--cpus", cpus],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_spinner_per_cpu_pinned_at_sched_idle_and_sigterm_ends_them_all() -> None:
    cpu = min(os.sched_getaffinity(0))
    proc = _start(str(cpu))
    try:
        assert "keeping CPUs" in proc.stdout.readline()
        (child,) = _wait_for(lambda: _children(proc.pid))
        _wait_for(lambda: os.sched_getscheduler(child) == os.SCHED_IDLE)
        assert os.sched_getaffinity(child) == {cpu}
        assert os.sched_getscheduler(proc.pid) != os.SCHED_IDLE  # the parent only waits
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        _wait_for(lambda: not _alive(child))
    finally:
        proc.kill()
        proc.wait()


def test_the_spinners_die_with_a_killed_parent() -> None:
    proc = _start(str(min(os.sched_getaffinity(0))))
    try:
        proc.stdout.readline()
        (child,) = _wait_for(lambda: _children(proc.pid))
        proc.kill()  # no handler runs: the child's parent-death signal ends it
        proc.wait()
        _wait_for(lambda: not _alive(child))
    finally:
        proc.kill()
        proc.wait()


def test_a_cpu_outside_the_allowed_set_is_refused_by_name_before_any_starts() -> None:
    outside = max(os.sched_getaffinity(0)) + 1000
    pids: list[int] = []
    with pytest.raises(ValueError, match=rf"--cpus: {outside} not among"):
        keep_awake.start([outside], pids)
    assert pids == []
    proc = _start(f"0,{outside}")
    try:
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 2 and f"{outside} not among" in err and "keeping" not in out
    assert subprocess.run([sys.executable, "-m", "attention_service.keep_awake", "--cpus",
                           "two"], capture_output=True, text=True, timeout=30).returncode == 2
