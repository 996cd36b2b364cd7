"""Cold and warm start of ``attention_kernels.warmup``: seconds from an empty Triton cache with 1
(everything compiled in-process) and N worker processes, then a restart on the filled cache.

    python benchmarks/bench_warmup.py [--workers 1,4,8] [--page-tokens 16] [--profile]
        [--out DIR]

Each run is a fresh Python process (imports and CUDA start-up included, as a server pays them)
with its own empty ``TRITON_CACHE_DIR``; the restart reuses the last run's cache.
``--profile``: first, in one more process from an empty cache, each warm-up call timed on its
own (in-process, in order): the slowest calls and the sum, what the workers share out.
``--server``: then ``attention-server`` as the container starts it (the default worker count),
from an empty cache and again on the filled one: seconds until the health check says SERVING
(the kernels' warm-up plus the service's own: fp32 and FP8 launches, KV-cache paths, decode
graphs).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# What every run warms: bf16 + fp16 at head dims 64 and 128, the page sizes of argv[1].
SPEC = """
import sys, time, torch
from attention_kernels.kernel_warmup import WarmupSpec, warmup_calls
spec = WarmupSpec((64, 128), (torch.bfloat16, torch.float16), "cuda:0", True,
                  tuple(int(p) for p in sys.argv[1].split(",") if p))
"""

RUN = SPEC + """
import resource
from attention_kernels import warmup
t = warmup(spec.head_dims, spec.dtypes, spec.device, page_tokens=spec.page_tokens,
           workers=int(sys.argv[2]))
# The largest worker's peak resident memory (children waited for; 0 without workers).
print(f"rss_mib {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f}")
print(f"warmup {t:.1f}")
"""

PROFILE = SPEC + """
import json
rows = []
for call in warmup_calls(spec):
    t = time.perf_counter()
    call()
    torch.cuda.synchronize()
    graphs = getattr(call, "func", None) is not None and call.func.__name__ == "_for_graphs"
    inner = call.args[0] if graphs else call  # the decode it repeats for CUDA graphs
    f = getattr(inner, "func", inner)
    args = getattr(inner, "args", ())
    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)][:2]
    kw = {k: str(v) for k, v in getattr(inner, "keywords", {}).items()}
    kw["graphs"] = str(graphs)
    rows.append({"s": time.perf_counter() - t, "fn": getattr(f, "__name__", str(f)),
                 "dtype": str(args[0].dtype) if args and isinstance(args[0], torch.Tensor)
                 else "", "shapes": shapes, "kw": kw})
print("PROFILE" + json.dumps(rows))
"""


def python(script: str, cache: Path, *argv: str) -> tuple[float, str]:
    """(wall seconds, stdout) of ``script`` in a fresh Python with ``cache`` as Triton's."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script, *argv], env=env, capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv}: rc {proc.returncode}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0, proc.stdout


def profile(pages: str, cache: Path) -> list[dict]:
    return json.loads(python(PROFILE, cache, pages)[1].split("PROFILE")[-1])


def run(workers: int, pages: str, cache: Path) -> tuple[float, float, float]:
    """(wall seconds of the whole process, seconds ``warmup`` reported, the largest worker's
    peak RSS in MiB)."""
    wall, out = python(RUN, cache, pages, str(workers))
    rss = float(out.split("rss_mib")[-1].split()[0])
    return wall, float(out.split("warmup")[-1]), rss


def server_start(cache: Path, port: int = 50077) -> float:
    """Seconds from launching ``attention-server`` until it reports SERVING; then SIGTERM."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "ATTENTION_HOST": "127.0.0.1",
           "ATTENTION_PORT": str(port), "ATTENTION_METRICS_PORT": str(port + 1),
           "ATTENTION_DEVICE": "cuda", "ATTENTION_LOG_LEVEL": "WARNING"}
    env.pop("ATTENTION_KERNELS_WARMUP_WORKERS", None)  # the default, as a container has it
    probe = [sys.executable, str(Path(__file__).resolve().parent.parent / "deploy" /
                                 "healthcheck.py"), f"127.0.0.1:{port}"]
    t0 = time.perf_counter()
    server = subprocess.Popen(["attention-server"], env=env)
    try:
        while subprocess.run(probe, capture_output=True).returncode != 0:
            if server.poll() is not None:
                raise RuntimeError(f"attention-server exited with {server.returncode}")
            if time.perf_counter() - t0 > 1500:
                raise RuntimeError("attention-server not SERVING after 1500 s")
            time.sleep(0.5)
        return time.perf_counter() - t0
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,16", help="comma list of worker counts")
    ap.add_argument("--page-tokens", default="16", help="comma list (empty: no paged variants)")
    ap.add_argument("--profile", action="store_true", help="time each call (cold, in order)")
    ap.add_argument("--server", action="store_true", help="time attention-server to SERVING")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows, calls = [], []
    print(f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs; bf16 + fp16, D 64 + 128, "
          f"pages {args.page_tokens or '-'}")
    print(f"{'start':<22} {'process s':>10} {'warmup s':>9} {'worker RSS MiB':>15}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.profile:
            calls = profile(args.page_tokens, Path(tmp) / "cache_profile")
            slow = sorted(calls, key=lambda r: -r["s"])
            print(f"{len(calls)} calls, {sum(r['s'] for r in calls):.1f} s in all; "
                  f"{sum(r['s'] > 0.3 for r in calls)} over 0.3 s (compiles); slowest:")
            for r in slow[:15]:
                print(f"  {r['s']:6.1f} s  {r['fn']} {r['dtype']} {r['shapes']} {r['kw']}")
            save(args, rows, calls)
        for w in (int(x) for x in args.workers.split(",")):
            cache = Path(tmp) / f"cache_{w}"
            wall, inner, rss = run(w, args.page_tokens, cache)
            rows.append({"start": "cold", "workers": w, "process_s": wall, "warmup_s": inner,
                         "worker_rss_mib": rss})
            print(f"{f'cold, {w} worker(s)':<22} {wall:>10.1f} {inner:>9.1f} {rss:>15.0f}",
                  flush=True)
            save(args, rows, calls)
        wall, inner, _ = run(1, args.page_tokens, cache)
        rows.append({"start": "warm", "workers": 1, "process_s": wall, "warmup_s": inner})
        print(f"{'restart, warm cache':<22} {wall:>10.1f} {inner:>9.1f}", flush=True)
        if args.server:
            save(args, rows, calls)
            for start in ("cold", "warm"):
                secs = server_start(Path(tmp) / "cache_server")
                rows.append({"start": f"server {start}", "serving_s": secs})
                print(f"{f'server, {start} cache':<22} {secs:>10.1f}  (to SERVING)", flush=True)
    save(args, rows, calls)


def save(args: argparse.Namespace, rows: list[dict], calls: list[dict]) -> None:
    if args.out:  # after every run: a later one may not finish within its limit
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_warmup.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "cpus": os.cpu_count(),
             "page_tokens": args.page_tokens, "date": time.strftime("%Y-%m-%d"),
             "command": " ".join(sys.argv), "rows": rows, "profile": calls}, indent=1))


if __name__ == "__main__":
    main()
