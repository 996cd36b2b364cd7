"""Pick the batching defaults by measurement: the executor alone (bench_batching.py's driver)
over a grid of ``--max-batch-tokens`` x ``--max-queue-delay-ms``, plus the no-batching
baseline, at each client count. Prints req/s, p99 and mean batch per setting; writes JSON.

    python tools/tuning/tune_batching.py                        # GPU: 8/64 clients, 3 x 4 grid
    python tools/tuning/tune_batching.py --device cpu --clients 4 --tokens 64,256 --delays-ms 0,2 \
        --duration 0.5 --max-len 48 --heads 4 --kv-heads 2 --head-dim 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from attention_service.engine.backends import make_backend

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_batching import make_jobs, parse_args, run_side
from bench_service import _slug


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="4096,16384,65536", help="max_batch_tokens values")
    p.add_argument("--delays-ms", default="0,0.5,2,5", help="max_queue_delay_ms values")
    own, rest = p.parse_known_args(argv)
    if "--clients" not in rest:
        rest += ["--clients", "8,64"]
    args = parse_args([*rest, "--verify", "0"])
    t0 = time.time()
    backend = make_backend(args.device)
    backend.warmup()
    pool = make_jobs(args, backend, args.pool, args.seed)
    settings: list[tuple[str, int | None, float | None]] = [("off", None, None)]
    settings += [("on", int(t), float(d)) for t in own.tokens.split(",")
                 for d in own.delays_ms.split(",")]
    rows: list[dict[str, Any]] = []
    for side, tokens, delay in settings:
        args.max_batch_tokens, args.max_queue_delay_ms = tokens, delay
        for r in asyncio.run(run_side(args, backend, side, pool, [])):
            r.update(max_batch_tokens=tokens, max_queue_delay_ms=delay)
            rows.append(r)
    print(f"\n{backend.device_name}: executor alone, {args.mode} {args.dtype} H{args.heads}/"
          f"{args.kv_heads} D{args.head_dim}, lengths {args.min_len}..{args.max_len}")
    print(f"{'tokens':>8} {'delay ms':>8} " + " ".join(
        f"{f'req/s@{n}':>10} {f'p99@{n}':>8} {f'batch@{n}':>8}" for n in args.client_counts))
    for side, tokens, delay in settings:
        cells = []
        for n in args.client_counts:
            r = next(x for x in rows if x["clients"] == n and x["max_batch_tokens"] == tokens
                     and x["max_queue_delay_ms"] == delay and x["side"] == side)
            cells.append(f"{r['rps']:10.1f} {r['p99_ms']:8.2f} {r['mean_batch_requests']:8.2f}")
        label = ("off", "-") if side == "off" else (str(tokens), f"{delay:g}")
        print(f"{label[0]:>8} {label[1]:>8} " + " ".join(cells))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"tune_batching_{_slug(backend.device_name)}.json"
    path.write_text(json.dumps({
        "command": " ".join(["tune_batching.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds": round(time.time() - t0, 1), "device": backend.device_name,
        "results": rows,
    }, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return 0 if all(r["errors"] == 0 and r["completed"] > 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
