"""``attention-keep-awake``: keep CPUs out of idle halt, for the hops of a latency-bound call.

Why: a guest kernel with no cpuidle driver (Firecracker, many cloud VMs; the H200 hosts here
show ``current_driver: none``) halts an idle vCPU, an exit to the hypervisor, and a thread woken
there waits for the vCPU to be resumed. Envoy in front of a replica adds two such wake-ups to
each decode step (a worker wakes for the step, and again for its answer): on an H200 host
(16 vCPUs) a one-client B=1 step took +0.18-0.20 ms through Envoy on CPUs of its own, and
+0.04-0.11 ms with those CPUs kept awake by this tool (``bench_envoy_step.py``, two runs;
benchmarks/results/envoy).

How: one process per CPU, pinned there, at ``SCHED_IDLE`` (below every nice level: the
scheduler runs it only when nothing else wants that CPU, and preempts it at once for a woken
thread), spinning. The CPU then never halts. The price is the idle time itself: those CPUs draw
power as if busy and, where they share a core with a hyperthread sibling, take some of the
sibling's throughput. So keep it to the few CPUs a latency-bound process is pinned to (Envoy's,
``taskset`` / a cpuset). Where you control the kernel, the same effect without a process:
``idle=poll``, the ``cpuidle-haltpoll`` driver (KVM guests), or a latency tuned profile
(``/dev/cpu_dma_latency``; it has no idle state to forbid where no cpuidle driver is loaded).

    attention-keep-awake --cpus 12-15        # until SIGTERM / Ctrl-C; exits 0
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterable

from attention_service.cpus import allowed_cpus, format_cpu_list, parse_cpu_list

_PR_SET_PDEATHSIG = 1
_READY_S = 5.0  # a spinner's switch to SCHED_IDLE is microseconds; a loaded host, longer


class _Stop(Exception):
    """SIGTERM / SIGINT in the parent."""


def _spin(cpu: int, parent: int) -> None:
    """A child's whole life: pinned to ``cpu``, at SCHED_IDLE, busy until killed."""
    with contextlib.suppress(OSError, AttributeError):  # gone with its parent, even a kill -9
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # it died before the line above: no signal will come
        os._exit(0)
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends it (a Ctrl-C reaches both)
    while True:
        pass


def start(cpus: Iterable[int], pids: list[int]) -> None:
    """Fork one spinner per CPU, each pid into ``pids`` as it starts (a signal mid-way leaves
    the caller every one to stop); back once every spinner runs at SCHED_IDLE. This process
    moves onto those CPUs first (widening a parent's ``taskset`` where the cgroup's cpuset
    allows), so a CPU it may not run on is refused (ValueError naming it) before any starts."""
    cpus = sorted(set(cpus))
    with contextlib.suppress(OSError):  # none of them allowed: the check below names them
        os.sched_setaffinity(0, cpus)
    allowed = allowed_cpus()
    outside = [c for c in cpus if c not in allowed]
    if not cpus or outside:
        raise ValueError(f"--cpus: {format_cpu_list(outside) or 'none given'} not among the "
                         f"CPUs this process may use ({format_cpu_list(allowed)})")
    parent = os.getpid()
    for cpu in cpus:
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child never returns)
            try:
                _spin(cpu, parent)
            finally:
                os._exit(1)
        pids.append(pid)
    end = time.monotonic() + _READY_S
    for pid in pids:
        while os.sched_getscheduler(pid) != os.SCHED_IDLE:
            if time.monotonic() > end:
                raise OSError(f"spinner {pid} is not at SCHED_IDLE after {_READY_S:g} s")
            time.sleep(0.001)


def stop(pids: Iterable[int]) -> None:
    """Kill and reap the spinners."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="attention-keep-awake",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--cpus", required=True,
                   help="CPUs to keep awake, a taskset list such as 12-15 (e.g. Envoy's)")
    args = p.parse_args(argv)

    def finish(signum: int, frame: object) -> None:
        raise _Stop  # out of the wait below (PEP 475 would retry it)

    pids: list[int] = []
    signal.signal(signal.SIGTERM, finish)
    signal.signal(signal.SIGINT, finish)
    try:
        try:
            start(parse_cpu_list(args.cpus), pids)
        except (ValueError, OSError) as exc:
            print(f"attention-keep-awake: {exc}", file=sys.stderr)
            return 2
        print(f"keeping CPUs {args.cpus} awake ({len(pids)} SCHED_IDLE spinners)", flush=True)
        pid, _ = os.waitpid(-1, 0)  # returns only if a spinner dies: a fault, exit 1
        pids.remove(pid)  # reaped: its number may be another process's by now
        print(f"attention-keep-awake: spinner {pid} exited", file=sys.stderr)
        return 1
    except _Stop:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut this short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop(pids)


if __name__ == "__main__":
    sys.exit(main())
