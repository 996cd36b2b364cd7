"""A model of the engine process's GIL traffic: how long one thread takes to make N short
calls that release the GIL (as the dispatcher's torch and Triton calls do) while channel
readers take messages in, with the readers as one thread per channel (the engine today) or
as one thread polling every channel (``selectors``). Diagnostic, not a benchmark of record.

    python benchmarks/probe_gil_contention.py [--channels 8] [--rate 4000] [--work-us 40]

A feeder process writes small messages to each channel at ``--rate`` messages/s in all; a
reader spends ``--work-us`` of pure-Python work per message (unpickling, building a job).
The issuer makes ``--calls`` calls of ``torch.empty`` back to back, again and again; the
table gives its time per round (mean, p90) alone and beside each kind of reader.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import selectors
import socket
import threading
import time

import numpy as np
import torch

_MSG = b"x" * 200


def _feed(socks: list[socket.socket], rate: float, stop: float) -> None:
    gap = len(socks) / rate  # each channel's gap
    nxt = [time.perf_counter() + i * gap / len(socks) for i in range(len(socks))]
    while time.perf_counter() < stop:
        i = int(np.argmin(nxt))
        wait = nxt[i] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        try:
            socks[i].send(_MSG)
        except OSError:
            return
        nxt[i] += gap


def _work(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def _reader_threads(socks: list[socket.socket], work_us: float) -> list[threading.Thread]:
    def loop(s: socket.socket) -> None:
        while True:
            try:
                data = s.recv(65536)
            except OSError:  # closed at the end of the run
                return
            if not data:
                return
            for _ in range(max(1, len(data) // len(_MSG))):
                _work(work_us)

    return [threading.Thread(target=loop, args=(s,), daemon=True) for s in socks]


def _reader_hub(socks: list[socket.socket], work_us: float) -> list[threading.Thread]:
    def loop() -> None:
        sel = selectors.DefaultSelector()
        for s in socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        open_socks = len(socks)
        while open_socks:
            for key, _ in sel.select():
                s = key.fileobj
                try:
                    data = s.recv(65536)  # type: ignore[union-attr]
                except BlockingIOError:
                    continue
                except OSError:  # closed at the end of the run
                    return
                if not data:
                    sel.unregister(s)
                    open_socks -= 1
                    continue
                for _ in range(max(1, len(data) // len(_MSG))):
                    _work(work_us)

    return [threading.Thread(target=loop, daemon=True)]


def _issue(calls: int, seconds: float) -> np.ndarray:
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.empty(16)
        times.append(time.perf_counter() - t0)
    return np.array(times) * 1e6


def _run(mode: str, args: argparse.Namespace) -> np.ndarray:
    if mode == "alone":
        return _issue(args.calls, args.seconds)
    pairs = [socket.socketpair() for _ in range(args.channels)]
    mine, theirs = [a for a, _ in pairs], [b for _, b in pairs]
    stop = time.perf_counter() + args.seconds + 1.0
    feeder = mp.get_context("fork").Process(target=_feed, args=(theirs, args.rate, stop))
    feeder.start()
    for s in theirs:
        s.close()
    make = _reader_threads if mode == "threads" else _reader_hub
    readers = make(mine, args.work_us)
    for t in readers:
        t.start()
    time.sleep(0.3)
    times = _issue(args.calls, args.seconds)
    feeder.join()
    for s in mine:
        s.close()
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--channels", type=int, default=8)
    p.add_argument("--rate", type=float, default=4000.0, help="messages/s over all channels")
    p.add_argument("--work-us", type=float, default=40.0, help="Python work per message")
    p.add_argument("--calls", type=int, default=25, help="GIL-releasing calls per round")
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{os.cpu_count()} cpus; {args.channels} channels, {args.rate:.0f} msg/s, "
          f"{args.work_us:.0f} us of work each; {args.calls} torch.empty calls per round")
    print(f"{'readers':>10}  {'rounds':>7}  {'mean us':>9}  {'p90 us':>9}")
    for mode in ("alone", "threads", "hub"):
        t = _run(mode, args)
        print(f"{mode:>10}  {t.size:7d}  {t.mean():9.0f}  {np.percentile(t, 90):9.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
