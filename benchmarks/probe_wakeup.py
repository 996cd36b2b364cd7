"""What a wake-up costs on this host: a ping-pong between two processes over an AF_UNIX
socketpair (the front end <-> engine channel's transport), with the pinging side idle for
``--gaps`` microseconds before each ping (as a 1-client decode step leaves every process of
the server asleep between steps), and each side either blocking in ``recv`` or spinning on
``recv(MSG_DONTWAIT)`` while it waits.

    python benchmarks/probe_wakeup.py [--pings 2000] [--gaps 0,200,1000] [--out DIR]

Prints the median and p90 round trip (us) per (gap, pinger wait, ponger wait). The difference
between a blocking and a spinning side is what one wake-up of that side costs here.
Diagnostic: it decides whether spinning a waiting thread is worth its CPU, nothing more.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time
from pathlib import Path

SPIN_LIMIT_S = 0.05  # a spinning side gives up and blocks after this (never hit in a run)


def _recv(sock: socket.socket, spin: bool) -> bytes:
    if spin:
        end = time.perf_counter() + SPIN_LIMIT_S
        while time.perf_counter() < end:
            try:
                return sock.recv(64, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
    return sock.recv(64)


def _ponger(sock: socket.socket, spin: bool) -> None:
    while True:
        data = _recv(sock, spin)
        if not data or data == b"q":
            return
        sock.send(data)


def _idle(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


def run(pings: int, gap_us: float, spin_ping: bool, spin_pong: bool) -> dict[str, float]:
    a, b = socket.socketpair()
    child = mp.get_context("fork").Process(target=_ponger, args=(b, spin_pong), daemon=True)
    child.start()
    b.close()
    rtts = []
    for i in range(pings + 50):
        _idle(gap_us * 1e-6)
        t0 = time.perf_counter()
        a.send(b"p")
        _recv(a, spin_ping)
        if i >= 50:
            rtts.append((time.perf_counter() - t0) * 1e6)
    a.send(b"q")
    child.join(5)
    a.close()
    rtts.sort()
    return {"median_us": statistics.median(rtts), "p90_us": rtts[int(0.9 * len(rtts))]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pings", type=int, default=2000)
    p.add_argument("--gaps", default="0,200,1000", help="idle microseconds before each ping")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rows = []
    print("| gap us | pinger | ponger | median us | p90 us |\n|---|---|---|---|---|")
    for gap in (float(g) for g in args.gaps.split(",")):
        for spin_ping, spin_pong in ((False, False), (True, False), (False, True), (True, True)):
            r = run(args.pings, gap, spin_ping, spin_pong)
            row = {"gap_us": gap, "pinger": "spin" if spin_ping else "block",
                   "ponger": "spin" if spin_pong else "block", **r}
            rows.append(row)
            print(f"| {gap:.0f} | {row['pinger']} | {row['ponger']} | {r['median_us']:.1f} | "
                  f"{r['p90_us']:.1f} |", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_wakeup.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
