"""Where one server process's CPU goes while it moves large gRPC payloads: the aggregate load
of bench_roundtrip.py against a single-process server of this tree (``--frontends 1``) and,
with ``--baseline-tree DIR``, against that earlier tree's server, in turn. Diagnostic, not a
benchmark of record.

For each server: GB/s (bytes in + out), the server's CPU in cores and in CPU-seconds per GB,
its CPU per thread name (gRPC's own threads against the Python one), and a py-spy profile of
its Python (summarised: ``pyspy_summary.py``).

    python benchmarks/profile_aggregate.py --out DIR --baseline-tree /tmp/base \\
        [--clients 8] [--tokens 2048] [--seconds 8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_roundtrip import DTYPES, aggregate, baseline_env, primed_server
from pyspy_summary import summarise


def _threads(pid: int) -> Counter[str]:
    """CPU seconds per thread name of process ``pid``."""
    out: Counter[str] = Counter()
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[comm] += (int(fields[11]) + int(fields[12])) / tick
    return out


def profile(label: str, cmd: list[str], env: dict[str, str], cwd: Path, args: Any) -> str:
    with primed_server(cmd, env, cwd, args.device, args.tokens, args.heads, args.head_dim,
                       args.dtype) as (proc, target):
        result: dict[str, Any] = {}

        def load() -> None:
            result.update(aggregate(target, args.clients, args.tokens, args.heads,
                                    args.head_dim, args.dtype, args.seconds))

        runner = threading.Thread(target=load)
        runner.start()
        time.sleep(2.0 + 0.3 * args.clients + 1.0)  # the load's start-up, then 1 s into it
        window = max(1.0, args.seconds - 2.0)
        spy = shutil.which("py-spy") or next(
            (p for p in ("/tmp/site/bin/py-spy",) if os.path.exists(p)), None)
        raw = args.out / f"pyspy_{label}.txt"
        prof = None
        if spy:
            prof = subprocess.Popen(
                [spy, "record", "-p", str(proc.pid), "-d", str(int(window)), "-r", "250",
                 "-f", "raw", "-o", str(raw), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        c0, t0 = _threads(proc.pid), time.time()
        time.sleep(window)
        c1, dt = _threads(proc.pid), time.time() - t0
        if prof is not None:
            prof.wait(60)
        runner.join()
    cores = {name: (c1[name] - c0.get(name, 0.0)) / dt for name in c1}
    total = sum(cores.values())
    gbps = result["GBps"]
    lines = [f"{label}: {gbps:.2f} GB/s with {args.clients} clients; server CPU {total:.2f} "
             f"cores = {total / gbps:.2f} CPU-s per GB" if gbps else f"{label}: no load"]
    lines += [f"    {v:5.2f}  {k}" for k, v in sorted(cores.items(), key=lambda kv: -kv[1])
              if v >= 0.01]
    text = "\n".join(lines)
    if raw.exists():
        (args.out / f"pyspy_{label}_summary.txt").write_text(summarise(raw.read_text()))
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--baseline-tree", type=Path, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--seconds", type=float, default=8.0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    runs = [("frontends1", [sys.executable, "-m", "attention_service", "--frontends", "1"],
             env, ROOT)]
    if args.baseline_tree is not None:
        tree = args.baseline_tree
        base = ("baseline", [sys.executable, "-m", "attention_service"],
                baseline_env(tree, env), tree)
        runs = [base, *runs, base]
    texts = []
    for i, (label, cmd, e, cwd) in enumerate(runs):
        texts.append(profile(f"{label}_{i}", cmd, e, cwd, args))
        print(texts[-1], flush=True)
    (args.out / "profile_aggregate.txt").write_text("\n".join(texts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
