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
from dataclasses import dataclass

_ESTABLISHED = 1
_FRONTEND_MODULE = b"attention_service.ipc.frontend_main"


def _established(port: int) -> dict[int, int]:
    """Socket inode -> remote port of the established TCP connections whose local port is
    ``port``."""
    found: dict[int, int] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for row in f:
                    cols = row.split()
                    if (int(cols[3], 16) == _ESTABLISHED
                            and int(cols[1].rsplit(":", 1)[1], 16) == port):
                        found[int(cols[9])] = int(cols[2].rsplit(":", 1)[1], 16)
        except (FileNotFoundError, StopIteration):
            continue
    return found


def _established_inodes(port: int) -> set[int]:
    """Socket inodes of the established TCP connections whose local port is ``port``."""
    return set(_established(port))


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
            except FileNotFoundError:  # the thread ended meanwhile
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


def frontend_pids() -> list[int]:
    """This process and its sibling front ends (children of the same engine running
    ``ipc.frontend_main``; the engine's other children, such as compile workers, are not)."""
    pids = []
    for pid in _children(os.getppid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if _FRONTEND_MODULE in f.read():
                    pids.append(pid)
        except OSError:  # gone meanwhile
            continue
    return pids


@dataclass(frozen=True)
class Spread:
    """One count: the connections this front end holds, the fewest any front end of its group
    holds, and the remote ports of this front end's connections in one fixed order (by socket
    inode), the same for every asker that shares the count."""

    held: int
    fewest: int
    peers: tuple[int, ...]

    def rank(self, peer_port: int) -> int:
        """The 1-based place of the connection from ``peer_port`` in that order; 0 when it
        is not there or not alone (two hosts' connections from one port number)."""
        return self.peers.index(peer_port) + 1 if self.peers.count(peer_port) == 1 else 0


def spread(port: int) -> Spread | None:
    """How the group's connections on ``port`` are spread, seen from this process; None when
    /proc cannot tell."""
    try:
        live = _established(port)
        pids = frontend_pids()
    except OSError:
        return None
    counts = {}
    mine: set[int] = set()
    for pid in pids:
        try:
            held = _socket_inodes(pid) & live.keys()
        except OSError:  # gone meanwhile (a front end being replaced), or hidden from us
            continue
        counts[pid] = len(held)
        if pid == os.getpid():
            mine = held
    if os.getpid() not in counts:
        return None
    return Spread(counts[os.getpid()], min(counts.values()),
                  tuple(live[inode] for inode in sorted(mine)))


def peer_port(peer: str) -> int:
    """The client's port of a gRPC peer string ("ipv4:127.0.0.1:5432", "ipv6:[::1]:5432");
    0 for other transports."""
    if peer.startswith(("ipv4:", "ipv6:")):
        tail = peer.rsplit(":", 1)[1]
        if tail.isdigit():
            return int(tail)
    return 0
