"""Envoy's cost on a decode step (issue 64): one replica, one client, direct and via Envoy.

Starts one replica (``python -m attention_service``) and one Envoy over it
(deploy/envoy/envoy.yaml through deploy/envoy/local_envoy.py), each on the CPUs given. The
client (this process) holds a cache per path (``client.kv_cache``, a ``--context``-token cache
of one sequence each, its session header on every call) and steps them on kept-open
``decode_steps()`` streams (``--batch`` sequences, ``store=False``), in blocks of ``--steps``:

- ``direct``: to the replica's port;
- ``envoy``: through Envoy;
- ``envoy, CPUs awake`` (``--keep-awake``): through Envoy while ``attention-keep-awake`` keeps
  Envoy's CPUs out of idle halt (started before the block, stopped after it).

Rounds alternate the order of the blocks, and each round compares its own blocks (a host's
drift moves all of a round alike): the table has each block's p50, and the median over rounds
of each path's p50 and of its paired difference to ``direct``.

    python benchmarks/bench_envoy_step.py --server-cpus 0-7 --client-cpus 8-11 \\
        --envoy-cpus 12-15 --keep-awake --rounds 16 --out benchmarks/results/envoy
    python benchmarks/bench_envoy_step.py --device cpu --heads 2 --kv-heads 1 --head-dim 16 \\
        --context 32 --rounds 2 --steps 20 --warmup 5 --keep-awake --envoy-cpus 0 --out /tmp/e
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from attention_wire import grpc_defaults

grpc_defaults.apply()  # the client library's grpc I/O settings, before grpc loads

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy" / "envoy"))
from bench_service import Server, _free_port, cpu_list, server_info  # noqa: E402
from bench_sessions import ELEM, add_shape_args  # noqa: E402
from local_envoy import LocalEnvoy  # noqa: E402

from attention_client import AttentionClient  # noqa: E402
from attention_service.engine.dtypes import TORCH_DTYPES  # noqa: E402

DIRECT, ENVOY, AWAKE = "direct", "envoy", "envoy, CPUs awake"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.set_defaults(device="cuda", context=1024)
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--server-cpus", help="the replica's CPUs (taskset list); default: unpinned")
    p.add_argument("--client-cpus", help="this process's CPUs")
    p.add_argument("--envoy-cpus", help="Envoy's CPUs (and what --keep-awake keeps awake)")
    p.add_argument("--envoy-concurrency", type=int, default=2, help="Envoy worker threads")
    p.add_argument("--keep-awake", action="store_true",
                   help="a third path: through Envoy with its CPUs (--envoy-cpus) kept awake")
    p.add_argument("--server-args", help="more flags for the replica")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--steps", type=int, default=400, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=100, help="untimed steps per path, once")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", default="benchmarks/results/envoy")
    p.set_defaults(frontends=None, max_batch_tokens=None, max_queue_delay_ms=None,
                   server_log_level="WARNING")
    args = p.parse_args(argv)
    if args.keep_awake and not args.envoy_cpus:
        p.error("--keep-awake keeps Envoy's CPUs awake: give them (--envoy-cpus)")
    return args


@contextlib.contextmanager
def kept_awake(cpus: str) -> Iterator[None]:
    """``attention-keep-awake --cpus CPUS`` for the block: from when its spinners run at
    SCHED_IDLE (its first line) to its end; RuntimeError if it did not start or died meanwhile
    (the block would not have been what it says)."""
    with subprocess.Popen([sys.executable, "-m", "attention_service.keep_awake", "--cpus", cpus],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            if "keeping CPUs" not in line:
                raise RuntimeError(f"attention-keep-awake did not start: {line}"
                                   f"{proc.stderr.read() if proc.stderr else ''}")
            yield
            if proc.poll() is not None:
                raise RuntimeError(f"attention-keep-awake exited ({proc.returncode}) "
                                   "during the block")
        finally:
            proc.terminate()
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def round_order(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order of the paths: rotated by one each round, and every other cycle of
    rotations reversed, so each path takes each place equally often (2 paths: AB, BA, BA,
    AB; 3: all six orders in six rounds)."""
    n = len(names)
    turned = names[r % n:] + names[:r % n]
    return turned[::-1] if (r // n) % 2 else turned


class Side:
    """One path's client, cache and step stream."""

    def __init__(self, target: str, args: argparse.Namespace, gen: torch.Generator) -> None:
        dtype = TORCH_DTYPES[ELEM[args.dtype][0]]
        self.client = AttentionClient(target)
        self.cache = self.client.kv_cache(num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                                          dtype=dtype)
        self.ids = [f"seq-{i}-{time.time_ns()}" for i in range(args.batch)]
        k, v = (torch.randn(args.batch * args.context, args.kv_heads, args.head_dim,
                            generator=gen).to(dtype) for _ in "kv")
        self.cache.append(self.ids, k, v, torch.arange(args.batch + 1, dtype=torch.int32)
                          * args.context)
        self.q = torch.randn(args.batch, args.heads, args.head_dim, generator=gen).to(dtype)
        self.steps = self.client.decode_steps(metadata=self.cache.session_metadata)

    def block(self, n: int) -> list[float]:
        """Seconds of each of ``n`` steps."""
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.steps.step(self.q, self.ids)
            times.append(time.perf_counter() - t0)
        return times

    def close(self) -> None:
        self.steps.close()
        self.cache.release()
        self.client.close()


def _ms(times: list[float], q: float) -> float:
    return float(np.quantile(times, q)) * 1e3


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ns = argparse.Namespace(**{**vars(args), "server_args": (
        "--gpu 0 " if args.device == "cuda" else "") + (args.server_args or "")})
    server = Server(ns, True, out_dir / "bench_envoy_step_server.log")
    envoy = None
    paths: dict[str, Side] = {}
    rows: list[dict[str, Any]] = []
    try:
        port = int(server.target.rsplit(":", 1)[1])
        envoy = LocalEnvoy([("127.0.0.1", port)], _free_port(), _free_port(),
                           args.envoy_concurrency,
                           cpu_list(args.envoy_cpus) if args.envoy_cpus else None)
        envoy.wait_healthy(1, 60)
        if args.client_cpus:
            os.sched_setaffinity(0, cpu_list(args.client_cpus))
        info = server_info(server.target)
        gen = torch.Generator().manual_seed(0)
        paths[DIRECT] = Side(server.target, args, gen)  # one by one: each made is closed
        paths[ENVOY] = Side(envoy.target, args, gen)
        names = [DIRECT, ENVOY] + ([AWAKE] if args.keep_awake else [])
        for name in paths:
            paths[name].block(args.warmup)
        for r in range(args.rounds):
            row: dict[str, Any] = {"round": r + 1}
            for name in round_order(names, r):
                path = paths[ENVOY if name == AWAKE else name]
                with kept_awake(args.envoy_cpus) if name == AWAKE else contextlib.nullcontext():
                    times = path.block(args.steps)
                row[name] = {"p50_ms": _ms(times, 0.5), "p99_ms": _ms(times, 0.99)}
            rows.append(row)
            print(f"round {r + 1:3d}: " + "  ".join(
                f"{n} {row[n]['p50_ms']:.3f}" for n in names), flush=True)
    finally:
        for path in paths.values():
            with contextlib.suppress(Exception):
                path.close()
        if envoy is not None:
            envoy.close()
        server.stop()
    summary = {n: {"p50_ms": statistics.median(x[n]["p50_ms"] for x in rows),
                   "p99_ms": statistics.median(x[n]["p99_ms"] for x in rows)} for n in names}
    for n in names[1:]:
        diffs = [x[n]["p50_ms"] - x[DIRECT]["p50_ms"] for x in rows]
        summary[n].update(over_direct_ms=statistics.median(diffs),
                          rounds_slower=sum(d > 0 for d in diffs))
    lines = [
        f"# bench_envoy_step: {info.device}, {datetime.now(timezone.utc):%Y-%m-%d}", "",
        f"`python benchmarks/bench_envoy_step.py {shlex.join(argv or sys.argv[1:])}`", "",
        f"One replica, one client, B={args.batch} steps ({args.dtype} H{args.heads}/"
        f"{args.kv_heads} D{args.head_dim}, context {args.context}, store=False) on kept-open "
        f"streams; {args.rounds} rounds of {args.steps} steps per path, orders alternated; "
        f"Envoy: deploy/envoy/envoy.yaml, {args.envoy_concurrency} workers"
        + (f", CPUs {args.envoy_cpus}" if args.envoy_cpus else "") + ".", "",
        "| path | p50 ms (median of rounds) | p99 ms | p50 over direct, paired (median) | "
        "rounds slower than direct |", "|---|---|---|---|---|"]
    for n in names:
        s = summary[n]
        lines.append(f"| {n} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | "
                     + (f"{s['over_direct_ms']:+.3f} | {s['rounds_slower']} of {len(rows)} |"
                        if n != DIRECT else "- | - |"))
    table = "\n".join(lines) + "\n"
    print(table)
    stem = out_dir / "bench_envoy_step"
    stem.with_suffix(".md").write_text(table)
    stem.with_suffix(".json").write_text(json.dumps(
        {"command": shlex.join(argv or sys.argv[1:]), "device": info.device,
         "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
         "config": vars(args), "rows": rows, "summary": summary}, indent=2) + "\n")
    print(f"wrote {stem}.{{md,json}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
