"""Soak: a long mixed Locust run against the server as the container starts it, plus a
concurrent stream of bad inputs and cancellations (issue 12).

    python benchmarks/soak.py --duration 600 --users 32 --out OUT [--device cuda]

What it checks, and writes to OUT/soak_summary.json and OUT/soak.md:
  * every good call succeeds: Locust's failure count is 0, and a known prefill compared with
    the float64 reference after every chaos round is correct;
  * every bad call ends with its documented status (the client's view), and the server counts
    each of those statuses exactly as often as the chaos driver caused it (its view, from
    ``attention_requests_total``), with no UNKNOWN / INTERNAL at all;
  * the server stays SERVING (a health check per round) and exits 0 on SIGTERM at the end;
  * memory is flat: RSS of every server process and the GPU memory nvidia-smi sees for them,
    sampled every ``--sample-every`` seconds (OUT/soak_memory.csv); start = the first sample
    after ``--settle`` seconds of load (allocator pools and CUDA graphs fill up first), end =
    the last sample under load.
Exit status 0 only when all of these hold.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attention_wire import grpc_defaults

grpc_defaults.apply()  # the client library's grpc I/O settings, before grpc loads

import grpc
import numpy as np

from attention_wire.pb import attention_pb2 as pb
from attention_wire.pb import attention_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
SERVICE = "/attention.v1.AttentionService/"
MiB = 1 << 20
# Growth allowed between the settled start and the end (allocator and page-cache noise).
RSS_SLACK = 64 * MiB
GPU_SLACK = 64 * MiB
GOOD_TOL = 2e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the chaos driver: bad inputs and cut-off calls, each with its documented status ------

def _spec(shape: tuple[int, ...], dtype: int = pb.FLOAT32) -> pb.TensorSpec:
    return pb.TensorSpec(dtype=dtype, shape=list(shape))


def _chunks(cls: Any, tensors: dict[int, np.ndarray]) -> list[Any]:
    return [cls(chunks=[pb.TensorChunk(field=f, offset=0, data=t.tobytes())])
            for f, t in tensors.items()]


@dataclass
class Good:
    """A small prefill whose answer is known (float64 reference, computed once)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    cu: list[int]
    want: np.ndarray

    @staticmethod
    def make(seed: int = 0) -> Good:
        rng = np.random.default_rng(seed)
        cu = [0, 5, 21, 40]
        q, k, v = (rng.standard_normal((40, h, 32)).astype(np.float32) for h in (4, 2, 2))
        want = np.zeros((40, 4, 32))
        for s, e in zip(cu[:-1], cu[1:], strict=True):
            qs = q[s:e].astype(np.float64)
            ks = np.repeat(k[s:e].astype(np.float64), 2, axis=1)
            vs = np.repeat(v[s:e].astype(np.float64), 2, axis=1)
            scores = np.einsum("qhd,khd->hqk", qs, ks) / np.sqrt(32)
            n = e - s
            scores[:, np.triu(np.ones((n, n), dtype=bool), 1)] = -np.inf
            p = np.exp(scores - scores.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            want[s:e] = np.einsum("hqk,khd->qhd", p, vs)
        return Good(q, k, v, cu, want)

    def messages(self) -> list[Any]:
        h = pb.PrefillHeader(q=_spec(self.q.shape), k=_spec(self.k.shape),
                             v=_spec(self.v.shape), cu_seqlens_q=self.cu, causal=True)
        return [pb.PrefillRequest(header=h),
                *_chunks(pb.PrefillRequest, {pb.Q: self.q, pb.K: self.k, pb.V: self.v})]


def _header_of(good: Good, **changes: Any) -> pb.PrefillHeader:
    h = good.messages()[0].header
    for name, value in changes.items():
        if isinstance(value, pb.TensorSpec):
            getattr(h, name).CopyFrom(value)
        elif isinstance(value, list):
            getattr(h, name)[:] = value
        else:
            setattr(h, name, value)
    return h


def _slow(msgs: list[Any], pause_after: int, pause: float) -> Iterator[Any]:
    """The messages, with a pause after the first ``pause_after`` (a stalled upload)."""
    for i, m in enumerate(msgs):
        if i == pause_after:
            time.sleep(pause)
        yield m


class Chaos:
    """Cases of bad input, each with the status docs/service.md promises for it."""

    def __init__(self, channel: grpc.Channel, good: Good) -> None:
        self.channel, self.good = channel, good
        self.stub = pb_grpc.AttentionServiceStub(channel)
        self.raw_prefill = channel.stream_stream(SERVICE + "Prefill", request_serializer=None,
                                                 response_deserializer=pb.AttentionResponse.FromString)
        self.raw_info = channel.unary_unary(SERVICE + "GetServerInfo", request_serializer=None,
                                            response_deserializer=pb.ServerInfo.FromString)
        self.sent: Counter[tuple[str, str]] = Counter()  # (case, expected code)
        self.got: Counter[tuple[str, str, str]] = Counter()  # (case, expected, got)
        self.wrong: list[str] = []
        self.good_calls = 0
        self.max_err = 0.0
        self.bad_good_calls: list[str] = []

    def cases(self) -> dict[str, tuple[grpc.StatusCode, str, Callable[[], Any]]]:
        """name -> (expected status, rpc the server counts it under, call)."""
        g = self.good
        ok_msgs = g.messages()
        chunks = ok_msgs[1:]
        t = 30.0
        big = 1 << 20
        return {
            "garbage_bytes": (grpc.StatusCode.INVALID_ARGUMENT, "Prefill", lambda: list(
                self.raw_prefill(iter([b"\xff\xff\xff\xff\x0f" * 64]), timeout=t))),
            "unknown_dtype": (grpc.StatusCode.INVALID_ARGUMENT, "Prefill", lambda: list(
                self.stub.Prefill(iter([pb.PrefillRequest(header=_header_of(
                    g, q=_spec(g.q.shape, 99))), *chunks]), timeout=t))),
            "bad_cu_seqlens": (grpc.StatusCode.INVALID_ARGUMENT, "Prefill", lambda: list(
                self.stub.Prefill(iter([pb.PrefillRequest(header=_header_of(
                    g, cu_seqlens_q=[0, 30, 20, 40])), *chunks]), timeout=t))),
            "missing_bytes": (grpc.StatusCode.INVALID_ARGUMENT, "Prefill", lambda: list(
                self.stub.Prefill(iter(ok_msgs[:2]), timeout=t))),
            "heads_ratio": (grpc.StatusCode.RESOURCE_EXHAUSTED, "Prefill", lambda: list(
                self.stub.Prefill(iter([pb.PrefillRequest(header=pb.PrefillHeader(
                    q=_spec((8, 512, 32)), k=_spec((8, 1, 32)), v=_spec((8, 1, 32)),
                    cu_seqlens_q=[0, 8]))]), timeout=t))),
            "declared_too_big": (grpc.StatusCode.RESOURCE_EXHAUSTED, "Prefill", lambda: list(
                self.stub.Prefill(iter([pb.PrefillRequest(header=pb.PrefillHeader(
                    q=_spec((big, 64, 128)), k=_spec((big, 64, 128)),
                    v=_spec((big, 64, 128)), cu_seqlens_q=[0, big]))]), timeout=t))),
            "sequences_flood": (grpc.StatusCode.RESOURCE_EXHAUSTED, "Prefill", lambda: list(
                self.stub.Prefill(iter([pb.PrefillRequest(header=pb.PrefillHeader(
                    q=_spec((big, 1, 8)), k=_spec((big, 1, 8)), v=_spec((big, 1, 8)),
                    cu_seqlens_q=range(big + 1)))]), timeout=t))),
            "unknown_cache": (grpc.StatusCode.NOT_FOUND, "CacheDecode", lambda: list(
                self.stub.CacheDecode(iter([pb.DecodeRequest(header=pb.DecodeHeader(
                    q=_spec((1, 4, 32)), k=_spec((0, 2, 32)), v=_spec((0, 2, 32)),
                    cache=pb.CacheTarget(cache_ids=["soak-no-such-cache"]))),
                    pb.DecodeRequest(chunks=[pb.TensorChunk(
                        field=pb.Q, offset=0, data=bytes(4 * 4 * 32))])]), timeout=t))),
            "corrupt_unary": (grpc.StatusCode.INVALID_ARGUMENT, "GetServerInfo", lambda:
                              self.raw_info(b"\x0a\xff\xff\xff\xff\xff", timeout=t)),
            # Cut off mid-upload: the header and one chunk, then the client stops.
            "cancel_mid_upload": (grpc.StatusCode.CANCELLED, "Prefill", self._cancelled),
            "deadline_mid_upload": (grpc.StatusCode.DEADLINE_EXCEEDED, "Prefill", lambda: list(
                self.stub.Prefill(_slow(ok_msgs, 2, 1.0), timeout=0.3))),
        }

    def _cancelled(self) -> None:
        call = self.stub.Prefill(_slow(self.good.messages(), 2, 5.0), timeout=30)
        time.sleep(0.2)
        call.cancel()
        list(call)

    def good_call(self) -> None:
        out = np.zeros_like(self.good.want, dtype=np.float32)
        filled = 0
        for r in self.stub.Prefill(iter(self.good.messages()), timeout=30):
            c = r.chunk
            if r.HasField("chunk") and c.field == pb.OUT:
                rows = np.frombuffer(c.data, np.float32).reshape(c.row_count, *out.shape[1:])
                out[c.row_start : c.row_start + c.row_count] = rows
                filled += len(c.data)
        # The kernel tests' float32 tolerance on a GPU (tests/kernels/conftest.py): tl.dot
        # runs float32 as TF32 there, ~2e-3 off the float64 reference.
        excess = np.abs(out - self.good.want) - (GOOD_TOL + GOOD_TOL * np.abs(self.good.want))
        err = float(np.abs(out - self.good.want).max())
        self.max_err = max(self.max_err, err)
        self.good_calls += 1
        if filled != out.nbytes or not float(excess.max()) <= 0:
            self.bad_good_calls.append(f"filled {filled}/{out.nbytes}, max err {err}")

    def round(self) -> None:
        for name, (code, _rpc, call) in self.cases().items():
            self.sent[(name, code.name)] += 1
            try:
                call()
                got = "OK"
            except grpc.RpcError as e:
                got = e.code().name
            self.got[(name, code.name, got)] += 1
            if got != code.name:
                self.wrong.append(f"{name}: expected {code.name}, got {got}")
        self.good_call()

    def expected_server_counts(self) -> Counter[tuple[str, str]]:
        """(rpc, code) -> how many the server should have counted."""
        rpc_of = {name: rpc for name, (_c, rpc, _f) in self.cases().items()}
        want: Counter[tuple[str, str]] = Counter()
        for (name, code), n in self.sent.items():
            want[(rpc_of[name], code)] += n
        return want


# ---- the server and its processes ---------------------------------------------------------

def _children(pid: int) -> list[int]:
    kids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(p.name))
    return kids


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _gpu_bytes(pids: set[int]) -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    total = 0
    for line in out.strip().splitlines():
        pid, mib = (x.strip() for x in line.split(","))
        if pid.isdigit() and int(pid) in pids:
            total += int(mib) * MiB
    return total


def _metric_counts(text: str, name: str) -> Counter[tuple[str, str]]:
    counts: Counter[tuple[str, str]] = Counter()
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        counts[(labels.get("rpc", ""), labels.get("code", ""))] += int(float(line.split()[-1]))
    return counts


def _torch_memory(mport: int) -> dict[str, int | None]:
    """The engine's torch allocator: live tensor bytes (a leak shows here) and bytes reserved
    by its caching allocator (grows in steps as new shapes and CUDA-graph pools appear)."""
    out: dict[str, int | None] = {"allocated_bytes": None, "reserved_bytes": None}
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read()
    except OSError:
        return out
    for line in text.decode().splitlines():
        for key in out:
            if line.startswith(f"attention_gpu_memory_{key} "):
                out[key] = int(float(line.split()[-1]))
    return out


def _locust_failures(csv_path: Path) -> tuple[int, int]:
    with csv_path.open() as f:
        for row in csv.DictReader(f):
            if row["Name"] == "Aggregated":
                return int(row["Request Count"]), int(row["Failure Count"])
    return 0, 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=int, default=600, help="seconds of Locust load")
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--settle", type=int, default=60, help="seconds before the start sample")
    ap.add_argument("--sample-every", type=float, default=10.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    port, mport = _free_port(), _free_port()
    env = dict(os.environ, ATTENTION_HOST="127.0.0.1", ATTENTION_PORT=str(port),
               ATTENTION_METRICS_PORT=str(mport), ATTENTION_DEVICE=args.device,
               ATTENTION_LOG_LEVEL="WARNING")
    server = subprocess.Popen(["attention-server"], env=env)
    try:
        return _soak(args, server, port, mport)
    finally:  # never leave a server or a load generator behind
        if server.poll() is None:
            server.kill()


def _soak(args: argparse.Namespace, server: subprocess.Popen, port: int, mport: int) -> int:
    target = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(target)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)

    def serving() -> bool:
        try:
            r = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    t0 = time.time()
    while not serving():
        if server.poll() is not None:
            print("server exited before SERVING", file=sys.stderr)
            return 1
        time.sleep(1)
    print(f"server SERVING after {time.time() - t0:.0f} s", flush=True)

    locust = subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest/locustfile.py"),
         "--headless", "-u", str(args.users), "-r", "8", "-t", f"{args.duration}s",
         "--stop-timeout", "30", "--host", target, "--csv", str(args.out / "soak_locust"),
         "--only-summary"], env=dict(os.environ, LOADTEST_TIMEOUT="120"))
    try:
        return _drive(args, server, locust, channel, serving, mport)
    finally:
        if locust.poll() is None:
            locust.kill()


def _drive(args: argparse.Namespace, server: subprocess.Popen, locust: subprocess.Popen,
           channel: grpc.Channel, serving: Callable[[], bool], mport: int) -> int:
    start = time.time()
    chaos = Chaos(channel, Good.make())
    samples: list[dict[str, Any]] = []
    health_misses = 0
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            pids = _tree(server.pid)
            rss = {p: _rss(p) for p in pids}
            torch_mem = _torch_memory(mport)
            samples.append({"t": round(time.time() - start, 1), "processes": len(pids),
                            "rss_bytes": sum(rss.values()),
                            "gpu_bytes": _gpu_bytes(set(pids)), **torch_mem})
            stop.wait(args.sample_every)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rounds = 0
    while locust.poll() is None:
        chaos.round()
        rounds += 1
        if not serving():
            health_misses += 1
        time.sleep(0.5)
    stop.set()
    sampler.join(timeout=30)
    locust_rc = locust.returncode
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=30).read()
    (args.out / "soak_metrics.txt").write_bytes(metrics)
    server_counts = _metric_counts(metrics.decode(), "attention_requests_total")
    server.send_signal(signal.SIGTERM)
    try:
        server_rc = server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        server.kill()
        server_rc = -9

    with (args.out / "soak_memory.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["t", "processes", "rss_bytes", "gpu_bytes",
                                          "allocated_bytes", "reserved_bytes"])
        w.writeheader()
        w.writerows(samples)
    loaded = [s for s in samples if s["t"] >= args.settle] or samples
    first, last = loaded[0], loaded[-1]
    rss_growth = last["rss_bytes"] - first["rss_bytes"]
    def growth(key: str) -> int | None:
        a, b = first.get(key), last.get(key)
        return None if a is None or b is None else b - a

    gpu_growth = growth("gpu_bytes")
    alloc_growth = growth("allocated_bytes")
    reserved_growth = growth("reserved_bytes")
    requests, failures = _locust_failures(args.out / "soak_locust_stats.csv")
    want = chaos.expected_server_counts()
    count_mismatch = {f"{rpc} {code}": {"caused": n, "server": server_counts[(rpc, code)]}
                      for (rpc, code), n in want.items() if server_counts[(rpc, code)] != n}
    internal = {f"{rpc} {code}": n for (rpc, code), n in server_counts.items()
                if code in ("UNKNOWN", "INTERNAL") and n}
    checks = {
        "locust ran and no good call failed": locust_rc == 0 and requests > 0 and failures == 0,
        "every bad call got its documented status": not chaos.wrong,
        "the server counted each bad status exactly": not count_mismatch,
        "no UNKNOWN or INTERNAL": not internal,
        "known prefill correct every round": not chaos.bad_good_calls,
        "health SERVING every round": health_misses == 0,
        f"RSS flat (<= {RSS_SLACK // MiB} MiB growth)": rss_growth <= RSS_SLACK,
        # Live tensors must not grow. What the device reports (nvidia-smi) also holds the
        # caching allocator's reserve and CUDA-graph pools, bounded but filled lazily: reported.
        f"GPU live tensors flat (<= {GPU_SLACK // MiB} MiB growth)":
            alloc_growth is None or alloc_growth <= GPU_SLACK,
        "server exit 0 on SIGTERM": server_rc == 0,
    }
    summary = {
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                            time.gmtime()),
        "duration_s": args.duration, "users": args.users, "device": args.device,
        "locust": {"rc": locust_rc, "requests": requests, "failures": failures},
        "chaos": {"rounds": rounds, "bad_calls": sum(chaos.sent.values()),
                  "by_case": {f"{n} -> {g}": c for (n, _e, g), c in sorted(chaos.got.items())},
                  "wrong": chaos.wrong[:50], "good_calls": chaos.good_calls,
                  "good_max_abs_err": chaos.max_err,
                  "bad_good_calls": chaos.bad_good_calls[:20]},
        "server_counts_mismatch": count_mismatch, "unknown_or_internal": internal,
        "health_misses": health_misses, "server_exit": server_rc,
        "memory": {"settle_s": args.settle, "start": first, "end": last,
                   "rss_growth_bytes": rss_growth, "gpu_growth_bytes": gpu_growth,
                   "allocated_growth_bytes": alloc_growth,
                   "reserved_growth_bytes": reserved_growth,
                   "gpu_bytes_max": max((s["gpu_bytes"] or 0) for s in loaded)},
        "checks": checks, "passed": all(checks.values()),
    }
    (args.out / "soak_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [f"# Soak, {summary['date']}", "", f"`{summary['command']}`", "",
             f"Locust: {requests} requests, {failures} failures (rc {locust_rc}); chaos: "
             f"{rounds} rounds, {summary['chaos']['bad_calls']} bad calls, "
             f"{chaos.good_calls} checked good calls (max abs error {chaos.max_err:.2g}).", "",
             "| memory | start | end | growth |", "|---|---|---|---|",
             f"| RSS, all server processes (MiB) | {first['rss_bytes'] / MiB:.0f} | "
             f"{last['rss_bytes'] / MiB:.0f} | {rss_growth / MiB:+.1f} |"]
    for key, label in (("allocated_bytes", "GPU live tensors, torch allocated"),
                       ("reserved_bytes", "GPU reserved by torch's caching allocator"),
                       ("gpu_bytes", "GPU memory of the server processes, nvidia-smi")):
        g = growth(key)
        if g is not None:
            lines.append(f"| {label} (MiB) | {first[key] / MiB:.0f} | {last[key] / MiB:.0f} | "
                         f"{g / MiB:+.1f} |")
    lines += ["", "| bad call -> status | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in summary["chaos"]["by_case"].items()]
    lines += ["", "| check | result |", "|---|---|"]
    lines += [f"| {k} | {'pass' if v else '**FAIL**'} |" for k, v in checks.items()]
    (args.out / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
