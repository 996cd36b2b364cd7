"""Replicas behind Envoy: what a second GPU adds (issue 64's aggregate target).

Starts one replica per GPU (``python -m attention_service --gpu I``, or cpu replicas with
``--device cpu``) and two Envoys from deploy/envoy/envoy.yaml (deploy/envoy/local_envoy.py):
one whose only endpoint is replica 0, one over every replica. Then, round after round, drives
the same load through each:

- **prefill**: bench_service's load processes (``--prefill-clients`` concurrent clients,
  random lengths ``--min-len``..``--max-len``, a call each, balanced per call by Envoy's
  least_request): calls/s and tensor bytes/s into the replicas (their metrics, summed);
- **sessions**: bench_sessions' clients (``--sessions-clients`` sequences with a
  ``--context``-token cache each, steps on one CacheDecodeSteps stream per client, every call
  carrying its session header, so Envoy's ring hash keeps a sequence on one replica): steps/s.

Prints one table (each round's rows, the per-replica split of the bytes, and the ratio of the
fleet to replica 0 alone in the same round) and writes JSON + markdown to ``--out``.
``--direct`` adds replica 0 without Envoy at both client counts (the fleet against its better
point). Each row also keeps replica 0's and its Envoy's busiest thread, replica 0's
connections per front end and the change in the counters of the Envoy the point went through
(flow control, upstream connections) and the calls each endpoint of its stateless cluster
took: how a proxied herd onto one front end was found (results/replicas/README.md).

    python benchmarks/bench_replicas.py --out benchmarks/results/replicas        # every GPU
    python benchmarks/bench_replicas.py --device cpu --replicas 2 --heads 2 --kv-heads 1 \
        --head-dim 16 --context 32 --max-len 64 --duration 1 --warmup 0.3 --rounds 1 \
        --prefill-clients 2 --sessions-clients 2 --out /tmp/r                     # quick cpu check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from attention_wire import grpc_defaults

grpc_defaults.apply()  # the client library's grpc I/O settings, before grpc loads

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy" / "envoy"))
from bench_service import (
    Server,
    Workers,
    _free_port,
    cpu_list,
    cpu_times,
    cpu_usage,
    frontend_spread,
    scrape,
    server_info,
)
from bench_sessions import add_shape_args, run_point
from local_envoy import LocalEnvoy
from service_load import LoadSpec

# --frontend-ports: replica i's front ends listen from base + FRONTEND_PORT_STRIDE * i on (room
# for that many front ends per replica).
FRONTEND_PORT_STRIDE = 64


def _gpu_count() -> int:
    """GPUs this host shows (CUDA_VISIBLE_DEVICES, else nvidia-smi), without importing torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([x for x in visible.split(",") if x.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.set_defaults(device="cuda", context=1024)
    p.add_argument("--replicas", type=int, help="replicas, one per GPU (default: every GPU)")
    p.add_argument("--frontends", type=int, help="front ends per replica (default: theirs)")
    p.add_argument("--server-args", help="more flags for every replica")
    p.add_argument("--replica-cpus", help="one taskset list per replica, space-separated "
                   "(e.g. '0-7 8-15'); default: unpinned")
    p.add_argument("--envoy-cpus", help="Envoy's CPUs (taskset list)")
    p.add_argument("--client-cpus", help="this script's and its load processes' CPUs")
    p.add_argument("--envoy-concurrency", type=int, default=4, help="Envoy worker threads")
    p.add_argument("--frontend-ports", type=int, default=0,
                   help="list every front end as an Envoy endpoint of its own for the stateless "
                        "calls: replica i's front end f on this port + "
                        f"{FRONTEND_PORT_STRIDE} i + f (the server's "
                        "--frontend-ports; needs --frontends); 0: the shared port")
    p.add_argument("--rounds", type=int, default=2, help="rounds, each fleet driven once a round")
    p.add_argument("--direct", action="store_true",
                   help="also drive replica 0 directly, without Envoy (what the proxy costs)")
    p.add_argument("--sides", default="prefill,sessions")
    p.add_argument("--prefill-clients", type=int, default=64)
    p.add_argument("--sessions-clients", type=int, default=64)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--send", default="unary", choices=["steps", "unary", "stream"],
                   help="how a prefill goes (bench_service --send): unary = a call each, so "
                        "Envoy balances every call, not every stream")
    p.add_argument("--workers", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 4)),
                   help="load processes")
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds per point")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", default="benchmarks/results/replicas")
    p.set_defaults(kv_dtype=None, unary=True, max_batch_tokens=None, max_queue_delay_ms=None,
                   server_log_level="WARNING")
    args = p.parse_args(argv)
    if args.replicas is None:
        args.replicas = _gpu_count() if args.device == "cuda" else 2
    if args.frontend_ports and not args.frontends:
        p.error("--frontend-ports needs --frontends (the ports each replica opens)")
    if args.replicas < 2:
        p.error(f"--replicas {args.replicas}: a fleet needs 2 or more (GPUs seen: "
                f"{_gpu_count()})")
    cpus = (args.replica_cpus or "").split()
    if cpus and len(cpus) != args.replicas:
        p.error(f"--replica-cpus names {len(cpus)} lists for {args.replicas} replicas")
    args.sides = [s for s in args.sides.split(",") if s]
    if not set(args.sides) <= {"prefill", "sessions"} or not args.sides:
        p.error("--sides takes prefill, sessions or both")
    return args


DIRECT = "replica 0 direct"
# Envoy counters kept per point (their change over it): flow control pauses, pending requests,
# connections. What the proxy waited on, where replica 0 behind it moves fewer bytes than direct.
ENVOY_COUNTERS = re.compile(
    r"^(cluster\.attention\.(upstream_flow_control_\w+|upstream_rq_pending_total|"
    r"upstream_cx_total|upstream_rq_total)|http\.ingress\.downstream_flow_control_\w+|"
    r"http\.ingress\.downstream_cx_total)$")


class Fleet:
    """The replicas, and an Envoy over replica 0 alone and one over them all."""

    def __init__(self, args: argparse.Namespace, out_dir: Path) -> None:
        cpus = (args.replica_cpus or "").split()
        self.replicas: list[Server] = []
        self.envoys: dict[str, LocalEnvoy] = {}

        def start(i: int) -> Server:
            extra = f"--gpu {i} " if args.device == "cuda" else ""
            if args.frontend_ports:
                extra += f"--frontend-ports {args.frontend_ports + FRONTEND_PORT_STRIDE * i} "
            ns = argparse.Namespace(**{**vars(args), "server_args": extra + (
                args.server_args or ""), "server_cpus": cpus[i] if cpus else None})
            print(f"starting replica {i} ({args.device}{' ' + extra.strip() if extra else ''}"
                  f"{', cpus ' + cpus[i] if cpus else ''})", flush=True)
            return Server(ns, True, out_dir / f"replica_{i}.log")

        try:
            # Together: each warms its kernels up before it serves (minutes on a fresh GPU).
            with ThreadPoolExecutor(args.replicas) as pool:
                futures = [pool.submit(start, i) for i in range(args.replicas)]
            self.replicas = [f.result() for f in futures if f.exception() is None]
            for f in futures:
                if f.exception() is not None:
                    raise RuntimeError("a replica did not start") from f.exception()
            pin = cpu_list(args.envoy_cpus) if args.envoy_cpus else None
            ends = [("127.0.0.1", int(r.target.rsplit(":", 1)[1])) for r in self.replicas]
            for name, over in (("1 replica", ends[:1]), (f"{args.replicas} replicas", ends)):
                fronts = None  # the stateless cluster's endpoints: the replicas' own port
                if args.frontend_ports:  # or each front end's
                    fronts = [("127.0.0.1", args.frontend_ports + FRONTEND_PORT_STRIDE * i + f)
                              for i in range(len(over)) for f in range(args.frontends)]
                self.envoys[name] = LocalEnvoy(over, _free_port(), _free_port(),
                                               args.envoy_concurrency, pin, fronts)
            for name, envoy in self.envoys.items():
                envoy.wait_healthy(1 if name == "1 replica" else args.replicas, 60)
            self.targets = {name: e.target for name, e in self.envoys.items()}
            if args.direct:
                self.targets[DIRECT] = self.replicas[0].target
        except BaseException:
            self.close()
            raise

    def metrics(self, fleet: str) -> list[str]:
        n = len(self.replicas) if fleet in self.envoys and fleet != "1 replica" else 1
        return [r.metrics_url for r in self.replicas[:n]]

    def cpu(self) -> dict[str, dict[str, float] | None]:
        """CPU seconds so far of each replica (all its processes), each Envoy, and all."""
        out = {f"replica {i}": cpu_times(r.proc.pid) for i, r in enumerate(self.replicas)}
        out.update({f"envoy ({name})": cpu_times(e.proc.pid) for name, e in self.envoys.items()})
        out["all"] = cpu_times(os.getpid())  # this process and everything it started,
        if out["all"] is not None:  # with the load processes that ended (joined) meanwhile
            ended = os.times()
            out["all"]["total"] += ended.children_user + ended.children_system
        return out

    def envoy_counters(self, fleet: str) -> dict[str, int]:
        """The ``ENVOY_COUNTERS`` of the Envoy that ``fleet`` goes through (none direct)."""
        envoy = self.envoys.get(fleet)
        out: dict[str, int] = {}
        for line in (envoy.admin_text("/stats") if envoy else "").splitlines():
            name, _, value = line.partition(": ")
            if ENVOY_COUNTERS.match(name) and value.strip().isdigit():
                out[name] = int(value)
        return out

    def endpoint_requests(self, fleet: str) -> dict[str, int]:
        """Requests so far per endpoint (host:port) of the stateless cluster of the Envoy that
        ``fleet`` goes through (none direct): the replicas' ports, or with --frontend-ports
        each front end's."""
        envoy = self.envoys.get(fleet)
        out: dict[str, int] = {}
        for line in (envoy.admin_text("/clusters") if envoy else "").splitlines():
            parts = line.split("::")  # attention::127.0.0.1:PORT::rq_total::N
            if len(parts) == 4 and parts[0] == "attention" and parts[2] == "rq_total":
                out[parts[1]] = int(parts[3])
        return out

    def close(self) -> None:
        for envoy in self.envoys.values():
            envoy.close()
        for r in self.replicas:
            r.stop()


def _input_bytes(urls: list[str]) -> list[float]:
    """Each replica's tensor bytes in so far (its attention_input_bytes_total)."""
    return [(scrape(u) or {}).get("attention_input_bytes_total", math.nan) for u in urls]


def _split(before: list[float], urls: list[str]) -> list[float]:
    """Each replica's share of the tensor bytes in since ``before`` (``_input_bytes``)."""
    moved = [b - a for a, b in zip(before, _input_bytes(urls), strict=True)]
    return [x / sum(moved) for x in moved] if sum(moved) else []


def prefill_point(args: argparse.Namespace, workers: Workers, fleet: Fleet, name: str,
                  clients: int, seed: int) -> dict[str, Any]:
    urls = fleet.metrics(name)
    before = _input_bytes(urls)
    row = workers.run(fleet.targets[name], clients, args.warmup,
                      args.duration, ",".join(urls), seed)
    return {"side": "prefill", "rate": row["rps"], "MBps": row["wire_in_MBps"],
            "p50_ms": row["p50_ms"], "p99_ms": row["p99_ms"], "errors": row["errors"],
            "kernel_busy": row["kernel_busy"], "split": _split(before, urls)}


def sessions_point(args: argparse.Namespace, fleet: Fleet, name: str,
                   clients: int) -> dict[str, Any]:
    urls = fleet.metrics(name)
    before = _input_bytes(urls)
    row = run_point(fleet.targets[name], args, "sessions", clients, step_stream=True)
    return {"side": "sessions", "rate": row["steps_per_s"], "MBps": math.nan,
            "p50_ms": row["p50_ms"], "p99_ms": row["p99_ms"],
            "errors": sum(row["errors"].values()), "kernel_p50_ms": row["kernel_p50_ms"],
            "split": _split(before, urls)}


def _cores(cores: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in cores.items() if v >= 0.05)


def _f(x: float, nd: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    fleet = Fleet(args, out_dir)  # before pinning this process: replicas must not inherit it
    if args.client_cpus:
        os.sched_setaffinity(0, cpu_list(args.client_cpus))
    workers = None
    rows: list[dict[str, Any]] = []
    try:
        info = server_info(fleet.replicas[0].target)
        # Clients per replica stay fixed: the fleet of k gets k times the clients, as k times
        # the capacity needs k times the offered load. Replica 0 alone is driven with both
        # counts, so the ratio is taken against its better one (it is saturated if the two
        # agree).
        k, many = args.replicas, f"{args.replicas} replicas"
        points = [("1 replica", 1), ("1 replica", k), (many, k)] + (
            [(DIRECT, 1), (DIRECT, k)] if args.direct else [])
        if "prefill" in args.sides:
            spec = LoadSpec(mode="prefill", heads=args.heads, kv_heads=args.kv_heads,
                            head_dim=args.head_dim, dtype=args.dtype, min_len=args.min_len,
                            max_len=args.max_len, decode_seqs=1, causal=True, pool=16,
                            seed=0, send=args.send)
            most = k * args.prefill_clients
            workers = Workers(spec, min(args.workers, most), most)
            for target in fleet.envoys.values():  # unmeasured: kernels compile here
                workers.run(target.target, most, 0.0, min(3.0, args.duration), None, 1)
        for r in range(1, args.rounds + 1):
            # Alternate which point goes first, so a drift of the host favours none.
            for name, scale in (points if r % 2 else points[::-1]):
                for side in args.sides:
                    clients = scale * (args.prefill_clients if side == "prefill"
                                       else args.sessions_clients)
                    c0, e0, t = fleet.cpu(), fleet.envoy_counters(name), time.monotonic()
                    q0 = fleet.endpoint_requests(name)
                    row = (prefill_point(args, workers, fleet, name, clients, r)
                           if side == "prefill" else sessions_point(args, fleet, name, clients))
                    # Cores each process used over the point (its warm-up and setup too), and
                    # replica 0's busiest thread: one front end's loop at 1.0 caps it.
                    c1, t = fleet.cpu(), time.monotonic() - t
                    usage = {k: cpu_usage(c0[k], c1[k], t) for k in c0}
                    cores = {k: u[0] for k, u in usage.items()}
                    row["replica0_busiest_thread"] = round(usage["replica 0"][1], 2)
                    # And the Envoy's (none direct): one worker at 1.0 caps the proxy however
                    # many it has (connections are a worker's for life).
                    envoy = usage.get(f"envoy ({name})")
                    row["envoy_busiest_thread"] = None if envoy is None else round(envoy[1], 2)
                    # Connections per front end of replica 0 as the point ends (the load's,
                    # or Envoy's upstream ones), and what its Envoy counted meanwhile.
                    r0 = fleet.replicas[0]
                    row["replica0_frontend_connections"] = frontend_spread(
                        r0.target, r0.proc.pid)
                    e1 = fleet.envoy_counters(name)
                    row["envoy_counters"] = {k: v - e0.get(k, 0) for k, v in e1.items()
                                             if v - e0.get(k, 0)}
                    # The calls each endpoint of its stateless cluster took (every one listed).
                    row["envoy_endpoint_requests"] = {
                        k: v - q0.get(k, 0) for k, v in fleet.endpoint_requests(name).items()}
                    # The load: this script's process tree less the replicas and Envoys.
                    cores["load"] = cores.pop("all") - sum(cores.values())
                    row.update(round=r, fleet=name, clients=clients, cores={
                        k: round(v, 2) for k, v in cores.items()})
                    rows.append(row)
                    print(f"  round {r} {name:>16} {side:>8} {clients:4d} clients: "
                          f"{row['rate']:9.1f}/s  "
                          f"{_f(row['MBps'])} MB/s  p50 {_f(row['p50_ms'], 2)} ms  split "
                          f"{'/'.join(f'{x:.2f}' for x in row['split'])}  errors "
                          f"{row['errors']}  cores {_cores(row['cores'])}  replica 0: busiest "
                          f"thread {row['replica0_busiest_thread']}, connections per front "
                          f"end {row['replica0_frontend_connections']}" + (
                              "" if row["envoy_busiest_thread"] is None else
                              f"; envoy's busiest thread {row['envoy_busiest_thread']}"),
                          flush=True)
                    if row["envoy_counters"]:
                        print(f"    envoy: {row['envoy_counters']}; requests per endpoint "
                              f"{row['envoy_endpoint_requests']}", flush=True)
    finally:
        if workers is not None:
            workers.close()
        fleet.close()
    # The ratio of the fleet to replica 0 alone, per round and side (same round: same host
    # state), and their median.
    ratios: dict[str, list[float]] = {}
    for side in args.sides:
        for r in range(1, args.rounds + 1):
            here = [x for x in rows if x["side"] == side and x["round"] == r]
            one = max(x["rate"] for x in here if x["fleet"] == "1 replica")
            (all_,) = (x["rate"] for x in here if x["fleet"] == many)
            ratios.setdefault(side, []).append(all_ / max(one, 1e-9))
            direct = [x for x in here if x["fleet"] == DIRECT]
            if direct:  # the fleet against replica 0 without the proxy's hop, its better point
                ratios.setdefault(f"{side}, {many} / {DIRECT}", []).append(
                    all_ / max(max(d["rate"] for d in direct), 1e-9))
            for d in direct:  # same clients, no proxy
                (via,) = (x["rate"] for x in here
                          if x["fleet"] == "1 replica" and x["clients"] == d["clients"])
                ratios.setdefault(f"{side}, Envoy over replica 0 / {DIRECT}, "
                                  f"{d['clients']} clients", []).append(
                    via / max(d["rate"], 1e-9))
    lines = [
        f"# bench_replicas: {args.replicas} x {info.device}, "
        f"{datetime.now(timezone.utc):%Y-%m-%d}", "",
        f"`python benchmarks/bench_replicas.py {shlex.join(argv or sys.argv[1:])}`", "",
        f"Envoy over replica 0 alone against Envoy over all {args.replicas} (same config, "
        f"{args.envoy_concurrency} workers" + (
            f"; stateless calls over each replica's {args.frontends} front ends as endpoints"
            if args.frontend_ports else "") + "); clients per replica fixed (the fleet of "
        f"{k} gets {k}x), replica 0 alone driven with both counts. Prefill: "
        f"{args.prefill_clients} clients per replica, "
        f"{args.dtype} H{args.heads}/{args.kv_heads} D{args.head_dim} causal, lengths "
        f"log-uniform {args.min_len}..{args.max_len}, send {args.send}. Sessions: "
        f"{args.sessions_clients} sequences per replica, context {args.context}, steps on one "
        "stream each. "
        f"{args.duration:g} s per point after {args.warmup:g} s.", "",
        "| round | fleet | side | clients | calls or steps/s | tensor MB/s in | p50 ms | "
        "p99 ms | split by replica (bytes) | CPU cores used | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        lines.append(f"| {x['round']} | {x['fleet']} | {x['side']} | {x['clients']} | "
                     f"{x['rate']:.1f} | "
                     f"{_f(x['MBps'])} | {_f(x['p50_ms'], 2)} | {_f(x['p99_ms'], 2)} | "
                     f"{' / '.join(f'{s:.2f}' for s in x['split'])} | {_cores(x['cores'])} | "
                     f"{x['errors']} |")
    lines += ["", f"| ratio ({many} / the better of replica 0's two points, both behind "
              "Envoy, unless named) | per round | median |", "|---|---|---|"]
    lines += [f"| {side} | {', '.join(f'{v:.2f}' for v in vals)} | "
              f"{statistics.median(vals):.2f} |" for side, vals in ratios.items()]
    table = "\n".join(lines) + "\n"
    print(table)
    stem = f"bench_replicas_{args.replicas}x_{info.device.replace(' ', '_')}"
    (out_dir / f"{stem}.md").write_text(table)
    (out_dir / f"{stem}.json").write_text(json.dumps(
        {"command": shlex.join(argv or sys.argv[1:]), "device": info.device,
         "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
         "wall_seconds": round(time.time() - t0, 1), "config": vars(args), "rows": rows,
         "ratios": ratios}, indent=2, default=str) + "\n")
    print(f"wrote {out_dir / stem}.{{md,json}}")
    return 1 if any(x["errors"] for x in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
