"""How the connections on the shared port are spread over a group's front-end processes.

The kernel hashes each new connection to one of the processes that share the port
(SO_REUSEPORT): 8 long-lived connections over 8 front ends leave about 3 of them idle on
average, and the clients that share a front end share its one Python thread (measured: 8
clients made 8.07 GB/s with their connections on 6 front ends, 5.87 on 4; results README,
issue 10, sixth session). gRPC tells a server nothing about its connections, but /proc does:
a front end's established sockets on the port are its connections. Linux only; elsewhere (or
where /proc hides other processes) ``spread`` answers None. A count reads the host's whole
TCP table (about 5 ms on a quiet host, more with many sockets), so the servicer rations it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

_ESTABLISHED = 1
_FRONTEND_MODULE = b"attention_service.ipc.frontend_main"


def _established_inodes(port: int) -> set[int]:
    """Socket inodes of the established TCP connections whose local port is ``port``."""
    inodes: set[int] = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for row in f:
                    cols = row.split()
                    if (int(cols[3], 16) == _ESTABLISHED
                            and int(cols[1].rsplit(":", 1)[1], 16) == port):
                        inodes.add(int(cols[9]))
        except (FileNotFoundError, StopIteration):
            continue
    return inodes


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _children(pid: int) -> Iterator[int]:
    """``pid``'s children: each thread's ``children`` file lists those that thread forked
    while it lives, so all are read (today the engine forks front ends on its main thread;
    this keeps the count right if a helper thread ever does)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
            raise FileNotFoundError
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    yield from (int(c) for c in f.read().split())
            except OSError:  # the thread ended meanwhile
                continue
    except FileNotFoundError:  # a kernel without the children file: scan every process
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                            yield int(entry)
                except (OSError, IndexError, ValueError):
                    continue


def frontend_pids(engine: int | None = None) -> list[int]:
    """The front ends of ``engine``'s group (default: this process's parent, so this process
    and its siblings): its children running ``ipc.frontend_main`` (its other children, such
    as compile workers, are not)."""
    pids = []
    for pid in _children(os.getppid() if engine is None else engine):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if _FRONTEND_MODULE in f.read():
                    pids.append(pid)
        except OSError:  # gone meanwhile
            continue
    return pids


def counts(port: int, pids: list[int]) -> dict[int, int]:
    """Established connections on ``port`` per process of ``pids`` (those /proc shows)."""
    live = _established_inodes(port)
    held = {}
    for pid in pids:
        try:
            held[pid] = len(_socket_inodes(pid) & live)
        except OSError:  # gone meanwhile (a front end being replaced), or hidden from us
            continue
    return held


def spread(port: int) -> tuple[int, int] | None:
    """(connections this process holds on ``port``, the fewest any front end of its group
    holds), or None when /proc cannot tell."""
    try:
        held = counts(port, frontend_pids())
    except OSError:
        return None
    if os.getpid() not in held:
        return None
    return held[os.getpid()], min(held.values())
