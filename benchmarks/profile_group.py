"""Where a process group's CPU goes under load: per-process CPU (engine, each front end, load
workers) and py-spy profiles (GIL holders) of the engine and one front end, while
bench_service.py drives it. Diagnostic, not a benchmark of record.

    python benchmarks/profile_group.py --out DIR [--path shm] [--frontends 8] [--batching on]
    python benchmarks/profile_group.py --out DIR --load sessions --clients 64   # KV-cache steps

Each py-spy profile is also summarised (``pyspy_summary.py``: top functions by own and by
inclusive samples) beside the raw file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_service import _children, _free_port, _healthy
from pyspy_summary import summarise

_SPY_SECONDS, _SPY_RATE = 6, 250


def _cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")[:90]
    except OSError:
        return "?"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--path", default="shm")
    p.add_argument("--frontends", type=int, default=8, help="0 = the server's auto count")
    p.add_argument("--batching", default="on")
    p.add_argument("--device", default="auto")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--load", default="service", choices=["service", "sessions"],
                   help="bench_service.py requests, or bench_sessions.py decode steps")
    p.add_argument("--load-arg", action="append", default=[], metavar="ARG",
                   help="passed on to the load tool, e.g. --load-arg=--context=256 (repeat)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    port, mport = _free_port(), _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "attention_service", "--host", "127.0.0.1", "--port", str(port),
         "--metrics-port", str(mport), "--device", args.device, "--frontends",
         str(args.frontends), "--log-level", "WARNING",
         "--batching" if args.batching == "on" else "--no-batching"], cwd=ROOT)
    target = f"127.0.0.1:{port}"
    while not _healthy(target):
        if server.poll() is not None:
            print(f"server exited ({server.returncode}) before SERVING")
            return 1
        time.sleep(0.5)
    if args.load == "sessions":
        cmd = ["bench_sessions.py", "--target", target, "--sides", "on", "--warmup", "3",
               "--clients", str(args.clients), "--duration", str(args.seconds)]
    else:
        cmd = ["bench_service.py", "--target", target, "--metrics-url",
               f"http://127.0.0.1:{mport}/metrics", "--clients", str(args.clients), "--duration",
               str(args.seconds), "--warmup", "3", "--prime", "3", "--verify", "0", "--path",
               args.path]
    cmd += args.load_arg
    tag = f"{args.load}_{args.clients}_{args.batching}"
    load = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / cmd[0]), *cmd[1:], "--out",
         "/tmp/profile_load"], cwd=ROOT,
        stdout=open(args.out / f"profile_load_{tag}.log", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT)
    time.sleep(9.0)  # workers up, priming done, measuring
    pids = [server.pid, *_children(server.pid)]
    workers = [c for c in _children(load.pid)]
    # The busiest front end: with few clients most front ends sit idle (the first child may
    # have no samples at all).
    before = {pid: _cpu(pid) for pid in pids}
    time.sleep(1.0)
    busy = max(pids[1:], key=lambda pid: _cpu(pid) - before[pid], default=None)
    c0 = {pid: _cpu(pid) for pid in pids + workers}
    spy = shutil.which("py-spy") or next(
        (p for p in ("/tmp/site/bin/py-spy",) if os.path.exists(p)), None)
    profs = []
    if spy:
        for pid, who in ((server.pid, "engine"), (busy, "frontend")):
            if pid is None:
                continue
            profs.append(subprocess.Popen(
                [spy, "record", "-p", str(pid), "-d", str(_SPY_SECONDS), "-r", str(_SPY_RATE),
                 "--gil", "--threads", "-f", "raw", "-o", str(args.out / f"pyspy_{who}_{tag}.txt"),
                 "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    t0 = time.time()
    time.sleep(6.0)
    c1 = {pid: _cpu(pid) for pid in c0}
    dt = time.time() - t0
    for pr in profs:
        pr.wait(60)
    for raw in sorted(args.out.glob(f"pyspy_*_{tag}.txt")):
        text = raw.read_text()
        held = sum(int(line.rpartition(" ")[2]) for line in text.splitlines()
                   if line.rpartition(" ")[2].isdigit())
        # --gil keeps only samples where some thread holds the GIL: their share of all the
        # samples taken is how busy the process's GIL was.
        busy = f"GIL held in {held} of ~{_SPY_SECONDS * _SPY_RATE} samples " \
               f"({100 * held / (_SPY_SECONDS * _SPY_RATE):.0f}%)\n"
        (raw.parent / f"{raw.stem}_summary.txt").write_text(busy + summarise(text))
    load.wait(120)
    lines = [f"{args.load} load, batching {args.batching}, path {args.path}, "
             f"{args.frontends} front ends, {args.clients} clients; CPU over {dt:.1f} s (cores):"]
    for pid in pids + workers:
        lines.append(f"  {100 * (c1[pid] - c0[pid]) / dt:6.0f}%  {pid}  {_name(pid)}")
    text = "\n".join(lines)
    print(text)
    (args.out / f"profile_cpu_{tag}.txt").write_text(text + "\n")
    print((args.out / f"profile_load_{tag}.log").read_text()[-600:])
    server.terminate()
    server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
