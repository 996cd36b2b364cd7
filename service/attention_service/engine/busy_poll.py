"""``--busy-poll-ms``: keep the server's CPUs polling, not halting, while calls arrive.

Why: on a VM whose idle vCPUs halt (a HLT exit to the hypervisor: Firecracker, as on our H100
hosts, or KVM without guest halt-polling), each thread hand-off of a call wakes a halted vCPU,
and each hand-off then costs tens of microseconds before our code runs; a decode step makes
about ten of them across the front end and the engine. Measured on a 16-vCPU H100 host
(benchmarks/results/issue11/h100_2026-11-25/): CPU-spinning idle processes on every vCPU
took a 1-client decode step from 2.01 to 1.54 ms p50 and a bare gRPC echo from 1.21 to
0.49 ms. Guest kernels solve this with the ``haltpoll`` cpuidle driver or ``idle=poll``;
this is the same thing from user space, for hosts where neither is available.

How: one helper process forks one poller per CPU this server may use, each pinned to its CPU
at ``SCHED_IDLE``: it runs only while its CPU has nothing else to do, and any thread of ours
that wakes there preempts it at once. A poller spins only within ``window`` seconds of the
last call's arrival (the engine stamps a shared 8-byte monotonic time on each submit) and
sleeps otherwise, so an idle server costs nothing; a busy one shows its CPUs at 100% in
``top``. Off by default: on a shared host it takes every spare cycle of the server's CPUs
while calls arrive, and on bare metal it buys little.

The helper and its pollers exit with the engine: ``close()`` stops them, and they notice a
dead parent within ``_PARENT_CHECK_S`` (a killed engine does not leave CPUs spinning).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import mmap
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Sequence

log = logging.getLogger("attention_service")

_STAMP = struct.Struct("d")  # CLOCK_MONOTONIC seconds of the last call's arrival
_IDLE_SLEEP_S = 0.02  # a poller outside the window looks again this often
_SPIN_ROUNDS = 2000  # loop turns between two looks at the stamp (~20-40 us)
_PARENT_CHECK_S = 0.5


class BusyPoll:
    """The pollers of one engine; ``touch()`` on every call's arrival (~0.3 us)."""

    def __init__(self, window_ms: float, cpus: Sequence[int] | None = None) -> None:
        if window_ms <= 0:
            raise ValueError("busy-poll window must be positive")
        self.cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
        fd = os.memfd_create("attention-busy-poll")
        try:
            os.ftruncate(fd, _STAMP.size)
            self._stamp = mmap.mmap(fd, _STAMP.size)
            _STAMP.pack_into(self._stamp, 0, 0.0)
            cmd = [sys.executable, "-m", "attention_service.engine.busy_poll",
                   "--stamp-fd", str(fd), "--window-ms", str(window_ms),
                   "--cpus", ",".join(map(str, self.cpus))]
            self._proc = subprocess.Popen(cmd, pass_fds=(fd,), stdin=subprocess.DEVNULL)
        finally:
            os.close(fd)
        log.info("busy poll: %d CPUs (%s) poll for %g ms after each call's arrival",
                 len(self.cpus), _cpu_list(self.cpus), window_ms)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def touch(self) -> None:
        _STAMP.pack_into(self._stamp, 0, time.monotonic())

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()  # the helper kills its pollers on the way out
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._stamp.close()


def _cpu_list(cpus: Sequence[int]) -> str:
    return ",".join(map(str, cpus)) if len(cpus) <= 8 else f"{cpus[0]}..{cpus[-1]}"


# ---- the helper process and its pollers ------------------------------------------------

def _poll(stamp: mmap.mmap, window: float, cpu: int, helper: int) -> None:
    """One poller: pinned to ``cpu`` at SCHED_IDLE; spins while the stamp is fresh."""
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    checked = time.monotonic()
    while True:
        now = time.monotonic()
        if now - _STAMP.unpack_from(stamp, 0)[0] < window:
            for _ in range(_SPIN_ROUNDS):
                pass
            continue
        if now - checked > _PARENT_CHECK_S:
            if os.getppid() != helper:
                return
            checked = now
        time.sleep(_IDLE_SLEEP_S)


def _helper(stamp_fd: int, window: float, cpus: Sequence[int]) -> int:
    engine, me = os.getppid(), os.getpid()
    stamp = mmap.mmap(stamp_fd, _STAMP.size, prot=mmap.PROT_READ)
    os.close(stamp_fd)
    kids: list[int] = []

    def stop(*_: object) -> None:
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in kids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the engine; it stops us
    for cpu in cpus:
        pid = os.fork()
        if pid == 0:  # a poller: the helper is single-threaded, so fork is safe here
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                _poll(stamp, window, cpu, me)
            finally:
                os._exit(0)
        kids.append(pid)
    while os.getppid() == engine:  # the engine died: take the pollers down
        time.sleep(_PARENT_CHECK_S)
    stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="busy-poll helper of an attention-server engine")
    p.add_argument("--stamp-fd", type=int, required=True)
    p.add_argument("--window-ms", type=float, required=True)
    p.add_argument("--cpus", required=True)
    args = p.parse_args(argv)
    cpus = [int(c) for c in args.cpus.split(",") if c]
    return _helper(args.stamp_fd, args.window_ms / 1e3, cpus)


if __name__ == "__main__":
    sys.exit(main())
