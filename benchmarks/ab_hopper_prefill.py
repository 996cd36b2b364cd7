"""A/B of the Gluon prefill against another build of ``prefill_hopper.py``, in one process.

    git show HEAD:kernels/attention_kernels/prefill_hopper.py > /tmp/base_prefill_hopper.py
    python benchmarks/ab_hopper_prefill.py --base /tmp/base_prefill_hopper.py --rounds 3

Both builds launch with the tiles ``prefill()`` serves (persistent, tiles claimed from a
counter) on bench_kernels' dense rows (bf16 ``B * N = 16K``, ``H * D = 2048``), checked
against each other and against SDPA cuDNN before timing; then the two and cuDNN are timed in
turn ``--rounds`` times (the first kernel timed in a row once read 7-17% low) and the medians
kept. Writes ``ab_hopper_prefill_<gpu>.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import bench, dense_inputs, flops, rel, sdpa

from attention_kernels import prefill_hopper
from attention_kernels.configs import num_sms
from attention_kernels.prefill_kernel import _GLUON_TILES

LOG2E = 1.4426950408889634


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("base_prefill_hopper", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def launcher(mod, q, k, v, cu, out, causal: bool):
    """``mod``'s kernel as ``prefill()`` serves it: its tile, persistent, dynamic."""
    def run():
        mod.hopper_prefill_ws(q, k, v, cu, cu, out, None, causal, LOG2E / math.sqrt(q.shape[2]),
                              programs=num_sms(q.device.index or 0), dynamic=True,
                              **_GLUON_TILES[q.shape[2]])
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the other build's prefill_hopper.py")
    p.add_argument("--ns", default="4096,8192,16384")
    p.add_argument("--dims", default="128,64")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    base = load_module(args.base)
    dtype = getattr(torch, args.dtype)
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        heads = 2048 // d
        for causal in (False, True):
            for n in (int(x) for x in args.ns.split(",")):
                b = 16384 // n
                (q, k, v), (qp, kp, vp), cu = dense_inputs(b, heads, n, d, dtype)
                fl = flops([n] * b, [n] * b, heads, d, causal)
                cudnn = sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal)
                want = cudnn().transpose(1, 2).reshape(b * n, heads, d)
                fns = {"cudnn": cudnn}
                for name, mod in (("base", base), ("new", prefill_hopper)):
                    out = torch.full_like(qp, float("nan"))
                    fns[name] = launcher(mod, qp, kp, vp, cu, out, causal)
                    fns[name]()
                    err = rel(out, want)
                    if not err < 2e-2:  # NaN fails too (rel: inf)
                        raise SystemExit(f"{name} D{d} N{n} causal={causal}: rel err {err}")
                runs: dict[str, list[float]] = {name: [] for name in fns}
                for _ in range(args.rounds):
                    for name, fn in fns.items():
                        runs[name].append(fl / bench(fn) / 1e9)
                row = {"D": d, "N": n, "B": b, "H": heads, "causal": causal,
                       "dtype": args.dtype, "runs": runs}
                row.update({name: statistics.median(r) for name, r in runs.items()})
                rows.append(row)
                print(f"D{d} {'causal' if causal else 'full  '} N {n:5d}: cudnn "
                      f"{row['cudnn']:6.1f} base {row['base']:6.1f} new {row['new']:6.1f} "
                      f"TFLOP/s | new/base {row['new'] / row['base']:.3f} new/cudnn "
                      f"{row['new'] / row['cudnn']:.3f} | "
                      + " ".join(f"{name} " + "/".join(f"{x:.0f}" for x in r)
                                 for name, r in runs.items()), flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    (out_dir / f"ab_hopper_prefill_{gpu.replace(' ', '_')}.json").write_text(json.dumps({
        "command": "python " + " ".join(sys.argv), "gpu": gpu,
        "date": datetime.now(timezone.utc).isoformat(), "torch": torch.__version__,
        "triton": triton.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
