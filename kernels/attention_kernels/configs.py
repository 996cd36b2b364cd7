"""Launch configurations, table-driven per (head dim, dtype, causal, GPU).

Why a table and not ``triton.autotune``: autotuning would time whatever shape reaches the server
first (often a tiny request) and cache that choice for every later shape. The table below was
filled from ``tools/tuning/tune_kernels.py`` sweeps on an H100 (benchmarks/results/tuning/); a GPU
we have not measured falls back to the Hopper rows, which are conservative in shared memory.
Compilation is per (config, dtype, head dim); ``attention_kernels.warmup`` pays it ahead of
traffic and Triton's on-disk cache keeps it across restarts.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # Triton's automatic warp specialization of the unmasked key loop (``tl.range``'s
    # ``warp_specialize``). Off: on an H100 (triton 3.6, ``tune_kernels.py --only prefill-ws``,
    # 2026-11-23) 4 warps crash its Hopper pass (a TaskIdPropagation assertion) and the best
    # 8-warp tiles gave 0.97-1.04x of the table's tiles (D 128 non-causal 512 vs 496 TFLOP/s,
    # cuDNN 690), not the gap to cuDNN.
    warp_specialize: bool = False


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int
    num_warps: int
    num_stages: int


# Read once: Triton decides interpreter or compiler when a kernel is decorated (import time),
# and reading os.environ on every launch cost ~2 us of a decode call's host path.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on the CPU through numpy)."""
    return _INTERPRETING


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Triton 3.6's interpreter computes bf16 ``tl.dot`` on the raw bits (garbage); there, upcast
    the operands (after the same bf16 rounding) so CI checks the real algorithm. Compiled
    kernels always use the tensor cores on the input dtype."""
    return interpreting() and dtype == torch.bfloat16


def padded_head_dim(head_dim: int) -> int:
    """The kernels work on a power-of-two head dim (masked), at least 16 for tl.dot."""
    return max(16, 1 << (head_dim - 1).bit_length())


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def dram_gbps(device_index: int) -> float:
    """The GPU's DRAM bandwidth in GB/s from its memory clock and bus width (the driver's
    figures, as ``triton.testing.get_dram_gbps``): H100 SXM 3352, H200 about 4.8K; 0.0 where
    the driver cannot say."""
    try:
        import triton.testing

        return float(triton.testing.get_dram_gbps(device_index))
    except Exception:  # noqa: BLE001 (no CUDA driver, an older Triton: no bandwidth rules)
        return 0.0


# (padded head dim, causal) -> config, for Hopper (sm_90) with 16-bit inputs. Measured with
# tools/tuning/tune_kernels.py on an H100 (bf16, N = 8K, 2048 / D heads;
# benchmarks/results/tuning/tune_kernels_*.json):
# D128: 128x128, 8 warps, 3 stages gave 459 / 447 TFLOP/s (full / causal); the next best was
# 128x64 at 403 / 387; 4 stages of 128x128 does not fit in 227 KB of shared memory.
# D64: 128x128 x4 warps 393 full; causal prefers 128x64 x8 warps x4 stages (391).
_PREFILL_SM90: dict[tuple[int, bool], PrefillConfig] = {
    (16, False): PrefillConfig(128, 128, 4, 3),
    (32, False): PrefillConfig(128, 128, 4, 3),
    (64, False): PrefillConfig(128, 128, 4, 3),
    (128, False): PrefillConfig(128, 128, 8, 3),
    (256, False): PrefillConfig(128, 64, 8, 2),
    (16, True): PrefillConfig(128, 64, 8, 4),
    (32, True): PrefillConfig(128, 64, 8, 4),
    (64, True): PrefillConfig(128, 64, 8, 4),
    (128, True): PrefillConfig(128, 128, 8, 3),
    (256, True): PrefillConfig(128, 64, 8, 2),
}


# FP8 K/V (fp16 dots, ``_fp8_dot``), D 128: tools/tuning/tune_fp8.py, H200, 2026-11-23, dense
# 16K tokens x 16 heads, TFLOP/s full 4K / 8K, causal 4K / 8K: 128x128x8w x3 (the bf16 row)
# 344 / 344 / 328 / 350; 128x64 x4 warps x3 stages 362 / 369 / 332 / 351, the best of 8
# configs at every shape. Descriptor (TMA) loads of FP8 tiles lost 2-11% with every config.
_PREFILL_FP8_SM90: dict[tuple[int, bool], PrefillConfig] = {
    (128, False): PrefillConfig(128, 64, 4, 3),
    (128, True): PrefillConfig(128, 64, 4, 3),
}


# Launches of many programs: at least this many per SM, (query-block slots of 128 rows) x
# heads. Only there do the tiles of ``_PREFILL_MANY_SM90`` pay: a launch of a few waves is as
# long as its longest programs, which 8 warps of 128x128 finish sooner. H100, 2026-11-24
# (git history: ``benchmarks/results/issue13/h100_2026-11-24c/ab_varlen.log``), GPU time of the
# table's
# D128 tile -> 128x64 x4 warps x2 stages, 16 heads: [1024] * 3 (448 programs) 71 -> 96 us
# non-causal, [64, 78, 2048] causal (336) 53 -> 83; [4096] * 2 (1072) 589 -> 569 non-causal,
# 324 -> 320 causal; [8192, 16 x 4] (1120) 1143 -> 1088 non-causal.
MANY_PROGRAMS_PER_SM = 8
# (padded head dim, causal) -> [(bound, config)], 16-bit, Hopper, many programs: the first
# entry whose bound (None: any) is at least every sequence's query count (``max_rows``).
# H100, 2026-11-24, ``tune_kernels.py --only prefill-short --lengths 512,...,16384 --rounds
# 2`` (16K tokens, 2048 / D heads, bf16: 1056+ programs), TFLOP/s table tile -> this one:
# * D128, 128x64 x4 warps x2 stages (descriptor loads of K/V, heads-outer order):
#   non-causal N 512 / 1K / 2K / 4K / 8K / 16K 297 -> 314, 380 -> 405, 447 -> 470,
#   489 -> 489, 510 -> 526, 510 -> 536; causal 366 -> 376 (2K), 433 -> 451, 461 -> 495,
#   475 -> 509 (cuDNN 316-663).
# * D128 causal N <= 1K, 64x64 x4 x2 (less of each diagonal block wasted): 182 -> 210,
#   280 -> 290 (2K: 366 -> 361).
# * D64 N <= 4K, 64x64 x4 x3: causal 182 -> 216, 265 -> 297, 335 -> 348, 373 -> 375;
#   non-causal 288 -> 323, 341 -> 387, 369 -> 397, 390 -> 403 (8K: 384 -> 387, 410 -> 402).
_PREFILL_MANY_SM90: dict[tuple[int, bool], list[tuple[int | None, PrefillConfig]]] = {
    (128, False): [(None, PrefillConfig(128, 64, 4, 2))],
    (128, True): [(1024, PrefillConfig(64, 64, 4, 2)), (None, PrefillConfig(128, 64, 4, 2))],
    (64, False): [(4096, PrefillConfig(64, 64, 4, 3))],
    (64, True): [(4096, PrefillConfig(64, 64, 4, 3))],
}
# The same for launches of fewer programs: D128 causal N <= 512, 64x64 x4 x2. Same A/B, GPU
# time: [64, 128, 256] 10.6 -> 8.6 us, [128, 256, 512] 15.2 -> 14.5 ([1024] * 3: 54 -> 60,
# so not there).
_PREFILL_FEW_SM90: dict[tuple[int, bool], list[tuple[int | None, PrefillConfig]]] = {
    (128, True): [(512, PrefillConfig(64, 64, 4, 2))],
}
# The largest finite bound above: callers bucket their ``max_seqlen_q`` hint up to it.
SHORT_PREFILL_MAX = max(bound for rules in (*_PREFILL_MANY_SM90.values(),
                                            *_PREFILL_FEW_SM90.values())
                        for bound, _ in rules if bound is not None)


def short_rows_bucket(max_seqlen_q: int | None) -> int | None:
    """The hint ``prefill_config`` needs from a call's ``max_seqlen_q``: the next power of two
    (the bounds are powers of two), or None where no bounded rule can apply."""
    if max_seqlen_q is None or max_seqlen_q > SHORT_PREFILL_MAX:
        return None
    return 1 << max(0, max_seqlen_q - 1).bit_length()


def many_programs(total_q: int, batch: int, heads: int, device: torch.device) -> bool:
    """Whether a prefill launch of ``total_q`` queries in ``batch`` sequences and ``heads``
    heads has at least ``MANY_PROGRAMS_PER_SM`` programs per SM (``prefill_config``'s
    ``many``), counted as the kernel's grid at 128-row query blocks."""
    if device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    slots = total_q // 128 + batch + 1  # prefill_kernel's slot count
    return slots * heads >= MANY_PROGRAMS_PER_SM * num_sms(index)


@functools.lru_cache(maxsize=512)  # per launch on the host path: ~10 us uncached
def prefill_config(
    head_dim: int, dtype: torch.dtype, causal: bool, device: torch.device,
    kv_fp8: bool = False, max_rows: int | None = None, many: bool = False,
) -> PrefillConfig:
    """``kv_fp8``: the keys and values are float8_e4m3fn (``dtype`` is the queries').
    ``max_rows``: no sequence has more queries than this (``short_rows_bucket`` of the
    caller's hint; None: unknown). ``many``: the launch has many programs
    (``many_programs``). Both pick measured tiles of 16-bit launches on Hopper."""
    if interpreting() or device.type != "cuda":
        # The interpreter runs every program in numpy: small tiles keep CI fast, and
        # BLOCK_M != BLOCK_N exercises the generalised causal bounds.
        return PrefillConfig(32, 16, 4, 1)
    d = padded_head_dim(head_dim)
    cfg = _PREFILL_SM90[(d, causal)]
    major, _ = _capability(device.index if device.index is not None
                           else torch.cuda.current_device())
    if not kv_fp8 and dtype != torch.float32 and major == 9:
        rules = (_PREFILL_MANY_SM90 if many else _PREFILL_FEW_SM90).get((d, causal), [])
        for bound, rule_cfg in rules:
            if bound is None or (max_rows is not None and max_rows <= bound):
                cfg = rule_cfg
                break
    if kv_fp8:
        cfg = _PREFILL_FP8_SM90.get((d, causal), cfg)
    if dtype == torch.float32:
        # fp32 tiles are twice the bytes: halve the key block to stay within shared memory.
        cfg = dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2), num_stages=2)
    if major < 9:
        # Pre-Hopper parts have less shared memory per SM: fewer stages.
        cfg = dataclasses.replace(cfg, block_n=min(cfg.block_n, 64), num_stages=2)
    if head_dim % 2 and d == 128 and dtype != torch.float32 and not kv_fp8 and major == 9:
        # Odd head dims are read an element at a time (a row's mask changes every column): the
        # tiles above held those loads in registers and spilled 0.2-1 KB (sm_90a). H200, bf16,
        # causal 4 x 4096, 16q/8kv, D 111 (many programs: 128x64 x4 warps x2): 2739 us ->
        # 1269 in 128x64 x8 x3 (128x32 x8 x2: 1524, 64x64 x4 x2: 1635; D 112: 724), 2026-12-02.
        cfg = ODD_HEAD_PREFILL_TILE
    return _fit_shared_memory(cfg, d, dtype.itemsize)


# Hopper's per-block shared memory limit. Triton keeps the Q tile plus num_stages K and V tiles
# there: bf16 128x128x3 at D 128 takes 224 KB (fits); fp32 128x32x2 at D 256 took 256 KB and
# failed to launch on an H100, hence this check.
_SHARED_BUDGET = 227 * 1024


def _fit_shared_memory(cfg: PrefillConfig, d: int, itemsize: int) -> PrefillConfig:
    """Shrink the query block, then the key block, until the tiles fit in shared memory."""
    bm, bn = cfg.block_m, cfg.block_n
    while (bm + 2 * cfg.num_stages * bn) * d * itemsize > _SHARED_BUDGET and max(bm, bn) > 16:
        if bm > 64:
            bm //= 2
        else:
            bn = max(16, bn // 2)
    return dataclasses.replace(cfg, block_m=bm, block_n=bn,
                               num_warps=cfg.num_warps if bm >= 128 else 4)


@functools.lru_cache(maxsize=512)
def decode_config(head_dim: int, dtype: torch.dtype, device: torch.device,
                  kv_fp8: bool = False, skewed: bool = False) -> DecodeConfig:
    """``kv_fp8``: FP8 K/V (contiguous decode). 128-key blocks: a block of one-byte keys is
    half the bytes, and 64 of them too little work per load. tools/tuning/tune_fp8.py, H200,
    2026-11-23, 32q/8kv x 128, GPU time 64 -> 128 keys (4 warps, 3 stages): 1x32K 40.3 ->
    36.6 us, 16x32K 473 -> 363, 64x8K 333 -> 314, 128x2K 160 -> 163, 1x4K 12.6 -> 12.7;
    within 5% of the best of 12 configs at each of 7 shapes.

    16-bit K/V at (padded) head dim 64 and below: ``SMALL_HEAD_TILE``, 128-key blocks (a
    64-key block of 64-wide rows moves too few bytes per load). ``tune_decode_gpu.py --sweep
    configs --head-dim 64`` (H100, 2026-11-24, 32q/8kv bf16, GPU time, the split count left to
    ``choose_num_splits``), 64 -> 128 keys (4 warps, 3 stages), cuDNN in brackets: 1x4K 6.8 ->
    6.2 us (7.5), 2x8K 14.8 -> 11.3 (10.7), 4x8K 30.6 -> 27.7 (28.1), 8x8K 55.8 -> 49.4
    (49.4), 16x8K 102.3 -> 89.5 (91.4), 4x32K 104.2 -> 90.9 (92.9); the best of 20 configs
    (64/128 keys, 2/3 stages, 1-16 splits) at every shape but 2x8K (16 splits: 10.8)."""
    if interpreting() or device.type != "cuda":
        return DecodeConfig(16, 4, 1)
    d = padded_head_dim(head_dim)
    if head_dim % 2 and d >= 128 and dtype != torch.float32 and not skewed:
        # Odd head dims are read an element at a time (a row's mask changes every column), and
        # the loads of a 64-key block of such rows spilled (sm_90a: 280 bytes at D 111, 336 at
        # D 201 with 32 keys). H200, bf16, 64 x 4096, 32q/8kv, D 111: 9609 us -> 695 with 32
        # keys (16: 988; D 112: 225), 2026-12-02. Read in whole 16-byte pieces (``skewed``:
        # ``_launch.kv_shift``) they take the others' tiles: D 111 366 us in 32-key blocks,
        # 257 in 64 (D 112: 158); D 201 715 in 16-key blocks, 486 in 32 (D 208: 507), 2026-12-02.
        return ODD_HEAD_TILES[d]
    if kv_fp8 and d == 128 and dtype != torch.float32:
        return DecodeConfig(128, 4, 3)
    if d >= 256 or dtype == torch.float32:
        return DecodeConfig(32, 4, 3)
    if d <= 64 and not kv_fp8:
        return SMALL_HEAD_TILE
    return DECODE_TILE


# The contiguous bf16/fp16 decode tile below D 256; decode_shape_config may trade it for another.
DECODE_TILE = DecodeConfig(64, 4, 3)
# 16-bit decode at head dim 64 and below (decode_config).
SMALL_HEAD_TILE = DecodeConfig(128, 4, 3)
# Odd head dims: decode by padded head dim (decode_config); prefill at padded 128.
ODD_HEAD_PREFILL_TILE = PrefillConfig(128, 64, 8, 3)
ODD_HEAD_TILES = {128: DecodeConfig(32, 4, 3), 256: DecodeConfig(16, 4, 3)}
# decode_shape_config's other tiles (the warm-up compiles them).
ONE_SPLIT_TILE = DecodeConfig(32, 4, 2)
MANY_PROGRAMS_TILE = DecodeConfig(64, 4, 2)
SHORT_PAGED_SPLIT_TILE = DecodeConfig(32, 2, 3)
TWO_WARP_TILE = DecodeConfig(64, 2, 2)
# GPUs whose DRAM feeds each SM at least this many GB/s (an H200: ~36.5; an H100 SXM: ~25.4)
# take the rules measured to pay only there (decode_shape_config, paged_split_count).
FAST_DRAM_SM_GBPS = 30.0


def decode_shape_config(cfg: DecodeConfig, programs: int, num_splits: int, split_len: int,
                        sms: int, block_d: int, paged: bool = False,
                        page_tokens: int = 0, gbps: float = 0.0) -> DecodeConfig:
    """The tile for one call's shape, when ``cfg`` is ``DECODE_TILE`` and the (padded) head dim
    is 128 with 16-bit keys on a Hopper GPU of ``sms`` SMs: where it was measured (the
    caller checks the GPU and the key dtype). ``programs``: (sequence, kv head) pairs;
    ``split_len``: keys per split program; ``gbps``: the GPU's DRAM GB/s (``dram_gbps``).

    GPU time (CUDA-graph replay), H100, 32q/8kv x 128 bf16, 2026-11-23, two host instances
    (tune_decode_gpu.py ``--sweep large/configs``, then ``--sweep rule``):

    * One split, more programs than fit 3 per SM (``DECODE_TILE`` takes 72 KB of shared
      memory: 3 per SM) but no more than 4 per SM: 32-key tiles in 2 stages run them all in one
      wave instead of two with a ragged end. 64 x 8K (512 programs): 739 / 737 -> 684 / 689 us
      (cuDNN 692 / 693). At 48 x 8K (384 programs, one wave either way) 536 vs 531 us; at
      16 x 32K (128 programs, one per SM) 32-key tiles starve each SM: 680 -> 816 us.
      On GPUs of ``FAST_DRAM_SM_GBPS`` (``gbps`` over ``sms``) 64 keys in 2 warps
      (``TWO_WARP_TILE``) instead: H200, 2026-11-27, ``--sweep configs`` (12 tiles), 32 x 4 x 2
      -> 64 x 2 x 2: 64 x 8K 507.1 -> 480.1 us, 56 x 8K 467.2 -> 423.3 (cuDNN 481.5, 433.1);
      on the H100 the same sweep had 64 x 2 x 2 1.5% slower (684.4 -> 694.5, 609.6 -> 618.9).
      Pages of 32 tokens or more take it on either GPU (``--sweep ab --page 64``, medians of 3
      turns, 2026-11-27, 32 x 4 x 2 -> 64 x 2 x 2): H200 64 x 8K 511.5 -> 481.8 us, 56 x 8K
      473.6 -> 424.7, 52 x 8K 460.3 -> 398.6 (contiguous keys under the old tile 505.9,
      468.3, 455.2; cuDNN 482.8, 434.2, 401.7); H100 702.7 -> 702.0, 625.9 -> 622.7, 589.5 ->
      581.4.
    * (Splits of 512 up to 1024 keys used to take 128-key tiles, measured on one replayed call
      whose keys sat in L2: 1 x 8K 12.3 -> 11.5 us. With the keys cold, as layer after layer
      of a model reads them, the 64-key tile is the faster. H100, 2026-11-24m, ``--sweep ab
      --cold`` (medians of 3 interleaved rounds), 128 -> 64 keys: 1 x 8K 16.13 -> 15.68 us,
      2 x 4K 16.22 -> 15.81, 4 x 2K 16.40 -> 15.88, 8 x 1K 16.62 -> 15.92.)

    * One split, more programs than fit 4 per SM: 64-key tiles in 2 stages (48 KB: 4 per SM,
      so fewer and fuller waves than 3 per SM). 128 x 2K (1024 programs): 374.8 -> 352.4 us
      (cuDNN 354.2), H100, 2026-11-24 (``--sweep large``; 16-key tiles of 2 warps 350.7, but
      those starve the SMs at fewer programs).
      Pages take 2 warps there (``TWO_WARP_TILE``): 128 x 2K, 64-token pages,
      ``--sweep ab --page 64`` (medians of 3 turns, 2026-11-27), 64 keys x 4 warps x 3 stages
      -> 64 x 2 x 2: H200 263.2 -> 239.1 us (contiguous keys 247.6, cuDNN 242.0; 16-token
      pages 263.6 -> 243.8), H100 354.7 -> 354.1 (352.1). ``--sweep configs --page 64`` on
      the H200: 64 x 4 x 2 253.9, 32 x 2 x 3 245.5, 64 x 2 x 2 244.6 us.

    ``paged`` (``paged_decode``, bf16 pages of ``page_tokens``): the first rule in
    ``TWO_WARP_TILE``, and in 64-key blocks of 4 warps where pages are smaller than 32 tokens
    (each block gathers two or more pages): 64 x 8K, 16-token pages, ``--sweep configs --page
    16``: H200 (2026-11-27) 32 x 4 x 2 538 us, 64 x 4 x 2 483.5, 64 x 2 x 2 486.9 (``--sweep
    ab``: 64 x 2 x 2 0.98-0.99x of 64 x 4 x 2 at 52-64 x 8K; contiguous keys 491, cuDNN 482),
    H100 706 -> 705 (2026-11-23, ``--sweep large``, 32 -> 64 keys); splits of at most two 64-key
    blocks in 2 stages rather than 3 (a 2-trip loop fills no deeper pipeline); splits of three
    or four (``paged_split_count`` makes them) in 32-key blocks of 2 warps: twice the loop
    trips, each block's page lookup hidden behind the previous block's loads. 64 x 8K, H100,
    2026-11-23 (``tune_decode_gpu.py --sweep large --page N``): page 16 778 -> 706 us, page 64
    756 -> 690 (cuDNN 692). Short splits, H100, 2026-11-24m, ``--sweep ab [--cold] --page N``
    (the server's shuffled pool layout, medians of 3 interleaved rounds), 64-key blocks of 4
    warps -> 32-key blocks of 2, 64-token pages, keys cold / in L2: 1 x 8K 16.89 -> 16.45 /
    10.97 -> 10.80 us, 2 x 4K 17.00 -> 16.52 / 10.55 -> 10.52, 4 x 2K 16.94 -> 16.41 / 10.60
    -> 10.42, 8 x 1K 17.05 -> 16.56 / 10.64 -> 10.55; 16-token pages (cold) 1 x 8K 17.19 ->
    16.74. Splits of two blocks (1 x 4K) split the regimes: cold 10.85 -> 10.61 but in L2
    7.47 -> 7.80, so they keep the 2-stage tile.
    """
    if cfg != DECODE_TILE or block_d != 128:
        return cfg
    if num_splits == 1 and 3 * sms < programs <= 4 * sms:
        if paged and 0 < page_tokens < ONE_SPLIT_TILE.block_n:
            return MANY_PROGRAMS_TILE
        if paged or gbps >= FAST_DRAM_SM_GBPS * sms:
            return TWO_WARP_TILE
        return ONE_SPLIT_TILE
    if paged and num_splits > 1 and split_len <= 2 * cfg.block_n:
        return MANY_PROGRAMS_TILE
    if paged and num_splits > 1 and split_len <= 4 * cfg.block_n:
        return SHORT_PAGED_SPLIT_TILE
    if num_splits == 1 and programs > 4 * sms:
        return TWO_WARP_TILE if paged else MANY_PROGRAMS_TILE
    return cfg


# paged_split_count doubles the splits where they hold at most this many key blocks.
PAGED_DOUBLE_MAX_BLOCKS = 8
# ... and, on GPUs of FAST_DRAM_SM_GBPS, where the (sequence, kv head, split) programs are at
# most one per SM in splits of at least PAGED_LONG_SPLIT_BLOCKS blocks.
PAGED_LONG_SPLIT_BLOCKS = 16


def paged_split_count(num_splits: int, est_seqlen: int, block_n: int, units: int = 0,
                      sms: int = 0, gbps: float = 0.0) -> int:
    """Paged decode's split count on Hopper, from the automatic one (``num_splits``, about one
    program per SM; ``units`` (sequence, kv head) pairs over ``sms`` SMs of ``gbps`` DRAM
    GB/s in all). A paged split waits on a table entry before each block's loads (the
    look-up, its page offset and the block's async copies form one chain the loop's
    pipeliner cannot split); a second program on the SM hides that wait.

    Short splits: twice as many where splits hold 4 to ``PAGED_DOUBLE_MAX_BLOCKS`` key blocks
    (the halves keep two or more). H100, 2026-11-24, GPU time (CUDA graph), 32q/8kv bf16, a
    shuffled pool of 64-token pages (256 KiB, the server's default at 8 kv heads x 128),
    ``tune_decode_gpu.py --sweep paged-rule --page 64``, medians of 3 turns, automatic ->
    doubled splits: D 128 (64-key blocks) 1 x 4K 8.3 -> 7.5 us (then 2 stages,
    ``decode_shape_config``; contiguous 7.5), 2 x 4K 12.1 -> 10.9 (10.5), 1 x 8K 12.2 -> 10.9
    (10.4); D 64 (128-key blocks) 2 x 8K 12.8 -> 11.6 (11.7). 16-token pages alike (1 x 8K
    12.2 -> 11.5).

    Long splits, one program per SM: twice as many on GPUs whose DRAM feeds each SM at least
    ``FAST_DRAM_SM_GBPS`` (an H200's ~36 GB/s per SM needs more bytes in flight per
    SM than one program keeps there while it waits on a look-up; an H100's ~25 does not).
    ``tune_decode_gpu.py --sweep ab --page 64`` (medians of 3 turns, 2026-11-27), GPU time
    base -> doubled, contiguous keys in brackets. H200: 8 x 8K 70.9 -> 65.0 us (66.0), 1 x 32K
    38.2 -> 36.0 (36.1), 1 x 16K 22.2 -> 21.3 (21.1), 4 x 4K 22.3 -> 21.2 (20.9), 16 x 4K
    66.1 -> 65.1 (63.8), 16 x 32K 494 -> 471 (481), 1 x 64K 70.3 -> 65.0 (66.0); D 64: 8 x 8K
    40.5 -> 36.6 (37.3), 16 x 8K 71.8 -> 66.5 (70.4), 4 x 32K 73.9 -> 65.9 (68.4); 16-token
    pages: 8 x 8K 70.7 -> 65.7, 1 x 32K 38.9 -> 36.5, 16 x 4K 72.0 -> 65.6. H100, the same
    shapes: 8 x 8K 94.1 -> 94.2 (90.2), 1 x 32K 49.6 -> 50.2 (48.4), 1 x 16K 27.8 -> 28.3,
    16 x 4K 91.5 -> 94.1, 16 x 32K 700 -> 708; D 64 16 x 8K 93.6 -> 99.6 (89.1): no gain
    anywhere, so not there."""
    split_len = -(-est_seqlen // max(num_splits, 1))
    if num_splits > 1 and 4 * block_n <= split_len <= PAGED_DOUBLE_MAX_BLOCKS * block_n:
        return 2 * num_splits
    if (0 < units * num_splits <= sms and gbps >= FAST_DRAM_SM_GBPS * sms
            and split_len >= PAGED_LONG_SPLIT_BLOCKS * block_n):
        return 2 * num_splits
    return num_splits


# 16-bit decode in 128-wide tiles for skewed rows that do not fit the padded 64
# (``_launch.kv_tile``; ``wide_skew_split_count``).
WIDE_SKEW_TILE = DecodeConfig(64, 2, 3)


def wide_skew_split_count(units: int, est_seqlen: int, sms: int) -> int:
    """The automatic split count of a contiguous decode whose skewed K/V rows do not fit the
    padded head dim (D 59 bf16, 8 kv heads packed: skews up to 7 elements, 66 > 64 columns),
    for ``units`` (sequence, kv head) pairs on a Hopper GPU of ``sms`` SMs.

    Up to 3 programs per SM: tiles twice as wide (``WIDE_SKEW_TILE``, 64 keys, 2 warps, 3
    stages) in about 8 programs per SM, splits of at least 512 keys. More: one split, and the
    decode plan reads the padded width in 8-byte pieces instead (D 59: skews up to 3) in
    ``TWO_WARP_TILE``. H200, bf16, 32q/8kv, GPU time, 2026-12-02, D 59 before -> after (D
    64): 1 x 16384 16.8 -> 16.6 us (11.6), 8 x 8192 53.9 -> 51.5 (37.7), 4 x 32768 101.0 ->
    94.5 (69.1), 16 x 8192 136.6 -> 89.8 (71.2), 32 x 4096 94.5 -> 89.0 (65.0), 48 x 4096
    179.1 -> 125.2 (97.2); 8-byte pieces: 64 x 4096 170.6 -> 147.2 (140.1), 128 x 2048 233.8
    -> 153.0 (129.9), 256 x 1024 157.6 (129.6). Best of 4 tiles x 4 split counts at each
    shape within 3% but at 8 x 8192 (50.2). 8-byte pieces lose at fewer programs (32 x 4096
    119.2, 16 x 8192 210.2; 8 x 8192 with splits 79.7), and so did a 64-wide tile plus a
    16-wide one for the columns past it (8 x 8192 74.7 at best: 255 registers)."""
    if units > 3 * sms:
        return 1
    return max(1, min(8 * sms // units, est_seqlen // 512))


# Fast-DRAM decode tiles (``fast_dram_decode``): rows of at most 64 elements, and skewed rows
# in 128-wide tiles.
NARROW_ROWS_TILE = DecodeConfig(64, 2, 3)
SKEWED_ROWS_TILE = DecodeConfig(128, 4, 3)
# ... their programs per SM, and the fewest key blocks a split holds.
FAST_DRAM_PROGRAMS_PER_SM = 4
NARROW_ROWS_MIN_BLOCKS = 4
SKEWED_ROWS_MIN_BLOCKS = 8


def fast_dram_decode(units: int, est_seqlen: int, sms: int, head_dim: int, block_d: int,
                     skewed: bool, rows16: bool) -> tuple[DecodeConfig, int] | None:
    """(tile, automatic split count) of a contiguous 16-bit decode on a Hopper GPU of
    ``FAST_DRAM_SM_GBPS`` (an H200) and ``sms`` SMs, for ``units`` (sequence, kv head) pairs,
    where it was measured; None elsewhere:

    * narrow rows: head dims 33-64 in their 64-wide tile, every K/V row on a 16-byte boundary
      (``rows16``: D 40, 48, 64 packed; not D 59's or D 36's rows, read in pieces or skewed),
      up to ``sms`` units;
    * odd head dims 65-127 read skewed (``skewed``: ``_launch.kv_shift``) in their 128-wide
      tile (D 111 with 8 packed kv heads). Not D 59's 128-wide tiles (the padded 64 read
      wide: ``wide_skew_split_count``), nor even dims' skewed rows (D 100: unmeasured).

    About ``FAST_DRAM_PROGRAMS_PER_SM`` programs per SM, splits of at least a few key blocks.

    The older rules (``SMALL_HEAD_TILE``, 128-key blocks, and ``choose_num_splits``' one
    program per SM; ``DECODE_TILE`` for skewed rows) were measured on an H100, whose DRAM
    feeds each SM 30% less. H200, bf16, 32q/8kv, GPU time (us), 2026-12-02 (``.gpu`` probe:
    4 tiles x 2-3 split counts a shape), old -> this rule's tile and splits, at 1 x 16K,
    8 x 8K, 16 x 8K and 64 x 4K keys:

    * D 40: 14.4 -> 11.4, 45.4 -> 36.3, 84.0 -> 64.9, 154.2 -> 114.8;
    * D 64: 11.7 -> 9.5, 37.4 -> 36.5, 70.9 -> 67.8, 140.6 -> 124.7;
    * D 48: 12.0 -> 10.0, 38.1 -> 36.1, 70.5 -> 69.4 (32 keys, 2 warps: 62.5), 159.9 -> 137.6
      (32 keys: 118.8);
    * D 111 (skewed, 128 keys, 4 warps, 3 stages): 25.1 -> 21.9, 82.1 -> 74.0, 148.9 -> 133.6,
      259.0 -> 252.3 (D 112 as it was: 21.5, 68.4, 126.3, 233.5). 16 splits beat 32 and 64 at
      1 x 16K (21.9, 24.3, 31.7): splits of fewer than 8 blocks leave the 3-stage pipeline
      half filled.

    Narrow rows only up to one (sequence, kv head) pair per SM: past it the older rules won or
    tied in an A/B on the same data (``.gpu`` probe, same day), older -> this tile, at 32 x 4K,
    128 x 2K and 256 x 1K: D 40 62.7 -> 65.7, 113.5 -> 143.4, 109.8 -> 110.5; D 48 55.6 ->
    64.4, 125.7 -> 149.1, 107.2 -> 121.5; D 64 63.2 -> 66.1, 125.9 -> 130.6, 124.2 -> 124.4
    (64 x 4K went the other way in an earlier call: D 40 154.2 -> 114.8). Below it, at 2 x 8K,
    4 x 32K and 8 x 8K: D 40 14.3 -> 11.6, 86.4 -> 78.1, 45.9 -> 35.4; D 48 12.0 -> 10.0, 71.2
    -> 69.8, 38.1 -> 35.2; D 64 11.7 -> 9.6, 68.6 -> 65.3, 37.4 -> 35.8. Skewed rows gained
    at every shape of that A/B but 32 x 4K (0.98x): D 111 2 x 8K 25.1 -> 21.4, 4 x 32K 159.5
    -> 133.7, 128 x 2K 267.5 -> 254.7, 256 x 1K 277.3 -> 268.5."""
    padded = padded_head_dim(head_dim)
    if block_d == padded == 64 and not skewed and rows16 and units <= sms and head_dim > 32:
        tile, min_blocks = NARROW_ROWS_TILE, NARROW_ROWS_MIN_BLOCKS
    elif block_d == padded == 128 and skewed and head_dim % 2:
        tile, min_blocks = SKEWED_ROWS_TILE, SKEWED_ROWS_MIN_BLOCKS
    else:
        return None
    by_programs = round(FAST_DRAM_PROGRAMS_PER_SM * sms / max(1, units))
    by_length = est_seqlen // (min_blocks * tile.block_n)
    return tile, max(1, min(by_programs, by_length))


@functools.lru_cache(maxsize=512)
def paged_decode_config(head_dim: int, dtype: torch.dtype, device: torch.device,
                        kv_fp8: bool = False, skewed: bool = False) -> DecodeConfig:
    """``decode_config``, and 128-key blocks for FP8 pages at (padded) head dim 64 and below
    too (16-bit ones get them from ``decode_config``): a 64-key block there is too little work
    to hide a block's page lookups. Measured first on pages: H100, bf16, 32q/8kv, 8 x 8K keys,
    GPU time (graph) 64 -> 128 keys: D64 page 16 74.9 -> 60.0 us, page 64 59.8 -> 54.8
    (contiguous decode, 64 keys: 57.3). At D128 128 keys helped some shapes and hurt others
    (page 16: 64x8K 786 -> 725 us but 128x2K 365 -> 384, 1x4K 15.1 -> 16.0), so 64 stays.
    FP8 pages at D128 take the contiguous FP8 tiles (128 keys, 4 warps, 3 stages): H200,
    2026-11-23, page 16, GPU time 64 -> 128 keys: 1x32K 55.2 -> 48.3 us, 16x32K 699 -> 534,
    but 64x8K 385 -> 412 and 128x2K 199 -> 213 (bf16 pages: 55.1, 761, 621, 260)."""
    cfg = decode_config(head_dim, dtype, device, kv_fp8, skewed)
    if cfg.block_n == 64 and padded_head_dim(head_dim) <= 64:  # FP8 pages (16-bit: already)
        return DecodeConfig(128, cfg.num_warps, cfg.num_stages)
    return cfg
