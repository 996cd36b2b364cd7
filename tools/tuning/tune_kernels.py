"""Sweep launch configs on a GPU; the winners go into attention_kernels/configs.py by hand.

    python tools/tuning/tune_kernels.py [--out DIR]
        [--only prefill|decode|prefill-ws|prefill-short|prefill-varlen]

Prefill: dense bf16 packed batches (batch*N = 16K tokens, N = 8K, 2048 / D heads), causal and
not, per padded head dim. Decode: (batch, ctx) = (1, 32K) and (16, 32K), 32q/8kv heads, D 128.
Each config is checked against the default before timing; failures (e.g. out of shared memory)
are reported and skipped. ``prefill-ws``: Triton's automatic warp specialization of the unmasked
key loop (``PrefillConfig.warp_specialize``) against the table's tiles and SDPA cuDNN, same run.
``prefill-short``: batches of equal sequences (512-2048 tokens unless ``--lengths``), tile
configs (a grid, or ``--configs``) against the default and SDPA cuDNN, same run.
``prefill-varlen``: GPU time of the default and ``--configs`` tiles on bench_kernels.py's
varlen batches (launches of a few waves).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_kernels import VARLEN_BATCHES, cu, graph_us, rel  # rel: NaN is inf

from attention_kernels import decode, prefill
from attention_kernels.configs import DecodeConfig, PrefillConfig


def bench(fn) -> float:
    """Shorter than bench_kernels' ``bench``: a sweep times hundreds of configs."""
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def prefill_cases(head_dims: tuple[int, ...]) -> Iterator[tuple[int, bool, tuple, float]]:
    """(D, causal, (q, k, v, cu), FLOPs): dense bf16, 2 sequences of N = 8K, 2048 / D heads."""
    n, batch = 8192, 2
    for d in head_dims:
        heads = 2048 // d
        q, k, v = (torch.randn(batch * n, heads, d, dtype=torch.bfloat16, device="cuda")
                   for _ in range(3))
        cu = torch.tensor([0, n, 2 * n], dtype=torch.int32, device="cuda")
        for causal in (False, True):
            yield d, causal, (q, k, v, cu), 4.0 * n * n * heads * d * batch / (2 if causal else 1)


def config_tflops(inputs: tuple, causal: bool, cfg: PrefillConfig, ref: torch.Tensor,
                  flops: float) -> float:
    """TFLOP/s of ``prefill`` with ``cfg``, after checking it against ``ref``; raises when it
    cannot compile, run, or answer right."""
    fn = lambda: prefill(*inputs, causal=causal, _config=cfg)  # noqa: E731
    err = rel(fn(), ref)
    if err > 1e-2:
        raise RuntimeError(f"wrong result: rel err {err:.3g}")
    return flops / bench(fn) / 1e9


def error_text(e: Exception) -> str:
    return str(e).splitlines()[0][:100] if str(e) else type(e).__name__


def tune_prefill(results: list[dict]) -> None:
    for d, causal, inputs, fl in prefill_cases((64, 128)):
        ref = prefill(*inputs, causal=causal)
        best = None
        for bm, bn, w, st in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4)):
            cfg = PrefillConfig(bm, bn, w, st)
            row = {"op": "prefill", "D": d, "causal": causal, "cfg": str(cfg)}
            try:
                tf = config_tflops(inputs, causal, cfg, ref, fl)
            except Exception as e:  # noqa: BLE001 - a config that cannot compile or run
                results.append({**row, "error": error_text(e)})
                continue
            results.append({**row, "TFLOPs": tf})
            if best is None or tf > best[0]:
                best = (tf, cfg)
        print(f"prefill D={d} causal={causal}: best {best}", flush=True)


def tune_prefill_ws(results: list[dict]) -> None:
    for d, causal, inputs, fl in prefill_cases((128, 64)):
        q, k, v, cu = inputs
        qd, kd, vd = (t.unflatten(0, (2, -1)).transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            cudnn = fl / bench(lambda: F.scaled_dot_product_attention(  # noqa: B023
                qd, kd, vd, is_causal=causal)) / 1e9  # noqa: B023
        ref = prefill(*inputs, causal=causal)
        default = fl / bench(lambda: prefill(*inputs, causal=causal)) / 1e9  # noqa: B023
        line = [f"prefill D={d} causal={causal}: cuDNN {cudnn:.0f} TFLOP/s, "
                f"ours default {default:.0f} ({default / cudnn:.2f}x)"]
        for bm, bn, w, st in itertools.product((128,), (64, 128), (4, 8), (2, 3)):
            cfg = PrefillConfig(bm, bn, w, st, warp_specialize=True)
            row = {"op": "prefill-ws", "D": d, "causal": causal, "cfg": str(cfg)}
            try:
                tf = config_tflops(inputs, causal, cfg, ref, fl)
            except Exception as e:  # noqa: BLE001 - a config that cannot compile or run
                print(f"  {bm}x{bn} w{w} s{st} ws: {error_text(e)}", flush=True)
                results.append({**row, "error": error_text(e)})
                continue
            print(f"  {bm}x{bn} w{w} s{st} ws: {tf:.0f} TFLOP/s ({tf / cudnn:.2f}x cuDNN)",
                  flush=True)
            results.append({**row, "TFLOPs": tf, "cudnn_TFLOPs": cudnn,
                            "default_TFLOPs": default})
            line.append(f"{bm}x{bn}w{w}s{st} {tf:.0f}")
        print(" | ".join(line), flush=True)


# prefill-short: batches of equal sequences of 16K tokens in all (short ones: a batch of
# prompts, where a program streams only a few key blocks and the 8K-token table rows may not be
# the best tiles). ``--lengths`` / ``--configs`` override the grid (e.g. to check a candidate
# tile on long sequences too).
SHORT_LENGTHS = (512, 1024, 2048)
SHORT_GRID = [PrefillConfig(bm, bn, w, st)
              for bm, bn, w, st in itertools.product((64, 128), (64, 128), (4, 8), (2, 3))]


def parse_configs(text: str) -> list[PrefillConfig]:
    """``BMxBNxWARPSxSTAGES`` items, comma separated."""
    return [PrefillConfig(*(int(x) for x in item.split("x"))) for item in text.split(",")]


def tune_prefill_short(results: list[dict], lengths: tuple[int, ...], grid: list[PrefillConfig],
                       head_dims: tuple[int, ...], rounds: int) -> None:
    for d in head_dims:
        heads = 2048 // d
        for n, causal in itertools.product(lengths, (True, False)):
            batch = 16384 // n
            q, k, v = (torch.randn(batch * n, heads, d, dtype=torch.bfloat16, device="cuda")
                       for _ in range(3))
            cu = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * n
            fl = 4.0 * n * n * heads * d * batch / (2 if causal else 1)
            qd, kd, vd = (t.unflatten(0, (batch, n)).transpose(1, 2) for t in (q, k, v))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                cudnn = fl / bench(lambda: F.scaled_dot_product_attention(  # noqa: B023
                    qd, kd, vd, is_causal=causal)) / 1e9  # noqa: B023
            ref = prefill(q, k, v, cu, causal=causal)
            # Every config, then again (alternating): the median of ``rounds`` runs each.
            runs: dict[str, list[float]] = {}
            for _ in range(rounds):
                runs.setdefault("default", []).append(
                    fl / bench(lambda: prefill(q, k, v, cu, causal=causal)) / 1e9)  # noqa: B023
                for cfg in grid:
                    name = f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
                    try:
                        runs.setdefault(name, []).append(
                            config_tflops((q, k, v, cu), causal, cfg, ref, fl))
                    except Exception as e:  # noqa: BLE001 - a config that cannot compile/run
                        results.append({"op": "prefill-short", "D": d, "N": n, "B": batch,
                                        "causal": causal, "cfg": name, "error": error_text(e)})
            tf = {name: sorted(v)[len(v) // 2] for name, v in runs.items() if v}
            for name, value in tf.items():
                results.append({"op": "prefill-short", "D": d, "N": n, "B": batch,
                                "causal": causal, "cfg": name, "TFLOPs": value,
                                "cudnn_TFLOPs": cudnn, "default_TFLOPs": tf["default"]})
            best = max(tf, key=tf.get)
            cells = " | ".join(f"{name} {value:.0f}" for name, value in tf.items())
            print(f"prefill-short D={d} {batch}x{n} causal={causal}: cuDNN {cudnn:.0f} | "
                  f"{cells} | best {best} ({tf[best] / cudnn:.2f}x cuDNN, "
                  f"{tf[best] / tf['default']:.3f}x default)", flush=True)


def tune_prefill_varlen(results: list[dict], grid: list[PrefillConfig], rounds: int) -> None:
    """GPU time (CUDA-graph replays) of the default tiles and ``grid`` on bench_kernels.py's
    varlen batches (plus two mid-size dense ones), 16 heads x 128 bf16: launches of a few waves
    of programs, where the time is the longest programs' latency rather than throughput."""
    heads, d = 16, 128
    for lens in [*VARLEN_BATCHES, [2048] * 4, [4096] * 2]:
        q, k, v = (torch.randn(sum(lens), heads, d, dtype=torch.bfloat16, device="cuda")
                   for _ in range(3))
        cus = cu(lens)
        for causal in (True, False):
            us: dict[str, list[float]] = {}
            ref = prefill(q, k, v, cus, causal=causal, max_seqlen_q=max(lens))
            for _ in range(rounds):
                for cfg in (None, *grid):
                    name = ("default" if cfg is None else
                            f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}")
                    fn = lambda cfg=cfg: prefill(q, k, v, cus, causal=causal,  # noqa: B023
                                                 max_seqlen_q=max(lens), _config=cfg)  # noqa: B023
                    if rel(fn(), ref) > 1e-2:
                        raise SystemExit(f"{lens} {name}: wrong result")
                    us.setdefault(name, []).append(graph_us(fn))
            best = {name: min(v) for name, v in us.items()}
            results.append({"op": "prefill-varlen", "lens": lens, "causal": causal,
                            "gpu_us": best})
            print(f"{str(lens)[:28]:<28} causal={causal!s:<5} GPU us: "
                  + " | ".join(f"{name} {t:7.1f}" for name, t in best.items()), flush=True)


def tune_decode(results: list[dict]) -> None:
    heads, kv_heads, d = 32, 8, 128
    for batch, ctx in ((1, 32768), (16, 32768), (128, 2048)):
        q = torch.randn(batch, heads, d, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.randn(batch * ctx, kv_heads, d, dtype=torch.bfloat16, device="cuda")
                for _ in range(2))
        cu = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * ctx
        nbytes = 2 * k.numel() * 2
        ref = decode(q, k, v, cu)
        best = None
        for bn, w, st, splits in itertools.product((32, 64, 128), (4,), (2, 3, 4),
                                                   (0, 1, 4, 16, 48)):
            if batch >= 16 and splits > 4:
                continue
            cfg = DecodeConfig(bn, w, st)
            fn = lambda cfg=cfg, s=splits: decode(q, k, v, cu, num_splits=s, _config=cfg)  # noqa: E731
            try:
                if rel(fn(), ref) > 1e-2:
                    raise RuntimeError("wrong result")
                gbs = nbytes / bench(fn) / 1e6
            except Exception as e:  # noqa: BLE001
                results.append({"op": "decode", "B": batch, "ctx": ctx, "cfg": str(cfg),
                                "splits": splits, "error": str(e).splitlines()[0][:100]})
                continue
            results.append({"op": "decode", "B": batch, "ctx": ctx, "cfg": str(cfg),
                            "splits": splits, "GBps": gbs})
            if best is None or gbs > best[0]:
                best = (gbs, cfg, splits)
        auto = nbytes / bench(lambda: decode(q, k, v, cu)) / 1e6
        print(f"decode B={batch} ctx={ctx}: best {best}; default {auto:.0f} GB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tools/tuning/results")
    parser.add_argument("--only", choices=["prefill", "decode", "prefill-ws", "prefill-short",
                                           "prefill-varlen"])
    parser.add_argument("--lengths", default=None, help="prefill-short: comma list of N")
    parser.add_argument("--configs", default=None,
                        help="prefill-short/-varlen: comma list of BMxBNxWARPSxSTAGES")
    parser.add_argument("--head-dims", default="128,64", help="prefill-short: comma list")
    parser.add_argument("--rounds", type=int, default=1,
                        help="prefill-short/-varlen: runs per config")
    args = parser.parse_args()
    results: list[dict] = []
    if args.only in (None, "prefill"):
        tune_prefill(results)
    if args.only in (None, "decode"):
        tune_decode(results)
    if args.only == "prefill-ws":
        tune_prefill_ws(results)
    if args.only == "prefill-short":
        lengths = (tuple(int(x) for x in args.lengths.split(",")) if args.lengths
                   else SHORT_LENGTHS)
        grid = parse_configs(args.configs) if args.configs else SHORT_GRID
        tune_prefill_short(results, lengths, grid,
                           tuple(int(x) for x in args.head_dims.split(",")), args.rounds)
    if args.only == "prefill-varlen":
        tune_prefill_varlen(results, parse_configs(args.configs or "128x128x8x3,128x64x4x2,"
                                                   "64x64x4x2"), args.rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"tune_{torch.cuda.get_device_name().replace(' ', '_')}.json"
    (out / name).write_text(json.dumps(results, indent=1))
    print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
