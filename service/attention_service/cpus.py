"""Where the process group runs: the engine on a few CPUs of its own, the front ends on the rest
(``--engine-cpus``, ``--frontend-cpus``).

Why: the engine's dispatcher releases the GIL in every torch and Triton call of a launch and
must take it back behind the channel readers and the completer; each hand-off waits for the
OS to run the waiting thread. Under 64 clients of small prefills on a 16-vCPU H200 host
(8 front ends and the load generator busy on ~10 of the 16 CPUs) a batch took 3.5-4.0 ms to
issue, against 0.3 ms for the same launch in a quiet process
(git history: ``benchmarks/probe_issue.py``).
Placed as ``--engine-cpus 0-2`` places it (front ends on 3-15), with the load generator
unpinned on the same host, batching on served 4187 / 4873 req/s against 3862 / 3597 not
placed, the launch issue at 2.5-3.0 ms against 3.6-3.9; batching off 1433 against 1381. Given
CPUs 0-10 and placed by auto (the load on 11-15): 4406 / 4392 against 3891 not placed (fresh
servers interleaved; git history: benchmarks/results/issue10/2026-11-28e/, calls 4 and 5).

``auto`` places the group only where it was given CPUs of its own: a set narrower than the
host's (a container's cpuset, a Kubernetes exclusive-CPU pod, ``taskset``) of at least
``AUTO_MIN_CPUS`` usable CPUs. There the engine takes the lowest ``AUTO_ENGINE_CPUS`` of them
(one each for the dispatcher, the completer and a polling reader) and the front ends the
others. On the whole host it does nothing: another server on the same host (one per GPU, say)
would pick the same lowest CPUs, and several engines on three CPUs is far worse than none
placed. There an operator who knows the host is the server's gives lists
(``--engine-cpus 0-2``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import NamedTuple

# Measured placed at 11 and 16 CPUs (engine 3, front ends 8 and 13). With fewer, 3 CPUs are a
# large share to take from 8 front ends that used ~70% of a core each under that load: untested,
# so not placed.
AUTO_MIN_CPUS = 10
AUTO_ENGINE_CPUS = 3


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-2,5"`` -> {0, 1, 2, 5} (the ``taskset -c`` / cpuset syntax); ValueError if bad."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"not a CPU list: {text!r} (expected e.g. 0-2,5)") from None
        if first < 0 or last < first:
            raise ValueError(f"not a CPU list: {text!r} (expected e.g. 0-2,5)")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 5} -> ``"0-2,5"``."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive CPUs
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def check_setting(name: str, value: str, keywords: tuple[str, ...]) -> None:
    """Config validation: ``value`` is one of ``keywords`` or a CPU list."""
    if value in keywords:
        return
    try:
        parse_cpu_list(value)
    except ValueError as exc:
        words = "".join(f"{k!r}, " for k in keywords if k)
        empty = " (or empty)" if "" in keywords else ""
        raise ValueError(f"{name} must be {words}a CPU list such as 0-2,5{empty}: {exc}"
                         ) from None


class Placement(NamedTuple):
    """CPUs for the engine process and for each front-end process (None: left as they are)."""

    engine: frozenset[int] | None
    frontends: frozenset[int] | None

    def describe(self) -> str:
        if self.engine is None and self.frontends is None:
            return "not placed"
        return (f"engine on CPUs {format_cpu_list(self.engine) if self.engine else 'any'}, "
                f"front ends on CPUs "
                f"{format_cpu_list(self.frontends) if self.frontends else 'any'}")


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        return frozenset(range(os.cpu_count() or 1))


def host_cpus() -> int:
    """The host's CPUs (online), whatever this process may use."""
    return os.cpu_count() or 1


def placement(engine_cpus: str, frontend_cpus: str, allowed: frozenset[int], usable: int,
              host: int, group: bool = True) -> Placement:
    """What ``--engine-cpus`` / ``--frontend-cpus`` resolve to, given the CPUs this process may
    use (``allowed``), how many it may keep busy (``usable``: a CPU quota may be lower) and the
    host's count (``host``: auto places only inside a narrower set).
    ``group``: the process group (False: one process, where only an explicit engine list
    applies). ValueError names the setting when a list reaches outside ``allowed``."""

    def checked(flag: str, text: str) -> frozenset[int]:
        cpus = parse_cpu_list(text)
        outside = cpus - allowed
        if outside:
            raise ValueError(f"{flag}: CPU {format_cpu_list(outside)} is not among the CPUs "
                             f"this process may use ({format_cpu_list(allowed)})")
        return cpus

    engine: frozenset[int] | None = None
    if engine_cpus == "auto":
        if group and len(allowed) < host and min(usable, len(allowed)) >= AUTO_MIN_CPUS:
            engine = frozenset(sorted(allowed)[:AUTO_ENGINE_CPUS])
    elif engine_cpus != "none":
        engine = checked("--engine-cpus", engine_cpus)
    if not group:
        return Placement(engine, None)
    frontends: frozenset[int] | None = None
    if frontend_cpus:
        frontends = checked("--frontend-cpus", frontend_cpus)
    elif engine is not None:
        # Front ends start as the engine's children: without a set of their own they would
        # keep the engine's CPUs once it is placed. The rest, or everything if nothing is left.
        frontends = (allowed - engine) or allowed
    return Placement(engine, frontends)


def pin_process(cpus: frozenset[int]) -> None:
    """Run every thread of this process on ``cpus`` from now on (threads started later
    inherit their creator's set). ``os.sched_setaffinity(0)`` would move the calling thread
    alone."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)
