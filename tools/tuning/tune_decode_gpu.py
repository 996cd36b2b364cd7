"""Sweep decode launch configs on GPU time (CUDA-graph replays); SDPA cuDNN in the same run as
the yardstick.

    python tools/tuning/tune_decode_gpu.py [--sweep configs|merge|large] [--out DIR]

``configs``: tile x split count at the small-batch shapes, where they decide the time.
``merge``: how the split partials are merged (``decode_kernel.MERGE_MODE``: fused into the last
split program, a merge kernel, the same as a programmatic dependent launch; and the fused
merge's tile) at the small-batch shapes, over split counts.
``large``: tile x split count at the large-batch shapes (one wave or more of programs).
``rule``: the default (``configs.decode_shape_config``'s tile) against the fixed ``DECODE_TILE``
at the same split count, over shapes on both sides of the rule's bounds.
``paged-rule`` (with ``--page``): paged decode over a shuffled page pool (bench_paged.py's)
with and without its short-split rule (``configs.paged_split_count`` and the short-split
tiles),
in turn ``--rounds`` times, against contiguous keys and cuDNN.
``ab`` (with ``--base-configs FILE``): the default calls under this tree's shape rules
(``decode_shape_config``, ``paged_split_count``) and under another ``configs.py``'s, in turn
(with ``--page``, contiguous keys' default call too: paged decode's yardstick).
``--cold`` (configs, large, rule, ab): each config's GPU time over rotating copies of the keys and
values (``bench_kernels.graph_cold_us``), so they come from HBM as in a model's decode, not
from L2 (a 1 x 4K cache is 16 MiB); cuDNN likewise.
``--page N``: the same sweeps through ``paged_decode`` over pages of N tokens (configs, rule,
ab: a shuffled pool laid out as the server's; the others: pages in order);
``--page-span N`` with it: ``decode_kernel.PAGE_SPAN`` (0: per-block page lookups).
``--blocks/--warps/--stages/--splits``: override the ``configs``/``large`` grids (comma lists).

32 q / 8 kv heads, D 128, bf16. Each config is checked against the default first.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_kernels import cold_set_count, for_graphs

from attention_kernels import decode, paged_decode
from attention_kernels import decode_kernel as dk
from attention_kernels.configs import DECODE_TILE, DecodeConfig

SHAPES = [(1, 4096), (1, 8192), (2, 4096), (4, 4096), (1, 32768)]
LARGE_SHAPES = [(64, 8192), (128, 2048), (16, 4096), (16, 32768), (1, 131072)]
HEADS, KV_HEADS, D = 32, 8, 128
PAGE = 0  # --page: the same keys as pages of this many tokens, through paged_decode
COLD = False  # --cold


def gpu_us(fn) -> float:
    """GPU us from CUDA-graph replays, our calls as a graph user makes them (``for_graphs``;
    forced merge modes ignore it)."""
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(for_graphs(fn), rep=60, return_mode="median") * 1e3


def inputs(batch: int, ctx: int):
    q = torch.randn(batch, HEADS, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(batch * ctx, KV_HEADS, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    cu = torch.arange(0, (batch + 1) * ctx, ctx, dtype=torch.int32, device="cuda")
    if PAGE:  # the same memory as pages; sequence b's pages in order
        table = torch.arange(batch * ctx // PAGE, dtype=torch.int32, device="cuda")
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        return (q, k.view(-1, PAGE, KV_HEADS, D), v.view(-1, PAGE, KV_HEADS, D),
                (table.view(batch, -1), lens))
    return q, k, v, cu


def run_decode(q, k, v, cu, **kw):
    """``decode``, or ``paged_decode`` where ``cu`` is ``(block_table, seqlens)``."""
    if isinstance(cu, tuple):
        return paged_decode(q, k, v, *cu, **kw)
    return decode(q, k, v, cu, **kw)


def cudnn_call(q, k, v, batch: int, ctx: int):
    """SDPA cuDNN on the same keys as ``decode(q, k, v, ...)`` reads (views, no copies)."""
    qd = q[:, :, None, :]
    kd = k.view(batch, ctx, KV_HEADS, D).transpose(1, 2)
    vd = v.view(batch, ctx, KV_HEADS, D).transpose(1, 2)

    def run():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)

    return run


def cudnn_us(q, k, v, batch: int, ctx: int) -> float:
    return gpu_us(cudnn_call(q, k, v, batch, ctx))


def measure(fn, ref: torch.Tensor, timer=gpu_us) -> float | str:
    """``timer()`` (default: GPU us of ``fn``) after checking ``fn`` against ``ref``; a string
    says why not."""
    try:
        err = 0.0
        for call in (fn, for_graphs(fn)):  # eager and graph calls may merge differently
            out = call()
            torch.cuda.synchronize()
            err = max(err, ((out.float() - ref.float()).norm() / ref.float().norm()).item())
        if not err < 1e-2:
            return f"wrong (rel err {err:.3g})"
        return timer(fn)
    except Exception as e:  # noqa: BLE001 (out of resources and the like: skip)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


def merge_settings() -> tuple[str, int, int, int]:
    return (dk.MERGE_MODE, dk.MERGE_TILE_ELEMS, dk.MERGE_KERNEL_TILE_ELEMS,
            dk.MERGE_KERNEL_WARPS)


def restore(defaults: tuple[str, int, int, int]) -> None:
    (dk.MERGE_MODE, dk.MERGE_TILE_ELEMS, dk.MERGE_KERNEL_TILE_ELEMS,
     dk.MERGE_KERNEL_WARPS) = defaults
    dk._PLANS.clear()


def set_merge(mode: str, tile: int, warps: int = 4) -> None:
    # The tile of whichever merge the mode runs (fused in the split kernel, or a kernel).
    dk.MERGE_MODE, dk.MERGE_TILE_ELEMS, dk.MERGE_KERNEL_TILE_ELEMS = mode, tile, tile
    dk.MERGE_KERNEL_WARPS = warps
    dk._PLANS.clear()  # the plans hold the launch of the previous mode


def cold_us(call, sets: list[tuple]) -> float:
    """GPU us per call of ``call(*inputs)`` cycling through ``sets`` (``input_sets``: one set
    is ``gpu_us``; more, with ``--cold``, a cold L2: see ``bench_kernels.graph_cold_us``)."""
    return gpu_us(lambda: [call(*s) for s in sets]) / len(sets)


def cudnn_packed(batch: int, ctx: int):
    """``call(q, k, v, cu)`` of SDPA cuDNN on packed keys (``input_sets``' second list)."""
    return lambda q, k, v, cu: cudnn_call(q, k, v, batch, ctx)()


def input_sets(batch: int, ctx: int, gen: torch.Generator) -> tuple[list[tuple], list[tuple]]:
    """(our calls' inputs, the same keys packed for the reference and cuDNN): one set, or with
    ``--cold`` sets covering ``bench_kernels.COLD_BYTES`` that share the queries and metadata,
    as a step's layers do. With ``--page``, the keys go into a shuffled pool laid out as the
    server's (``bench_paged.paged_copy``), the cold sets into pools of the same block table."""
    from bench_paged import paged_copy

    q = torch.randn(batch, HEADS, D, dtype=torch.bfloat16, device="cuda")
    cu = torch.arange(0, (batch + 1) * ctx, ctx, dtype=torch.int32, device="cuda")
    count = cold_set_count(2 * batch * ctx * KV_HEADS * D * 2) if COLD else 1
    ours, packed, meta = [], [], None
    for _ in range(count):
        k = torch.randn(batch * ctx, KV_HEADS, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        packed.append((q, k, v, cu))
        if PAGE:
            kp, vp, table, lens = paged_copy(k, v, [ctx] * batch, PAGE, gen, meta)
            meta = table, lens
            ours.append((q, kp, vp, meta))
        else:
            ours.append((q, k, v, cu))
    return ours, packed


def sweep_configs(shapes, blocks, warps, stages, splits) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for batch, ctx in shapes:
        sets, packed = input_sets(batch, ctx, gen)
        ref = decode(*packed[0])

        def timed(call):
            return measure(lambda: call(*sets[0]), ref, lambda _: cold_us(call, sets))

        peer = cold_us(cudnn_packed(batch, ctx), packed)
        default = timed(run_decode)
        best = (default, "default")
        for bn, w, st, sp in itertools.product(blocks, warps, stages, splits):
            if sp * bn > ctx:  # 0: the default split count
                continue
            cfg = DecodeConfig(bn, w, st)
            us = timed(lambda q, k, v, cu, cfg=cfg, sp=sp: run_decode(
                q, k, v, cu, num_splits=sp, _config=cfg))
            if isinstance(us, str):
                print(f"  {cfg} splits {sp}: {us}")
                continue
            rows.append({"B": batch, "ctx": ctx, "block_n": bn, "warps": w, "stages": st,
                         "splits": sp, "gpu_us": us})
            print(f"  {bn}/{w}/{st} x{sp}: {us:.1f} us ({peer / us:.2f}x)", flush=True)
            if us < best[0]:
                best = (us, f"block_n {bn} warps {w} stages {st} splits {sp}")
        print(f"B={batch} ctx={ctx}: cuDNN {peer:.1f} us | ours default {default:.1f} us "
              f"({peer / default:.2f}x) | best {best[0]:.1f} us ({peer / best[0]:.2f}x): "
              f"{best[1]}", flush=True)
        rows.append({"B": batch, "ctx": ctx, "cudnn_us": peer, "default_us": default,
                     "best_us": best[0], "best": best[1]})
    return rows


def sweep_merge() -> list[dict]:
    rows = []
    defaults = merge_settings()
    # "default": the module's own settings (for CUDA graphs on Hopper, the PDL merge kernel).
    # (mode, tile, merge-kernel warps). A merge program per query head rather than per kv
    # group (tiles of 2048-8192, 1-4 warps) lost at 1 x 4K: 7.7-8.7 us against 7.6 (H100,
    # 2026-11-24; git history: benchmarks/results/issue13/h100_2026-11-24d/merge.log).
    variants = [("default", 0, 0), ("fused", 8192, 4), ("fused", 16384, 4),
                ("separate", 16384, 4), ("pdl", 8192, 4), ("pdl", 16384, 1),
                ("pdl", 16384, 2), ("pdl", 16384, 4), ("pdl", 16384, 8)]
    for batch, ctx in SHAPES:
        q, k, v, cu = inputs(batch, ctx)
        ref = run_decode(q, k, v, cu)
        peer = cudnn_us(q, k, v, batch, ctx)
        line = [f"B={batch} ctx={ctx}: cuDNN {peer:.1f} us"]
        for mode, tile, warps in variants:
            if mode == "default":
                restore(defaults)
            else:
                set_merge(mode, tile, warps)
            best = (float("inf"), 0)
            for sp in (0, 8, 12, 16, 24, 32, 48, 64):
                us = measure(lambda sp=sp: run_decode(q, k, v, cu, num_splits=sp), ref)
                if isinstance(us, str):
                    print(f"  {mode} tile {tile} w{warps} splits {sp}: {us}")
                    continue
                rows.append({"B": batch, "ctx": ctx, "mode": mode, "tile": tile, "warps": warps,
                             "splits": sp, "gpu_us": us, "cudnn_us": peer})
                if sp == 0:
                    line.append(f"{mode}/{tile}/w{warps} default {us:.1f} ({peer / us:.2f}x)")
                if us < best[0]:
                    best = (us, sp)
            line.append(f"best {best[0]:.1f} @ {best[1]} splits ({peer / best[0]:.2f}x)")
        restore(defaults)
        print(" | ".join(line), flush=True)
    return rows


RULE_SHAPES = [(1, 4096), (1, 8192), (2, 4096), (4, 4096), (1, 16384), (8, 4096), (48, 8192),
               (64, 8192), (96, 4096), (128, 2048)]


def sweep_rule(rounds: int = 1) -> list[dict]:
    """The shape rule's tile against ``DECODE_TILE`` at the same split count, in turn
    ``rounds`` times (medians); with ``--cold`` over rotating keys and values."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for batch, ctx in RULE_SHAPES:
        sets, packed = input_sets(batch, ctx, gen)
        ref = decode(*packed[0])
        dk._PLANS.clear()
        run_decode(*sets[0])
        plan = next(iter(dk._PLANS._plans.values()))  # the default call's (only) plan
        splits = plan.merge_scalars[-1] if plan.merge_scalars else 1
        tile = plan.launch.kwargs["BLOCK_N"], plan.launch.kwargs["num_stages"]
        sides = {"rule": run_decode,
                 "fixed": lambda q, k, v, cu, s=splits: run_decode(
                     q, k, v, cu, num_splits=s, _config=DECODE_TILE)}
        runs: dict[str, list[float]] = {name: [] for name in (*sides, "cudnn")}
        for _ in range(rounds):
            for name, call in sides.items():
                us = measure(lambda call=call: call(*sets[0]), ref,
                             lambda _, call=call: cold_us(call, sets))
                if isinstance(us, str):
                    raise SystemExit(f"B={batch} ctx={ctx} {name}: {us}")
                runs[name].append(us)
            runs["cudnn"].append(cold_us(cudnn_packed(batch, ctx), packed))
        dk._PLANS.clear()
        med = {name: statistics.median(r) for name, r in runs.items()}
        peer, rule, fixed = med["cudnn"], med["rule"], med["fixed"]
        print(f"B={batch} ctx={ctx} splits {splits}: cuDNN {peer:.1f} us | rule {tile} "
              f"{rule:.1f} us ({peer / rule:.2f}x) | fixed {fixed:.1f} us ({peer / fixed:.2f}x)",
              flush=True)
        rows.append({"B": batch, "ctx": ctx, "splits": splits, "rule_tile": tile,
                     "rule_us": rule, "fixed_us": fixed, "cudnn_us": peer, "runs": runs})
    return rows


PAGED_RULE_SHAPES = [(1, 4096), (2, 4096), (1, 8192), (4, 4096), (1, 16384), (1, 32768),
                     (8, 8192), (16, 4096), (64, 8192)]


def sweep_paged_rule(rounds: int) -> list[dict]:
    """Paged decode with its short-split rule (as served) and without (the automatic split
    count and tile of contiguous keys), medians of ``rounds`` turns."""
    from bench_paged import paged_copy

    from attention_kernels import configs

    plain_shape_config = dk.decode_shape_config

    def without_rule(cfg, programs, num_splits, split_len, sms, block_d, paged=False,
                     **kwargs):
        if paged and num_splits > 1:  # the short-split tiles are the rule's
            return cfg
        return plain_shape_config(cfg, programs, num_splits, split_len, sms, block_d, paged,
                                  **kwargs)

    rows = []
    gen = torch.Generator().manual_seed(0)
    for batch, ctx in PAGED_RULE_SHAPES:
        q = torch.randn(batch, HEADS, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(batch * ctx, KV_HEADS, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        cu = torch.arange(0, (batch + 1) * ctx, ctx, dtype=torch.int32, device="cuda")
        kp, vp, table, lens = paged_copy(k, v, [ctx] * batch, PAGE, gen)
        ref = decode(q, k, v, cu, max_seqlen_k=ctx)

        def paged(kp=kp, vp=vp, table=table, lens=lens, ctx=ctx, q=q):
            return paged_decode(q, kp, vp, table, lens, max_seqlen_k=ctx)

        def plan_of(fn) -> tuple[int, int, int]:
            dk._PLANS.clear()
            fn()
            plan = next(iter(dk._PLANS._plans.values()))
            kw = plan.launch.kwargs
            return plan.launch.grid[0], kw["BLOCK_N"], kw["num_stages"]

        sides = {"contiguous": lambda q=q, k=k, v=v, cu=cu, ctx=ctx: decode(
                     q, k, v, cu, max_seqlen_k=ctx),
                 "rule": paged, "no_rule": paged}
        runs: dict[str, list[float]] = {name: [] for name in (*sides, "cudnn")}
        launches = {}
        for _ in range(rounds):
            for name, fn in sides.items():
                off = name == "no_rule"
                dk.paged_split_count = (lambda n, *a: n) if off else configs.paged_split_count
                dk.decode_shape_config = without_rule if off else plain_shape_config
                launches[name] = plan_of(fn)
                us = measure(fn, ref)
                if isinstance(us, str):
                    raise SystemExit(f"B={batch} ctx={ctx} {name}: {us}")
                runs[name].append(us)
            runs["cudnn"].append(cudnn_us(q, k, v, batch, ctx))
        dk.paged_split_count = configs.paged_split_count
        dk.decode_shape_config = plain_shape_config
        dk._PLANS.clear()
        med = {name: statistics.median(r) for name, r in runs.items()}
        row = {"B": batch, "ctx": ctx, "D": D, "page": PAGE, "launches": launches,
               "runs": runs, **{f"{n}_us": m for n, m in med.items()}}
        rows.append(row)
        print(f"B={batch} ctx={ctx} D{D} page {PAGE}: rule {launches['rule']} "
              f"{med['rule']:.1f} us | no rule {launches['no_rule']} {med['no_rule']:.1f} | "
              f"contiguous {med['contiguous']:.1f} | cuDNN {med['cudnn']:.1f} | paged/contiguous "
              f"{med['contiguous'] / med['rule']:.2f} (no rule "
              f"{med['contiguous'] / med['no_rule']:.2f})", flush=True)
    return rows


def _base_rules(path: Path):
    """``(decode_shape_config, paged_split_count)`` of another ``configs.py`` (an A/B base),
    speaking this tree's ``DecodeConfig``."""
    import importlib.util

    from attention_kernels.configs import DecodeConfig as Config

    spec = importlib.util.spec_from_file_location("base_configs", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)

    # A base from before a parameter (page_tokens; units, SMs, GB/s) is called without it.
    known = inspect.signature(mod.decode_shape_config).parameters
    split_params = len(inspect.signature(mod.paged_split_count).parameters)

    def shape_config(cfg, *args, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k in known}
        got = mod.decode_shape_config(mod.DecodeConfig(cfg.block_n, cfg.num_warps,
                                                       cfg.num_stages), *args, **kwargs)
        return Config(got.block_n, got.num_warps, got.num_stages)

    def split_count(num_splits, est_seqlen, block_n, *rest):
        return mod.paged_split_count(num_splits, est_seqlen, block_n, *rest[:split_params - 3])

    return shape_config, split_count


def sweep_ab(base: Path, rounds: int) -> list[dict]:
    """The default call (split count and tile as chosen) under this tree's shape rules and
    under ``base``'s (another ``configs.py``), in turn ``rounds`` times, cuDNN beside; medians.
    Contiguous keys, or pages with ``--page``; ``--cold`` over rotating keys and values."""
    sides = {"new": (dk.decode_shape_config, dk.paged_split_count), "base": _base_rules(base)}
    rows = []
    gen = torch.Generator().manual_seed(0)
    for batch, ctx in AB_SHAPES:
        sets, packed = input_sets(batch, ctx, gen)
        ref = decode(*packed[0])
        runs: dict[str, list[float]] = {"new": [], "base": [], "cudnn": []}
        if PAGE:  # the same keys packed, through contiguous decode: paged's yardstick
            runs["contiguous"] = []
        launches = {}
        for _ in range(rounds):
            for name, (shape_config, split_count) in sides.items():
                dk.decode_shape_config, dk.paged_split_count = shape_config, split_count
                dk._PLANS.clear()
                run_decode(*sets[0])
                plan = next(iter(dk._PLANS._plans.values()))
                kw = plan.launch.kwargs
                launches[name] = (plan.launch.grid[0], kw["BLOCK_N"], kw["num_warps"],
                                  kw["num_stages"])
                us = measure(lambda: run_decode(*sets[0]), ref,
                             lambda _: cold_us(run_decode, sets))
                if isinstance(us, str):
                    raise SystemExit(f"B={batch} ctx={ctx} {name}: {us}")
                runs[name].append(us)
            runs["cudnn"].append(cold_us(cudnn_packed(batch, ctx), packed))
            if PAGE:
                runs["contiguous"].append(cold_us(
                    lambda q, k, v, cu: decode(q, k, v, cu, max_seqlen_k=ctx), packed))
        dk.decode_shape_config, dk.paged_split_count = sides["new"]
        dk._PLANS.clear()
        med = {name: statistics.median(r) for name, r in runs.items()}
        rows.append({"B": batch, "ctx": ctx, "launches": launches, "runs": runs,
                     **{f"{n}_us": m for n, m in med.items()}})
        print(f"B={batch} ctx={ctx} page {PAGE}: new {launches['new']} {med['new']:.2f} us | "
              f"base {launches['base']} {med['base']:.2f} | cuDNN {med['cudnn']:.2f} | "
              f"new/base {med['base'] / med['new']:.3f}x (> 1: new faster)"
              + (f" | contiguous {med['contiguous']:.2f}: new {med['contiguous'] / med['new']:.3f}x"
                 f", base {med['contiguous'] / med['base']:.3f}x" if PAGE else ""), flush=True)
    return rows


AB_SHAPES = [(1, 4096), (1, 8192), (2, 4096), (4, 2048), (8, 1024), (2, 8192), (1, 16384),
             (4, 4096), (64, 8192)]


def main() -> None:
    global PAGE, D, COLD
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", choices=("configs", "merge", "large", "rule", "paged-rule",
                                        "ab"), default="configs")
    ap.add_argument("--base-configs", type=Path,
                    help="ab: another configs.py, whose shape rules are the base side")
    ap.add_argument("--cold", action="store_true",
                    help="configs/large/rule/ab: GPU time with a cold L2 (rotating K/V copies)")
    ap.add_argument("--rounds", type=int, default=3, help="rule, paged-rule, ab: turns per shape")
    ap.add_argument("--shapes", default=None,
                    help="override the sweep's shapes: comma list of BATCHxCTX, e.g. 128x2048")
    ap.add_argument("--page", type=int, default=0,
                    help="run paged_decode over pages of this many tokens (same keys)")
    ap.add_argument("--page-span", type=int, default=dk.PAGE_SPAN)
    ap.add_argument("--head-dim", type=int, default=D, help="head dim (default 128)")
    for name in ("blocks", "warps", "stages", "splits"):
        ap.add_argument(f"--{name}", default=None, help="comma list: the grid's " + name)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    PAGE, D, COLD = args.page, args.head_dim, args.cold
    dk.PAGE_SPAN = args.page_span

    def grid(name: str, default: tuple[int, ...]) -> tuple[int, ...]:
        given = getattr(args, name)
        return tuple(int(x) for x in given.split(",")) if given else default
    if args.shapes:
        shapes = [tuple(int(x) for x in item.split("x")) for item in args.shapes.split(",")]
        SHAPES[:], LARGE_SHAPES[:], RULE_SHAPES[:] = shapes, shapes, shapes
        PAGED_RULE_SHAPES[:] = shapes
        AB_SHAPES[:] = shapes
    defaults = merge_settings()
    if args.sweep == "configs":
        rows = sweep_configs(SHAPES, grid("blocks", (64, 128)), grid("warps", (4, 8)),
                             grid("stages", (3, 4, 5)), grid("splits", (8, 16, 24, 32)))
    elif args.sweep == "rule":
        dk._PLANS.clear()
        rows = sweep_rule(args.rounds)
    elif args.sweep == "paged-rule":
        if not PAGE:
            raise SystemExit("--sweep paged-rule needs --page")
        rows = sweep_paged_rule(args.rounds)
    elif args.sweep == "ab":
        if not args.base_configs:
            raise SystemExit("--sweep ab needs --base-configs")
        rows = sweep_ab(args.base_configs, args.rounds)
    elif args.sweep == "merge":
        rows = sweep_merge()
    else:
        rows = sweep_configs(LARGE_SHAPES, grid("blocks", (32, 64)), grid("warps", (2, 4, 8)),
                             grid("stages", (2, 3)), grid("splits", (1, 2)))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = args.sweep + ("_cold" if COLD else "")
        (args.out / f"tune_decode_gpu_{name}.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "sweep": args.sweep, "cold": COLD,
             "page": PAGE, "head_dim": D,
             "page_span": args.page_span,
             "defaults": {"merge_mode": defaults[0], "merge_tile": defaults[1],
                          "merge_kernel_tile": defaults[2], "merge_kernel_warps": defaults[3]},
             "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
