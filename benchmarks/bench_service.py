"""End-to-end service benchmark: dynamic batching on vs off under N concurrent clients.

By default starts the server twice (``python -m attention_service``, batching on, then off)
on free loopback ports, checks a few concurrent answers against the reference, then for each
N in ``--clients`` drives it for ``--duration`` seconds (after ``--warmup``) with N asyncio
clients spread over worker processes, each sending realistic small requests (one sequence,
length log-uniform in [--min-len, --max-len], fixed seed). Reports requests/s, p50/p95/p99
latency, mean batch size and queue wait (from the server's /metrics), errors; prints both
sides side by side with on/off ratios and writes JSON + CSV to ``--out``.

    python benchmarks/bench_service.py                                   # GPU: defaults
    python benchmarks/bench_service.py --device cpu --clients 1,4 --duration 2 --max-len 64 \
        --heads 4 --kv-heads 2 --head-dim 32                             # a quick cpu check
    python benchmarks/bench_service.py --target host:50051 --metrics-url http://host:8000/metrics

Needs only what the server needs (torch, triton, grpcio, protobuf, prometheus-client, numpy)
plus the attention_client package; no network beyond loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import multiprocessing as mp
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from attention_wire import grpc_defaults

grpc_defaults.apply()  # the client library's grpc I/O settings, before grpc loads

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from attention_wire.messages import DEFAULT_CHUNK_BYTES
from attention_wire.pb import attention_pb2 as pb
from attention_wire.pb import attention_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from service_load import LoadSpec, loguniform_lengths, worker_main

ROOT = Path(__file__).resolve().parents[1]


# ---- server processes ---------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(target: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=2)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def cpu_list(spec: str) -> set[int]:
    """``"0-11,14"`` -> {0, ..., 11, 14} (taskset's list form)."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def worker_context() -> Any:
    """The multiprocessing context of the benchmarks' load processes: forked from a server
    process that imported the running script once. Spawned, each imported torch, grpc and the
    client again (~3 s of CPU on a 2-core box before its first call: 62 -> 50 s for the
    roundtrip benchmark's tests). The server is a fresh process, so no thread, channel or
    CUDA context of the script crosses a fork; it inherits the script's CPU affinity."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__"])
    return ctx


def split_cpus(server_cpus: str | None, client_cpus: str | None) -> str | None:
    """Move this process (and the clients it starts after) onto ``client_cpus``, and return
    the CPU list its servers should get: ``server_cpus``, or, with only ``client_cpus`` given,
    every CPU this process had (the servers must not inherit the clients' set)."""
    if not client_cpus:
        return server_cpus
    if not server_cpus:
        server_cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    os.sched_setaffinity(0, cpu_list(client_cpus))
    return server_cpus


class Server:
    """``python -m attention_service`` on free ports; its log goes to a file beside the results."""

    # A free port may be taken between our look and the server's bind (by another process's
    # outgoing connection, say: tests run servers side by side): start again on new ports.
    BIND_TRIES = 3

    def __init__(self, args: argparse.Namespace, batching: bool, log_path: Path) -> None:
        self.log_path = log_path
        for attempt in range(self.BIND_TRIES):
            self._start(args, batching)
            try:
                self._wait_serving(args)
                return
            except RuntimeError:
                tail = self.log_tail()
                if attempt + 1 < self.BIND_TRIES and (
                        "could not bind" in tail or "could not serve /metrics" in tail):
                    continue
                raise

    def _start(self, args: argparse.Namespace, batching: bool) -> None:
        port, mport = _free_port(), _free_port()
        self.target = f"127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{mport}/metrics"
        cmd = [
            sys.executable, "-m", "attention_service", "--host", "127.0.0.1",
            "--port", str(port), "--metrics-port", str(mport), "--device", args.device,
            "--batching" if batching else "--no-batching", "--log-level", args.server_log_level,
        ]
        if args.max_batch_tokens is not None:
            cmd += ["--max-batch-tokens", str(args.max_batch_tokens)]
        if args.max_queue_delay_ms is not None:
            cmd += ["--max-queue-delay-ms", str(args.max_queue_delay_ms)]
        if args.frontends is not None:
            cmd += ["--frontends", str(args.frontends)]
        cmd += shlex.split(getattr(args, "server_args", None) or "")
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)
        if getattr(args, "server_cpus", None):
            # Before it starts its front ends (they inherit it), long before it serves.
            os.sched_setaffinity(self.proc.pid, cpu_list(args.server_cpus))

    def _wait_serving(self, args: argparse.Namespace) -> None:
        end = time.monotonic() + args.startup_timeout
        while not _healthy(self.target):
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log_tail()}")
            if time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"server not SERVING after {args.startup_timeout}s")
            time.sleep(0.5)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def server_info(target: str) -> pb.ServerInfo:
    with grpc.insecure_channel(target) as ch:
        return pb_grpc.AttentionServiceStub(ch).GetServerInfo(pb.GetServerInfoRequest(),
                                                              timeout=10)


# ---- metrics ------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return kids


def cpu_times(pid: int | None) -> dict[str, float] | None:
    """CPU seconds of process ``pid`` and its descendants (a process group's front ends) so
    far: ``"total"`` (ended threads included) and per live thread (Linux /proc), or None."""
    if pid is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")

    def seconds(path: str) -> float:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime + stime

    times: dict[str, float] = {"total": 0.0}
    todo, seen = [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            times["total"] += seconds(f"/proc/{p}/stat")
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            if p == pid:
                return None
            continue
        for task in tasks:
            try:
                times[f"{p}/{task}"] = seconds(f"/proc/{p}/task/{task}/stat")
            except OSError:  # the thread ended meanwhile
                continue
        todo += _children(p)
    return times


def frontend_spread(target: str, server_pid: int | None) -> list[int] | None:
    """Connections per front end of the server group ``server_pid`` on ``target``'s port, most
    first (the load's, as the window starts), or None for one process or without /proc."""
    if server_pid is None:
        return None
    from attention_service.frontend import connections

    try:
        held = connections.counts(int(target.rsplit(":", 1)[1]),
                                  connections.frontend_pids(server_pid))
    except OSError:
        return None
    return sorted(held.values(), reverse=True) or None


def cpu_usage(c0: dict[str, float] | None, c1: dict[str, float] | None,
              seconds: float) -> tuple[float, float]:
    """(all server processes, busiest thread) CPU use over the window, as fractions of one
    core (a front end that restarted in the window would count from zero: none should)."""
    if not c0 or not c1:
        return math.nan, math.nan
    busiest = max((c1[t] - c0.get(t, 0.0) for t in c1 if t != "total"), default=0.0)
    return (c1["total"] - c0["total"]) / seconds, busiest / seconds


# The series ``summarize`` reads (sums over all rpcs; the stage histogram's kernel stage only).
SUMMARY_SERIES = (
    "attention_batch_requests_sum", "attention_batch_requests_count",
    "attention_batch_tokens_sum", "attention_queue_wait_seconds_sum",
    "attention_queue_wait_seconds_count", "attention_stage_seconds_sum",
    "attention_input_bytes_total", "attention_region_bytes_total",
    "attention_request_duration_seconds_sum", "attention_request_duration_seconds_count",
    "attention_engine_seconds_sum", "attention_engine_seconds_count",
    "attention_launch_issue_seconds_sum", "attention_launch_issue_seconds_count",
)


def _samples(url: str) -> list[Any]:
    """Every sample a /metrics endpoint shows now (OSError when it cannot be read)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def nixl_transfer_seconds(url: str | None) -> dict[str, tuple[float, float]]:
    """Per direction ("in", "out"): (count, seconds) of a server's NIXL transfers so far (its
    ``attention_nixl_transfer_seconds`` histogram); empty without metrics."""
    try:
        samples = _samples(url) if url else []
    except OSError:
        return {}
    got: dict[str, list[float]] = {}
    for s in samples:
        if s.name in ("attention_nixl_transfer_seconds_count",
                      "attention_nixl_transfer_seconds_sum"):
            got.setdefault(s.labels["direction"], [0.0, 0.0])[s.name.endswith("_sum")] += s.value
    return {d: (n, secs) for d, (n, secs) in got.items()}


def scrape(urls: str | None) -> dict[str, float] | None:
    """Sums of the series the report needs (all rpcs together, and all servers of a
    comma-separated list: replicas behind a proxy), or None without metrics."""
    if not urls:
        return None
    totals: dict[str, float] = dict.fromkeys(SUMMARY_SERIES, 0.0)
    for url in urls.split(","):
        try:
            samples = _samples(url)
        except OSError:
            return None
        for s in samples:
            if s.name in SUMMARY_SERIES and s.labels.get("stage", "kernel") == "kernel":
                totals[s.name] += s.value
    return totals


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def summarize(
    results: list[dict[str, Any]], duration: float, m0: dict[str, float] | None,
    m1: dict[str, float] | None,
) -> dict[str, Any]:
    lat = np.array([x for r in results for x in r["latencies"]], dtype=np.float64) * 1e3
    errors: dict[str, int] = {}
    for r in results:
        for code, n in r["errors"].items():
            errors[code] = errors.get(code, 0) + n
    row: dict[str, Any] = {
        "completed": int(lat.size), "rps": lat.size / duration,
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else math.nan,
        "p95_ms": float(np.percentile(lat, 95)) if lat.size else math.nan,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else math.nan,
        "mean_ms": float(lat.mean()) if lat.size else math.nan,
        "errors": sum(errors.values()), "errors_by_code": errors,
        "mean_batch_requests": math.nan, "mean_batch_tokens": math.nan,
        "mean_queue_ms": math.nan, "kernel_busy": math.nan, "server_mean_ms": math.nan,
        "engine_mean_ms": math.nan, "launch_issue_ms": math.nan,
        "wire_in_MBps": math.nan, "region_MBps": math.nan,
        "server_cpu": math.nan, "server_busiest_thread": math.nan,
    }
    if m0 is not None and m1 is not None:
        d = {k: m1[k] - m0[k] for k in m0}
        launches = d["attention_batch_requests_count"]
        row["mean_batch_requests"] = _ratio(d["attention_batch_requests_sum"], launches)
        row["mean_batch_tokens"] = _ratio(d["attention_batch_tokens_sum"], launches)
        row["mean_queue_ms"] = 1e3 * _ratio(d["attention_queue_wait_seconds_sum"],
                                            d["attention_queue_wait_seconds_count"])
        # The server's own view of a call (first message to status, in the front end): what
        # the client's mean has beyond it was spent in the load process and on the wire.
        row["server_mean_ms"] = 1e3 * _ratio(d["attention_request_duration_seconds_sum"],
                                             d["attention_request_duration_seconds_count"])
        # Of that, the engine's share (handed over until answered: queue, launch, device, the
        # hops to the engine process); the rest is the front end's. And the host time the
        # engine took to issue one launch (its dispatcher issues them one after another).
        row["engine_mean_ms"] = 1e3 * _ratio(d["attention_engine_seconds_sum"],
                                             d["attention_engine_seconds_count"])
        row["launch_issue_ms"] = 1e3 * _ratio(d["attention_launch_issue_seconds_sum"],
                                              d["attention_launch_issue_seconds_count"])
        # Fraction of wall time the device spent in kernels (launches may overlap copies).
        row["kernel_busy"] = d["attention_stage_seconds_sum"] / duration
        # Tensor bytes per second through gRPC and through registered regions (in + out).
        row["wire_in_MBps"] = d["attention_input_bytes_total"] / duration / 1e6
        row["region_MBps"] = d["attention_region_bytes_total"] / duration / 1e6
    return row


# ---- load ---------------------------------------------------------------------------------

class Workers:
    """Persistent load processes (spawned once, each with its own request pool)."""

    def __init__(self, spec: LoadSpec, count: int, max_clients: int = 256) -> None:
        ctx = worker_context()
        self.conns = []
        self.procs = []
        per_worker = -(-max_clients // count)
        for i in range(count):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(child, spec, i, per_worker), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if c.recv() != "ready":
                raise RuntimeError("load worker failed to start")

    def run(
        self, target: str, clients: int, warmup: float, duration: float, metrics: str | None,
        seed: int, server_pid: int | None = None,
    ) -> dict[str, Any]:
        used = self.conns[: min(clients, len(self.conns))]
        shares = [clients // len(used) + (i < clients % len(used)) for i in range(len(used))]
        t_start = time.time() + 0.5
        t_measure = t_start + warmup
        t_end = t_measure + duration
        for i, (conn, share) in enumerate(zip(used, shares, strict=True)):
            conn.send(dict(target=target, n_clients=share, seed=seed * 1000 + i,
                           t_start=t_start, t_measure=t_measure, t_end=t_end))
        procs = self.procs[: len(used)]
        time.sleep(max(0.0, t_measure - time.time()))
        m0, c0 = scrape(metrics), cpu_times(server_pid)
        spread = frontend_spread(target, server_pid)
        l0 = [cpu_times(p.pid) for p in procs]
        time.sleep(max(0.0, t_end - time.time()))
        m1, c1 = scrape(metrics), cpu_times(server_pid)
        l1 = [cpu_times(p.pid) for p in procs]
        results = [conn.recv() for conn in used]
        row = summarize(results, duration, m0, m1)
        row["server_cpu"], row["server_busiest_thread"] = cpu_usage(c0, c1, duration)
        row["frontend_connections"] = spread
        # The load's own CPU: a load process whose loop thread nears one core is the limit,
        # not the server.
        load = [cpu_usage(a, b, duration) for a, b in zip(l0, l1, strict=True)]
        row["load_cpu"] = sum(t for t, _ in load)
        row["load_busiest_thread"] = max((b for _, b in load), default=math.nan)
        return row

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(5)


# ---- correctness spot check -----------------------------------------------------------------

def verify(target: str, args: argparse.Namespace, count: int) -> str:
    """``count`` concurrent requests (short ones, so the cpu reference is quick) checked against
    attention_kernels.reference: batching must hand every caller its own rows."""
    import torch

    from attention_client import AsyncAttentionClient
    from attention_kernels import decode_ref, prefill_ref

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    tol = {"bf16": 3e-2, "fp16": 4e-3, "fp32": 2e-3}[args.dtype]
    rng = np.random.default_rng(args.seed + 7)
    g = torch.Generator().manual_seed(args.seed)
    cases = []
    for i in range(count):
        # Short cases (the float64 reference is slow), unless --min-len asks for more.
        n = int(loguniform_lengths(rng, 1, args.min_len,
                                   max(args.min_len, min(args.max_len, 256)))[0])
        decode = args.mode == "decode" or (args.mode == "mix" and i % 2)
        q = torch.randn(1 if decode else n, args.heads, args.head_dim, generator=g).to(dtype)
        k = torch.randn(n, args.kv_heads, args.head_dim, generator=g).to(dtype)
        v = torch.randn(n, args.kv_heads, args.head_dim, generator=g).to(dtype)
        cases.append((bool(decode), q, k, v, i % 2 == 0))

    async def run() -> list[Any]:
        async with AsyncAttentionClient(target, timeout=120) as client:
            if args.path == "shm":  # the same path as the load: staged into a region
                await client.register_shm(64 << 20)
            return list(await asyncio.gather(*(
                client.decode(q, k, v, [0, k.shape[0]], return_lse=lse) if dec else
                client.attention(q, k, v, causal=args.causal, return_lse=lse)
                for dec, q, k, v, lse in cases
            )))

    worst = 0.0
    for (dec, q, k, v, lse), res in zip(cases, asyncio.run(run()), strict=True):
        cu = torch.tensor([0, k.shape[0]], dtype=torch.int32)
        if dec:
            ref = decode_ref(q, k, v, cu, return_lse=True, compute_dtype=torch.float64)
        else:
            ref = prefill_ref(q, k, v, torch.tensor([0, q.shape[0]], dtype=torch.int32), cu,
                              causal=args.causal, return_lse=True, compute_dtype=torch.float64)
        out = res[0] if lse else res
        err = (out.double() - ref[0].double()).abs().max().item()
        if lse:
            err = max(err, (res[1].double() - ref[1].double()).abs().max().item() / 10)
        worst = max(worst, err)
        if not err <= tol:
            raise SystemExit(f"verify: a response differs from the reference by {err:.3g}")
    return f"{count} concurrent requests match the reference (max abs err {worst:.2g})"


# ---- report -------------------------------------------------------------------------------

def _f(x: float, nd: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def table(rows: list[dict[str, Any]], clients: list[int]) -> str:
    sides = sorted({r["side"] for r in rows}, reverse=True)  # "on" before "off"
    get = {(r["side"], r["clients"]): r for r in rows}
    head = ["clients"]
    for s in sides:
        head += [f"req/s {s}", f"p50 {s}", f"p95 {s}", f"p99 {s}", f"batch {s}", f"err {s}"]
    if len(sides) == 2:
        head += ["req/s on/off", "p99 on/off"]
    lines = [head]
    for n in clients:
        line = [str(n)]
        for s in sides:
            r = get.get((s, n), {})
            line += [_f(r.get("rps", math.nan)), _f(r.get("p50_ms", math.nan), 2),
                     _f(r.get("p95_ms", math.nan), 2), _f(r.get("p99_ms", math.nan), 2),
                     _f(r.get("mean_batch_requests", math.nan), 2), str(r.get("errors", "-"))]
        if len(sides) == 2:
            on, off = get.get(("on", n), {}), get.get(("off", n), {})
            line += [_f(_ratio(on.get("rps", math.nan), off.get("rps", math.nan)), 2),
                     _f(_ratio(on.get("p99_ms", math.nan), off.get("p99_ms", math.nan)), 2)]
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True))
                     for row in lines) + "\n(latencies in ms; batch = mean requests per launch)"


def write_outputs(out_dir: Path, stem: str, report: dict[str, Any]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js, cs = out_dir / f"{stem}.json", out_dir / f"{stem}.csv"
    js.write_text(json.dumps(report, indent=2, default=str) + "\n")
    cols = ["side", "clients", "rps", "p50_ms", "p95_ms", "p99_ms", "mean_ms", "completed",
            "errors", "mean_batch_requests", "mean_batch_tokens", "mean_queue_ms",
            "server_mean_ms", "engine_mean_ms", "launch_issue_ms", "kernel_busy", "server_cpu",
            "server_busiest_thread", "load_cpu", "load_busiest_thread", "frontend_connections"]
    with cs.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in report["results"]:
            # Rows from bench_batching.py (no load processes of this script) lack some columns.
            values = [r.get(c, math.nan) for c in cols]
            values = ["/".join(map(str, v)) if isinstance(v, list) else v for v in values]
            w.writerow([v if not isinstance(v, float) else f"{v:.6g}" for v in values])
    return [js, cs]


# ---- main ---------------------------------------------------------------------------------

def add_common_args(p: argparse.ArgumentParser) -> None:
    """Flags bench_service.py and bench_batching.py share: device, client counts, sides, the
    request shapes and length distribution, seed, output folder."""
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--clients", default="1,8,32,64,128", help="comma-separated client counts")
    p.add_argument("--batching", default="on,off", help="sides to run: on,off | on | off")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))


def parse_common(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, then check and split the shared flags (``client_counts``, ``sides``)."""
    args = p.parse_args(argv)
    args.client_counts = [int(x) for x in args.clients.split(",") if x.strip()]
    args.sides = [s.strip() for s in args.batching.split(",") if s.strip()]
    if not args.client_counts or any(n < 1 for n in args.client_counts):
        p.error("--clients needs positive counts")
    if not set(args.sides) <= {"on", "off"} or not args.sides:
        p.error("--batching takes on, off or on,off")
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds per point")
    p.add_argument("--prime", type=float, default=3.0,
                   help="unmeasured seconds at each client count before the measured points")
    p.add_argument("--mode", default="prefill", choices=["prefill", "decode", "mix"])
    p.add_argument("--target", help="drive this running server instead of starting servers")
    p.add_argument("--metrics-url", help="its /metrics (with --target) for the batch columns; "
                   "several, comma-separated, are summed (replicas behind a proxy)")
    p.add_argument("--max-batch-tokens", type=int, help="passed to the started servers")
    p.add_argument("--max-queue-delay-ms", type=float, help="passed to the started servers")
    p.add_argument("--decode-seqs", type=int, default=1, help="sequences per decode request")
    p.add_argument("--workers", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)),
                   help="load processes (each an asyncio loop)")
    p.add_argument("--pool", type=int, default=16, help="distinct requests per worker")
    p.add_argument("--verify", type=int, default=16, help="requests checked first (0 = skip)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--server-log-level", default="WARNING",
                   help="server log level (INFO logs a line per call, which costs throughput)")
    p.add_argument("--frontends", type=int, help="passed to the started servers (default: theirs)")
    p.add_argument("--server-cpus", help="CPUs of the started servers (taskset list, e.g. 0-15)")
    p.add_argument("--client-cpus", help="CPUs of this script and its load processes (e.g. "
                   "16-31), apart from --server-cpus, as for clients on other hosts")
    p.add_argument("--connections", type=int, default=1,
                   help="connections per client, calls round-robin over them (channels=)")
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                   help="tensor bytes per request message (the client's max_chunk_bytes): "
                        "a request that fits one is one message on a step stream")
    p.add_argument("--no-spread", dest="spread", action="store_false",
                   help="keep each connection where the kernel hashed it (default: placed "
                        "as the client library's spread=True places it)")
    p.add_argument("--path", default="grpc", choices=["grpc", "shm"],
                   help="shm: tensors in registered shared memory, requests carry spans only")
    p.add_argument("--send", default="steps", choices=["steps", "unary", "stream"],
                   help="how a one-message request goes: on a kept-open PrefillSteps/"
                        "DecodeSteps stream per client (default, as attention_client sends "
                        "it), a unary twin call each, or a request stream each")
    args = parse_common(p, argv)
    if not 1 <= args.connections <= 16:
        p.error("--connections must be in [1, 16]")
    return args


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") or "unknown"


def run_side(
    args: argparse.Namespace, workers: Workers, side: str | None, out_dir: Path
) -> tuple[list[dict[str, Any]], pb.ServerInfo]:
    server = None
    if args.target:
        target, metrics = args.target, args.metrics_url
    else:
        log = out_dir / f"bench_service_server_{side}.log"
        print(f"starting server (batching {side}, device {args.device}); log: {log}", flush=True)
        server = Server(args, side == "on", log)
        target, metrics = server.target, server.metrics_url
    try:
        info = server_info(target)
        side = side or ("on" if info.batching else "off")
        print(f"  {info.device} ({info.backend}), batching {info.batching}", flush=True)
        if args.verify:
            print(f"  verify: {verify(target, args, args.verify)}", flush=True)
        if args.prime > 0:
            # Unmeasured load at every client count first: each new batch shape (the prefill
            # kernel specialises on the power of two above the sequence count) compiles a
            # Triton variant on first use, about 2 s on an H100; let that happen here.
            for n in sorted(args.client_counts):
                workers.run(target, n, 0.0, args.prime, None, args.seed + 1)
        rows = []
        for n in args.client_counts:
            row = workers.run(target, n, args.warmup, args.duration, metrics, args.seed,
                              server.proc.pid if server is not None else None)
            row.update(side=side, clients=n)
            rows.append(row)
            print(f"  clients {n:4d}: {row['rps']:9.1f} req/s  p50 {_f(row['p50_ms'], 2)}  "
                  f"p99 {_f(row['p99_ms'], 2)} ms  batch {_f(row['mean_batch_requests'], 2)}  "
                  f"queue {_f(row['mean_queue_ms'], 2)} ms  mean {_f(row['mean_ms'], 2)} ms "
                  f"(server {_f(row['server_mean_ms'], 2)}, engine "
                  f"{_f(row['engine_mean_ms'], 2)}, launch issue "
                  f"{_f(row['launch_issue_ms'], 2)})  kernel busy "
                  f"{_f(100 * row['kernel_busy'], 1)}%  server cpu "
                  f"{_f(100 * row['server_cpu'], 0)}% (busiest thread "
                  f"{_f(100 * row['server_busiest_thread'], 0)}%)  load cpu "
                  f"{_f(100 * row['load_cpu'], 0)}% (busiest thread "
                  f"{_f(100 * row['load_busiest_thread'], 0)}%)  errors {row['errors']}"
                  + (f"  connections per front end {'/'.join(map(str, spread))}"
                     if (spread := row["frontend_connections"]) else ""),
                  flush=True)
        return rows, info
    finally:
        if server is not None:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.server_cpus = split_cpus(args.server_cpus, args.client_cpus)  # load inherits it
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = LoadSpec(
        mode=args.mode, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        dtype=args.dtype, min_len=args.min_len, max_len=args.max_len,
        decode_seqs=args.decode_seqs, causal=args.causal, pool=args.pool, seed=args.seed,
        path=args.path, send=args.send, connections=args.connections, spread=args.spread,
        chunk_bytes=args.chunk_bytes,
    )
    t0 = time.time()
    workers = Workers(spec, min(args.workers, max(args.client_counts)), max(args.client_counts))
    rows: list[dict[str, Any]] = []
    info = None
    try:
        for side in ([None] if args.target else args.sides):
            side_rows, info = run_side(args, workers, side, out_dir)
            rows += side_rows
    finally:
        workers.close()
    assert info is not None
    print()
    print(f"{info.device}: {args.mode}, {args.dtype} H{args.heads}/{args.kv_heads} "
          f"D{args.head_dim}{' causal' if args.causal else ''}, lengths log-uniform "
          f"{args.min_len}..{args.max_len}, {args.duration:g} s per point, path {args.path}, "
          f"send {args.send}, {args.connections} connection(s) per client"
          f"{' (spread)' if args.spread else ' (not spread)'}, "
          f"{info.frontends} front end(s)"
          + (f"; server on cpus {args.server_cpus}" if args.server_cpus else "")
          + (f", load on cpus {args.client_cpus}" if args.client_cpus else ""))
    print(table(rows, args.client_counts))
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else
                                                       sys.argv[1:])]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds": round(time.time() - t0, 1),
        "server": {"device": info.device, "backend": info.backend, "frontends": info.frontends,
                   "server_version": info.server_version, "torch_version": info.torch_version,
                   "triton_version": info.triton_version, "cuda_version": info.cuda_version},
        "config": {k: v for k, v in vars(args).items() if k not in ("client_counts", "sides")},
        "results": rows,
    }
    suffix = f"_{args.path}" if args.path != "grpc" else ""
    suffix += f"_fe{info.frontends}" if info.frontends > 1 else ""
    paths = write_outputs(out_dir, f"service_{args.mode}{suffix}_{_slug(info.device)}", report)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
