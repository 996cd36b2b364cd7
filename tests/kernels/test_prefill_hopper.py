"""The Gluon Hopper prefill (``prefill_hopper``): what it compiles to (any machine: Triton
compiles for sm_90a without a GPU and ships ptxas), when ``prefill`` takes it, and on an
sm_90 GPU its results against the float64 reference."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from attention_kernels import prefill, prefill_kernel, prefill_ref, quantize_kv
from attention_kernels.prefill_hopper import hopper_prefill_ws, register_split, tile_options
from tests.kernels.conftest import DEVICE, ON_GPU, TOL, check_lse, cu_seqlens, poison_, randn

ON_SM90 = ON_GPU and torch.cuda.get_device_capability()[0] == 9
LOG2E = 1.4426950408889634


# One process runs ``tune_hopper_prefill.py --compile-only`` for every build this module asks
# for (its ``main`` with each build's argv, stdout captured): torch and Triton load once, not
# once per build (8 builds: ~2.4 s of CPU each saved).
_COMPILE_WORKER = r"""
import contextlib, io, json, runpy, sys, traceback
script = sys.argv[1]
main = runpy.run_path(script, run_name="tune_hopper_prefill")["main"]
for line in sys.stdin:
    sys.argv = [script, "--compile-only", *json.loads(line)]
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main()
    except BaseException:
        rc, err = 1, io.StringIO(err.getvalue() + traceback.format_exc())
    print(json.dumps({"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}),
          flush=True)
"""


@pytest.fixture(scope="module")
def compile_sm90() -> Iterator[Callable[..., dict]]:
    """``tune_hopper_prefill.py --compile-only`` with the given flags, in a process of its own
    (under TRITON_INTERPRET=1, CI, this process's jit functions are the interpreter's): exit 3
    (no ptxas in this triton) skips; anything but 0 fails with its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[2] / "tools" / "tuning" / "tune_hopper_prefill.py"
    proc = subprocess.Popen([sys.executable, "-c", _COMPILE_WORKER, str(script)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None

    def run(causal: bool, head_dim: int, tile: str, *extra: str) -> dict:
        proc.stdin.write(json.dumps(["--head-dim", str(head_dim), "--tile", tile, *extra]
                                    + (["--causal"] if causal else [])) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, f"the compile process exited with {proc.wait(60)}"
        res = json.loads(line)
        if res["rc"] == 3:
            pytest.skip(res["stdout"].strip())
        assert res["rc"] == 0, res["stderr"][-2000:]
        return json.loads(res["stdout"].strip().splitlines()[-1])

    yield run
    proc.stdin.close()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.mark.timeout(600)  # the compile process's own limit before it was shared
@pytest.mark.parametrize("kv_scales", [False, True], ids=["16bit", "fp8"])
@pytest.mark.parametrize("head_dim, tile, regs", [(128, "128,2,2", 224), (64, "128,3,3", 160)],
                         ids=["d128-2wg", "d64-3wg"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_compiles_for_sm90_without_spills(compile_sm90: Callable[..., dict], causal: bool,
                                          head_dim: int, tile: str, regs: int,
                                          kv_scales: bool) -> None:
    """The register split holds (consumers at 224 with two warpgroups, 160 with three), the
    wgmma stay asynchronous (the order is the kernel's point), and spills stay a few scalars
    of the tile walk: 20-80 bytes as built on 2026-11-24; the producer's per-chunk value
    offsets, before they became one shared tile, spilled 2.9 KB. The consumers take turns
    (named-barrier syncs in the PTX) by default except causal with three warpgroups."""
    got = compile_sm90(causal, head_dim, tile, *(["--kv-scales"] if kv_scales else []))
    assert got["spill_bytes"] <= 96, got
    assert regs in got["setmaxnreg_inc"], got
    assert got["wgmma_wait_1"] > 0, got  # S_j waited for with the PV in flight
    turns = tile_options(causal, int(tile.split(",")[2]))[1]
    assert (got["turn_syncs"] > 0) == turns, got


@pytest.mark.timeout(600)
@pytest.mark.parametrize("head_dim, out_dim, tile, causal", [(64, 59, "128,3,3", True),
                                                             (128, 72, "128,2,2", False)],
                         ids=["d59-causal", "d72-full"])
def test_narrow_rows_build_compiles_without_spills(compile_sm90: Callable[..., dict],
                                                   head_dim: int, out_dim: int, tile: str,
                                                   causal: bool) -> None:
    """The builds of a padded launch (only ``out``'s columns stored; at D 72 q read as it is,
    its extra columns zeroed in shared memory) keep the 16-bit build's spills and register
    split. A column mask on V's masked block spilled 1.9 KB."""
    got = compile_sm90(causal, head_dim, tile, "--out-dim", str(out_dim))
    assert got["spill_bytes"] <= 96, got
    assert (160 if tile.endswith("3") else 224) in got["setmaxnreg_inc"], got
    assert got["wgmma_wait_1"] > 0, got


def test_tile_option_defaults() -> None:
    """Causal 192-row tiles end at each sequence's last row, every other launch starts at the
    first; every launch takes turns; a value given wins."""
    assert tile_options(True, 3) == (True, True)
    assert tile_options(False, 3) == (False, True)
    assert tile_options(True, 2) == (False, True)
    assert tile_options(True, 3, end_tiles=False, pingpong=True) == (False, True)


def test_register_budget_is_checked() -> None:
    q = torch.empty(0, 1, 128, dtype=torch.bfloat16)
    cu = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="consumer_regs"):
        hopper_prefill_ws(q, q, q, cu, cu, q, None, False, 1.0, consumer_regs=240,
                          producer_regs=32)
    with pytest.raises(ValueError, match="consumer_regs 176 x 3"):
        hopper_prefill_ws(q, q, q, cu, cu, q, None, False, 1.0, consumers=3,
                          consumer_regs=176, producer_regs=24)
    with pytest.raises(ValueError, match="consumers"):
        hopper_prefill_ws(q, q, q, cu, cu, q, None, False, 1.0, consumers=4)
    assert register_split(3, 160, 24) == 168  # the default consumer's share, 16 warps
    assert register_split(2, 224, 32) == 248


def test_prefill_takes_it_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_gluon_ok``: sm_90, D 64 or 128, a launch big enough for descriptor loads, no
    features."""
    big = [True]
    monkeypatch.setattr(prefill_kernel, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(prefill_kernel, "_tma_ok",
                        lambda q, k, v, span=None, head_dims=(), kv_copied=False, dim=0:
                        big[0] and (dim or q.shape[2]) in head_dims)
    q = torch.empty(8, 4, 128, dtype=torch.bfloat16)
    assert prefill_kernel._gluon_ok(q, q, q, True, False, 1)
    big[0] = False
    assert not prefill_kernel._gluon_ok(q, q, q, True, False, 1)  # small launch: host-bound
    big[0] = True
    assert not prefill_kernel._gluon_ok(q, q, q, False, False, 1)  # window / softcap / ALiBi
    q64 = torch.empty(8192, 4, 64, dtype=torch.bfloat16)
    assert prefill_kernel._gluon_ok(q64, q64, q64, True, False, 1)
    assert prefill_kernel._gluon_ok(q64, q64, q64, True, True, 4)  # mean 2K
    assert not prefill_kernel._gluon_ok(q64, q64, q64, True, True, 5)
    q96 = torch.empty(8, 4, 96, dtype=torch.bfloat16)
    assert not prefill_kernel._gluon_ok(q96, q96, q96, True, False, 1)
    assert not prefill_kernel._gluon_ok(q[:, ::2], q, q, True, False, 1)  # heads not packed
    monkeypatch.setenv("ATTENTION_KERNELS_GLUON", "0")
    assert not prefill_kernel._gluon_ok(q, q, q, True, False, 1)
    monkeypatch.delenv("ATTENTION_KERNELS_GLUON")
    # FP8 K/V: widened to the queries' dtype first, so they qualify like 16-bit ones.
    k8 = torch.empty(8, 4, 128, dtype=torch.float8_e4m3fn)
    assert prefill_kernel._gluon_ok(q, k8, k8, True, False, 1)
    assert prefill_kernel._gluon_ok(q.half(), k8, k8, True, False, 1)
    assert not prefill_kernel._gluon_ok(q, k8, k8, False, False, 1)
    assert not prefill_kernel._gluon_ok(q, q.half(), q.half(), True, False, 1)  # 16-bit, other
    big[0] = False
    assert not prefill_kernel._gluon_ok(q, k8, k8, True, False, 1)
    big[0] = True
    for cap in ((8, 0), (10, 0)):  # Ampere; Blackwell has no wgmma
        monkeypatch.setattr(prefill_kernel, "_capability", lambda index, cap=cap: cap)
        assert not prefill_kernel._gluon_ok(q, q, q, True, False, 1)
        assert not prefill_kernel._gluon_ok(q, k8, k8, True, False, 1)


CASES = [  # lens_q, lens_k (None: the same), heads, kv heads
    ([1], None, 4, 4), ([17], None, 4, 2), ([127, 129], None, 4, 1), ([0, 1, 17], None, 4, 4),
    ([5, 0, 33, 0], None, 8, 2), ([78, 40, 130], None, 8, 8), ([1000], None, 16, 4),
    ([78, 40, 2050], None, 4, 4), ([300, 1], [700, 5], 4, 2), ([64, 200], [10, 600], 4, 4),
    ([4096], None, 16, 2), ([300, 1, 2000, 0, 700], [700, 5, 10, 0, 2000], 8, 2),
]
# (head dim, launch options): prefill()'s persistent launches, one program per tile, and 3
# programs walking many tiles each (ring and Q-buffer phases carried across tiles, tiles
# without keys between them), statically and claiming tiles from the counter; tiles aligned
# at each sequence's start and at its end (a partial first tile reaching below row 0); the
# consumers' GEMMs in turns (the default but for causal 192-row tiles) and not.
LAUNCHES = [
    (128, dict(block_n=128, stages=2, consumers=2)),
    (128, dict(block_n=64, stages=3, consumers=2, programs=3, pingpong=False)),
    (128, dict(block_n=128, stages=2, consumers=2, programs=3, dynamic=True)),
    (64, dict(block_n=128, stages=2, consumers=3)),
    (64, dict(block_n=128, stages=3, consumers=3, programs=3, dynamic=True)),
    (64, dict(block_n=128, stages=3, consumers=2, programs=3, pingpong=False)),
    # Tiles aligned at the other end of each sequence than the default (which ends causal
    # 192-row tiles at each sequence's last row).
    (128, dict(block_n=128, stages=2, consumers=2, programs=3, dynamic=True, end_tiles=True)),
    (64, dict(block_n=128, stages=2, consumers=3, programs=3, dynamic=True, end_tiles=False)),
    # Consumers issuing their GEMMs in turns (named barriers): per tile every warpgroup takes
    # as many turns as the others, including one whose rows see no key.
    (128, dict(block_n=128, stages=2, consumers=2, pingpong=True)),
    (128, dict(block_n=128, stages=2, consumers=2, programs=3, dynamic=True, pingpong=True)),
    (64, dict(block_n=128, stages=3, consumers=3, programs=3, dynamic=True, pingpong=True)),
    (64, dict(block_n=128, stages=3, consumers=3, programs=3, end_tiles=False, pingpong=True)),
]


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("launch", LAUNCHES,
                         ids=lambda c: f"d{c[0]}-" + "-".join(f"{k}{v}" for k, v in c[1].items()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[0]))[:24])
def test_against_reference(case: tuple, causal: bool, dtype: torch.dtype,
                           launch: tuple[int, dict]) -> None:
    """Odd lengths (ragged last blocks, a value tile running into the next sequence), empty
    sequences, causal with q != k lengths (rows that see no key), GQA, poisoned outputs."""
    lens_q, lens_k, heads, kv_heads = case
    head_dim, options = launch
    lens_k = lens_k or lens_q
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = randn(sum(lens_q), heads, head_dim, dtype=dtype)
    k = randn(sum(lens_k), kv_heads, head_dim, dtype=dtype)
    v = randn(sum(lens_k), kv_heads, head_dim, dtype=dtype)
    out = torch.empty_like(q)
    lse = torch.empty(heads, q.shape[0], dtype=torch.float32, device=DEVICE)
    poison_(out)
    poison_(lse)
    hopper_prefill_ws(q, k, v, cu_q, cu_k, out, lse, causal, LOG2E / math.sqrt(head_dim),
                      **options)
    ref, ref_lse = prefill_ref(q.double(), k.double(), v.double(), cu_q, cu_k, causal=causal,
                               return_lse=True)
    assert torch.isfinite(out).all()
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < TOL[dtype], f"relative error {err:.3g}"
    assert (out[torch.isneginf(ref_lse).t()] == 0).all()  # rows that see no key
    check_lse(lse, ref_lse, dtype)


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("head_dim", [128, 64])
def test_prefill_routes_long_plain_launches_to_it(monkeypatch: pytest.MonkeyPatch,
                                                  head_dim: int) -> None:
    """``prefill`` launches the Gluon kernel for a long bf16 prompt, persistent with the head
    dim's consumer count (and its result is right), and the portable kernel once a feature
    (a window) is asked for."""
    calls = []
    real = prefill_kernel.hopper_prefill_ws
    monkeypatch.setattr(prefill_kernel, "hopper_prefill_ws",
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    lens = [8192, 77]  # a mean of 4K+ (D 64 causal takes it from there)
    cu = cu_seqlens(lens)
    q = randn(sum(lens), 16, head_dim, dtype=torch.bfloat16)
    kv = randn(sum(lens), 2, head_dim, dtype=torch.bfloat16)
    out = prefill(q, kv, kv, cu, causal=True)
    assert len(calls) == 1
    assert calls[0]["dynamic"] and calls[0]["programs"] == torch.cuda.get_device_properties(
        DEVICE).multi_processor_count
    assert calls[0]["consumers"] == (3 if head_dim == 64 else 2)
    ref = prefill_ref(q.double(), kv.double(), kv.double(), cu, causal=True)
    assert ((out.double() - ref).norm() / ref.norm()).item() < TOL[torch.bfloat16]
    prefill(q, kv, kv, cu, causal=True, window_size=(256, 0))
    assert len(calls) == 1


def test_padded_head_dims_take_it_where_it_applies(monkeypatch: pytest.MonkeyPatch,
                                                   sm90_stand_in: list[tuple[int, int]]) -> None:
    """``_padded_gluon_dim``: head dims 40-127 other than 64 run on the Gluon kernel padded to
    the next of 64 and 128, under its rules (``_gluon_ok`` and ``_tma_ok`` as they are, on
    an sm_90 device these CPU tensors stand for: 16-bit K/V like q, no features, enough work,
    causal D 64 only for long prompts, its switches)."""
    dim = prefill_kernel._padded_gluon_dim

    def qkv(d: int, tokens: int = 8192, heads: int = 4) -> tuple[torch.Tensor, ...]:
        kv = torch.empty(tokens, 1, d, dtype=torch.bfloat16)
        return torch.empty(tokens, heads, d, dtype=torch.bfloat16), kv, kv

    assert [dim(*qkv(d), True, False, 1) for d in (32, 39, 40, 59, 64, 65, 100, 111, 127, 128,
                                                   160)] == [0, 0, 64, 64, 0, 128, 128, 128,
                                                             128, 0, 0]
    assert dim(*qkv(59), True, True, 4) == 64  # causal, mean 2K
    assert dim(*qkv(59), True, True, 5) == 0
    assert dim(*qkv(100), True, True, 5) == 128
    assert dim(*qkv(111), False, False, 1) == 0  # window / softcap / ALiBi
    assert dim(*qkv(111, tokens=2048), True, False, 1) == 0  # small launch: host-bound
    q, k, v = qkv(111)
    assert dim(q.half(), k, v, True, False, 1) == 0
    k8 = k.to(torch.float8_e4m3fn)
    assert dim(q, k8, k8, True, False, 1) == 0  # FP8 K/V: their own path
    assert dim(q.float(), k.float(), v.float(), True, False, 1) == 0
    strided = torch.empty(8192, 8, 111, dtype=torch.bfloat16)[:, ::2]
    assert dim(strided, k, v, True, False, 1) == 128  # q's own rows: copied anyway
    for switch in ("ATTENTION_KERNELS_GLUON", "ATTENTION_KERNELS_TMA"):
        monkeypatch.setenv(switch, "0")
        assert dim(q, k, v, True, False, 1) == 0
        monkeypatch.delenv(switch)
    def pad_q(q: torch.Tensor) -> bool:  # the plan's: q copied into padded rows
        kv = torch.empty(q.shape[0], 1, q.shape[2], dtype=q.dtype)
        cu = torch.tensor([0, q.shape[0]], dtype=torch.int32)
        plan = prefill_kernel._plan(q, kv, kv, cu, None, False, None, False, None, (-1, -1),
                                    0.0, None, q.shape[0], None, None, None, None)
        assert plan.gluon_dim
        return plan.pad_q

    assert not pad_q(torch.empty(8192, 8, 72, dtype=torch.bfloat16))  # heads on 16 bytes
    assert not pad_q(torch.empty(8192, 8, 40, dtype=torch.float16))
    # Heads off 16-byte boundaries (a TMA copy must start on one: D 59's odd heads faulted).
    assert pad_q(torch.empty(8192, 8, 59, dtype=torch.bfloat16))
    assert pad_q(torch.empty(8192, 8, 100, dtype=torch.bfloat16))
    assert pad_q(torch.empty(8192, 8, 80, dtype=torch.bfloat16)[..., :72])  # heads not packed
    flat = torch.empty(8192 * 8 * 72 + 1, dtype=torch.bfloat16)
    assert pad_q(flat[1:].view(8192, 8, 72))  # starts off 16 bytes
    assert pad_q(torch.empty(32768, 1, 40, dtype=torch.bfloat16))  # a head under the tile

    # What the launch gets: the tile's K/V and tiles, q as it is or padded, the caller's out.
    # (Plans made here are for a GPU these tensors only stand for: kept out of the cache.)
    monkeypatch.setattr(prefill_kernel, "_PLANS", type(prefill_kernel._PLANS)())
    launches = []
    monkeypatch.setattr(prefill_kernel, "num_sms", lambda index: 132)
    monkeypatch.setattr(prefill_kernel, "pad_rows",
                        lambda t, d: torch.nn.functional.pad(t, (0, d - t.shape[2])))
    monkeypatch.setattr(prefill_kernel, "hopper_prefill_ws", lambda *a, **kw: launches.append(
        ([t.shape[2] for t in a[:3]], a[5], kw)))
    for d, q_width, tile in ((72, 72, 128), (59, 64, 64), (100, 128, 128)):
        q_d, k_d, v_d = qkv(d)
        out = torch.empty_like(q_d)
        prefill(q_d, k_d, v_d, torch.tensor([0, 8192], dtype=torch.int32), out=out)
        widths, got_out, kw = launches.pop()
        assert widths == [q_width, tile, tile] and got_out is out
        assert kw == {**kw, **prefill_kernel._GLUON_TILES[tile]}
    for cap in ((8, 0), (10, 0)):  # Ampere; Blackwell has no wgmma
        sm90_stand_in[0] = cap
        assert dim(q, k, v, True, False, 1) == 0


def test_widened_kv_for_it_hold_heads_packed(monkeypatch: pytest.MonkeyPatch,
                                             sm90_stand_in: list[tuple[int, int]]) -> None:
    """FP8 K/V in rows padded past D (heads not packed) are widened for the Gluon kernel into
    packed copies: it reads each kv head at column ``head * D`` of ``[rows, H_kv * D]``. (The
    copies once kept the rows' padding, and kv head 1 would have read head 0's pad.) The
    portable kernel keeps the padded rows' strides. ``hopper_prefill_ws`` refuses heads not
    packed, and a narrower q unless 16-bit with K and V at the tile's width."""
    q = torch.empty(8192, 8, 128, dtype=torch.bfloat16)
    k = torch.empty(8192, 2, 144, dtype=torch.bfloat16).to(torch.float8_e4m3fn)[..., :128]
    cu = torch.tensor([0, 8192], dtype=torch.int32)
    ones = torch.ones(2)

    def plan(switch: str) -> prefill_kernel._PrefillPlan:
        monkeypatch.setenv("ATTENTION_KERNELS_GLUON", switch)
        return prefill_kernel._plan(q, k, k, cu, None, False, None, False, None, (-1, -1), 0.0,
                                    None, 8192, ones, ones, None, None)

    gluon, portable = plan("1"), plan("0")
    assert gluon.gluon and gluon.widen_kv and gluon.widen_row == 128
    assert not portable.gluon and portable.widen_kv and portable.widen_row == 144
    with pytest.raises(ValueError, match="heads packed"):
        padded = torch.empty(8192, 2, 144, dtype=torch.bfloat16)[..., :128]
        hopper_prefill_ws(q, padded, padded, cu, cu, q, None, False, 1.0)
    # Only 16-bit q may be narrower than the tile (FP8 V is transposed whole; V never).
    kv = torch.empty(8192, 2, 128, dtype=torch.bfloat16)
    narrow = torch.empty(8192, 8, 120, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="only 16-bit q"):
        hopper_prefill_ws(narrow, kv, kv[..., :120].contiguous(), cu, cu, narrow, None, False,
                          1.0)
    with pytest.raises(ValueError, match="only 16-bit q"):
        e4m3 = torch.float8_e4m3fn
        hopper_prefill_ws(narrow.to(e4m3), kv.to(e4m3), kv.to(e4m3), cu, cu, narrow, None,
                          False, 1.0)


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("head_dim", [40, 59, 72, 111])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padded_head_dims_against_reference(monkeypatch: pytest.MonkeyPatch, head_dim: int,
                                            causal: bool) -> None:
    """``prefill`` at a head dim the Gluon kernel does not take, with enough work: one Gluon
    launch at the padded dim on K/V padded and q as it is where its heads start on 16-byte
    boundaries (D 40, 72; else padded too), storing only the caller's columns; its result and
    lse against float64 in the caller's poisoned ``out`` (inside a larger buffer, off 16-byte
    boundaries) and ``lse_out``; varlen with a ragged last block, GQA."""
    calls = []
    real = prefill_kernel.hopper_prefill_ws
    monkeypatch.setattr(prefill_kernel, "hopper_prefill_ws", lambda *a, **kw: calls.append(
        (a[0].shape[2], a[1].shape[2], a[2].shape[2])) or real(*a, **kw))
    lens = [8192, 4097]
    cu = cu_seqlens(lens)
    q = randn(sum(lens), 8, head_dim, dtype=torch.bfloat16)
    k, v = (randn(sum(lens), 2, head_dim, dtype=torch.bfloat16) for _ in "kv")
    buf = torch.empty(q.numel() + 66, dtype=torch.bfloat16, device=DEVICE)
    out = buf[33 : 33 + q.numel()].view(q.shape)
    lse = torch.empty(8, sum(lens), dtype=torch.float32, device=DEVICE)
    poison_(buf)
    poison_(lse)
    got, got_lse = prefill(q, k, v, cu, causal=causal, return_lse=True, out=out, lse_out=lse)
    padded = 64 if head_dim < 64 else 128
    assert calls == [(head_dim if head_dim % 8 == 0 else padded, padded, padded)]
    assert got.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    assert torch.isnan(buf[:33]).all() and torch.isnan(buf[-33:]).all()  # nothing past out
    ref, ref_lse = prefill_ref(q.double(), k.double(), v.double(), cu, causal=causal,
                               return_lse=True)
    assert torch.isfinite(got).all()
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert err < TOL[torch.bfloat16], f"relative error {err:.3g}"
    check_lse(got_lse, ref_lse, torch.bfloat16)


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("head_dim", [40, 72])
def test_padded_head_dims_keep_heads_apart(monkeypatch: pytest.MonkeyPatch,
                                           head_dim: int) -> None:
    """A padded launch reads each head's Q tile on into the next head's columns and zeroes
    them in shared memory: infinities and NaN in one head's q, k or v leave every other
    head's output and lse as float64 has them. A strided q (rows not TMA-readable) takes a
    padded copy instead, with the same answers."""
    calls = []
    real = prefill_kernel.hopper_prefill_ws
    monkeypatch.setattr(prefill_kernel, "hopper_prefill_ws",
                        lambda *a, **kw: calls.append(a[0].shape[2]) or real(*a, **kw))
    lens = [8192, 300]
    cu = cu_seqlens(lens)
    q = randn(sum(lens), 8, head_dim, dtype=torch.bfloat16)
    k, v = (randn(sum(lens), 8, head_dim, dtype=torch.bfloat16) for _ in "kv")
    for t, value in ((q, math.inf), (k, -math.inf), (v, math.nan)):
        t[::7, 3] = value  # head 3's rows: heads 2 and 4 are its neighbours
    ref, ref_lse = prefill_ref(q.double(), k.double(), v.double(), cu,
                               causal=True, return_lse=True)
    keep = [h for h in range(8) if h != 3]
    wide = randn(sum(lens), 8, head_dim + 8, dtype=torch.bfloat16)[..., :head_dim]
    wide.copy_(q)
    for query, width in ((q, head_dim), (wide, 64 if head_dim < 64 else 128)):
        calls.clear()
        got, lse = prefill(query, k, v, cu, causal=True, return_lse=True)
        assert calls == [width]
        assert torch.isfinite(got[:, keep]).all()
        err = ((got[:, keep].double() - ref[:, keep]).norm() / ref[:, keep].norm()).item()
        assert err < TOL[torch.bfloat16], f"relative error {err:.3g}"
        check_lse(lse[keep], ref_lse[keep], torch.bfloat16)


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel runs on sm_90 only")
def test_repeated_prefill_reuses_its_bound_gluon_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A repeated call of one shape goes straight to the kernel Triton compiled for the first
    (the plan's ``gluon_launches``: one launch, its compiled kernel kept) and is right on
    fresh inputs and outputs every time, lse included; other lengths of the same shape too
    (``cu_seqlens`` values are run-time arguments, not part of the key)."""
    monkeypatch.setattr(prefill_kernel, "_PLANS", type(prefill_kernel._PLANS)())
    for i, lens in enumerate(([8192, 77], [8192, 77], [77, 8192])):
        cu = cu_seqlens(lens)
        q = randn(sum(lens), 8, 128, dtype=torch.bfloat16)
        kv = randn(sum(lens), 2, 128, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        lse_out = torch.empty(8, q.shape[0], dtype=torch.float32, device=DEVICE)
        poison_(out)
        poison_(lse_out)
        got, lse = prefill(q, kv, kv, cu, causal=i == 1, return_lse=True, out=out,
                           lse_out=lse_out)
        ref, ref_lse = prefill_ref(q.double(), kv.double(), kv.double(), cu, causal=i == 1,
                                   return_lse=True)
        assert torch.isfinite(got).all()
        assert ((got.double() - ref).norm() / ref.norm()).item() < TOL[torch.bfloat16]
        check_lse(lse, ref_lse, torch.bfloat16)
    plans = list(prefill_kernel._PLANS._plans.values())
    assert len(plans) == 2  # non-causal (calls 1 and 3: other lengths, one shape) and causal
    for plan in plans:
        assert plan.gluon and len(plan.gluon_launches) == 1
        assert next(iter(plan.gluon_launches.values())).compiled is not None


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("per_seq", [False, True], ids=["per-head", "per-sequence"])
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_prefill_widens_kv_for_it(monkeypatch: pytest.MonkeyPatch, head_dim: int,
                                      dtype: torch.dtype, causal: bool, per_seq: bool) -> None:
    """FP8 K/V: ``prefill`` widens K/V to the queries' dtype and launches the Gluon kernel on
    the copies with the scales (per kv head, or per sequence and kv head); against the
    float64 reference on the same FP8 K/V at the queries' dtype's tolerance, lse included:
    the widening is exact and the scales are applied in float32, as the portable kernel
    does. Scales far from 1 (keys x3, values /3 before quantizing), a 0 and odd lengths."""
    calls = []
    real = prefill_kernel.hopper_prefill_ws
    monkeypatch.setattr(prefill_kernel, "hopper_prefill_ws",
                        lambda *a, **kw: calls.append((a[1].dtype, kw["kv_scales"] is not None))
                        or real(*a, **kw))
    # Long enough for it (D 64 causal: a mean prompt of 2K).
    lens = [16384, 0, 77, 300] if causal else [8192, 0, 77, 1400]
    cu = cu_seqlens(lens)
    q = randn(sum(lens), 4, head_dim, dtype=dtype)
    k = randn(sum(lens), 2, head_dim, dtype=torch.float32) * 3
    v = randn(sum(lens), 2, head_dim, dtype=torch.float32) / 3
    if per_seq:  # each sequence with its own scales (the service's batched launches)
        ends = cu.tolist()
        parts = [(quantize_kv(k[a:b] * (b % 7 + 1)), quantize_kv(v[a:b] / (b % 5 + 1)))
                 for a, b in zip(ends[:-1], ends[1:], strict=True)]
        k8 = torch.cat([kq for (kq, _), _ in parts])
        v8 = torch.cat([vq for _, (vq, _) in parts])
        ks = torch.stack([s for (_, s), _ in parts])
        vs = torch.stack([s for _, (_, s) in parts])
    else:
        (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
    out = torch.empty_like(q)
    lse_out = torch.empty(4, q.shape[0], dtype=torch.float32, device=DEVICE)
    poison_(out)
    poison_(lse_out)
    got, lse = prefill(q, k8, v8, cu, causal=causal, return_lse=True, out=out, lse_out=lse_out,
                       k_scale=ks, v_scale=vs)
    assert calls == [(dtype, True)]
    ref, ref_lse = prefill_ref(q.double(), k8, v8, cu, causal=causal, return_lse=True,
                               k_scale=ks, v_scale=vs)
    assert torch.isfinite(got).all()
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], f"relative error {err:.3g}"
    check_lse(lse, ref_lse, dtype)


@pytest.mark.timeout(600)
# D 64 once (causal: the masked path too; a compile is ~12 s of CPU time).
@pytest.mark.parametrize("head_dim, causal", [(128, False), (128, True), (64, True)],
                         ids=["d128-full", "d128-causal", "d64-causal"])
def test_fp8_build_compiles_without_spills(compile_sm90: Callable[..., dict],
                                           head_dim: int, causal: bool) -> None:
    """The FP8 Q/K/V build (both dots in e4m3, V transposed through TMA): at most a register
    stored and reloaded in a key loop and few spills around them (its first form, which loaded
    a ragged last block of transposed values through masked pointer loads in the producer,
    spilled 8 KB; with the row sums' wgmma a three-consumer build's last consumer spills one
    register a block, of ~640 instructions, and 180-250 B at each tile's start and end), the
    consumers' register split, async wgmma, turns."""
    from attention_kernels.prefill_kernel import _FP8_HEAD_DIMS, _FP8_TILE

    assert head_dim in _FP8_HEAD_DIMS
    tile = _FP8_TILE
    got = compile_sm90(causal, head_dim,
                       f"{tile['block_n']},{tile['stages']},{tile['consumers']}", "--fp8")
    assert got["spill_bytes"] <= 288, got
    assert got["key_loop_spills"] is not None and got["key_loop_spills"] <= 2, got
    assert {2: 224, 3: 160}[tile["consumers"]] in got["setmaxnreg_inc"], got
    # S waited for with the PV and the row sums in flight (``_pv_issue``), their ones tile
    # stored as e4m3 1.0 in every byte (0 words when ptxas mangled a converted constant).
    assert got["wgmma_wait_2"] > 0 and got["turn_syncs"] > 0 and got["ones_words"] > 0, got
    # The output's rescale behind a warp vote (``_rescale_skip``), not 64 predicated FMUL.
    assert got["rescale_skips"] > 0, got
    # The softmax runs under the warpgroup's own PV: all of a block's exp2 (64 a thread at 128
    # keys) between the QK^T wait and the next full wait (``_ws_step_fp8``). With the PV's
    # wait after the softmax, as the 16-bit build writes it, ptxas hoisted it: 0.
    assert got["ex2_under_pv"] >= tile["block_n"] // 2, got


# FP8 Q/K/V on FP8 tensor cores against the reference on the same FP8 inputs: P is e4m3 too
# (3 mantissa bits where the 16-bit kernel keeps 7-10) and the output bf16; measured relative
# errors 0.017-0.022 (H200, 2026-11-30, call E). The lse's error grows with the logits: FP8
# wgmma accumulates its products with fewer bits than fp32 (DeepSeek-V3's report: about 14):
# 0.0003-0.0049 absolute with logits of standard deviation up to 3, 0.26 with 36 times those
# (calls E, G, H): under 7e-4 of the sequence's largest lse magnitude (a row's own lse can be
# near 0 while its logits' terms are large: causal rows that see few keys).
FP8_P_TOL = 0.04
FP8_LSE_REL = 2e-3


def _check_fp8_lse(lse: torch.Tensor, ref: torch.Tensor, cu: list[int]) -> None:
    lse, ref = lse.double().cpu(), ref.double().cpu()
    assert not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref)), "-inf where no key is seen"
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        got, want = lse[:, a:b], ref[:, a:b]
        seen = ~torch.isneginf(want)
        if seen.any():
            bound = FP8_LSE_REL * max(1.0, want[seen].abs().max().item())
            err = (got[seen] - want[seen]).abs().max().item()
            assert err <= bound, f"rows {a}..{b}: lse error {err:.3g} > {bound:.3g}"


def _fp8_qkv(lens: list[int], heads: int, kv_heads: int, per_seq: bool, head_dim: int = 128
             ) -> tuple[torch.Tensor, ...]:
    from attention_kernels.fp8 import quantize_queries

    total = sum(lens)
    q = randn(total, heads, head_dim, dtype=torch.float32)
    k = randn(total, kv_heads, head_dim, dtype=torch.float32) * 3
    v = randn(total, kv_heads, head_dim, dtype=torch.float32) / 3
    (q8, qs), (k8, ks), (v8, vs) = quantize_queries(q, kv_heads), quantize_kv(k), quantize_kv(v)
    if per_seq:  # scales per (sequence, kv head): each sequence's values its own magnitude
        batch = len(lens)
        grow = torch.arange(1, batch + 1, device=DEVICE, dtype=torch.float32)[:, None]
        qs, ks, vs = (s[None, :] * grow for s in (qs, ks, vs))
        qs, ks, vs = qs.contiguous(), ks.contiguous(), vs.contiguous()
    return q8, k8, v8, qs, ks, vs


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("per_seq", [False, True], ids=["per-head", "per-sequence"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lens, heads, kv_heads", [
    ([1, 77, 300, 1000, 129, 640], 8, 2),  # ragged, unaligned starts (an unaligned TMA start
    ([200, 900], 8, 8),                    # once took it down), a 1-row sequence, GQA
    ([1024, 1024], 16, 16),
], ids=["ragged-gqa", "two", "dense"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["d64", "d128"])
def test_fp8_queries_on_fp8_tensor_cores(monkeypatch: pytest.MonkeyPatch, lens: list[int],
                                         heads: int, kv_heads: int, causal: bool,
                                         per_seq: bool, head_dim: int) -> None:
    """``prefill`` of FP8 queries at D 64 and 128 takes the Gluon kernel with FP8 operands,
    and its bf16 output and lse match the reference on the same FP8 inputs; poisoned
    buffers."""
    calls = []
    real = prefill_kernel.hopper_prefill_ws
    monkeypatch.setattr(prefill_kernel, "hopper_prefill_ws",
                        lambda *a, **kw: calls.append(a[0].dtype) or real(*a, **kw))
    q8, k8, v8, qs, ks, vs = _fp8_qkv(lens, heads, kv_heads, per_seq, head_dim)
    cu = cu_seqlens(lens)
    out = torch.empty(q8.shape, dtype=torch.bfloat16, device=DEVICE)
    lse_out = torch.empty(heads, q8.shape[0], dtype=torch.float32, device=DEVICE)
    poison_(out)
    poison_(lse_out)
    got, lse = prefill(q8, k8, v8, cu, causal=causal, return_lse=True, out=out, lse_out=lse_out,
                       q_scale=qs, k_scale=ks, v_scale=vs)
    assert calls == [torch.float8_e4m3fn]
    ref, ref_lse = prefill_ref(q8, k8, v8, cu, causal=causal, return_lse=True, q_scale=qs,
                               k_scale=ks, v_scale=vs, compute_dtype=torch.float64)
    assert torch.isfinite(got).all()
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < FP8_P_TOL, f"relative error {err:.3g}"
    _check_fp8_lse(lse, ref_lse, cu.tolist())


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("head_dim", [64, 128], ids=["d64", "d128"])
def test_fp8_output_rescale_follows_each_row(head_dim: int) -> None:
    """Each query row meets a key of a far larger score (about 8 log2 units above the rest)
    in a block of its own: in most blocks some rows of a warp move their max and the others
    keep it. ``_rescale_skip`` may skip the output's rescale only where no row of the warp
    moved: one row missed would keep its old terms at up to 2^8 times their weight."""
    from attention_kernels.fp8 import quantize_queries

    n, heads = 1024, 4
    q = randn(n, heads, head_dim, dtype=torch.float32)
    k = randn(n, heads, head_dim, dtype=torch.float32) * 0.5
    v = randn(n, heads, head_dim, dtype=torch.float32)
    rows = torch.arange(n, device=DEVICE)
    spike = 128 + (rows * 389) % (n - 128)  # past the first key block, scattered over blocks
    k[spike] = q[rows] * (8 * math.log(2) / head_dim**0.5)
    (q8, qs), (k8, ks), (v8, vs) = quantize_queries(q, heads), quantize_kv(k), quantize_kv(v)
    cu = cu_seqlens([n])
    out = torch.empty(q8.shape, dtype=torch.bfloat16, device=DEVICE)
    poison_(out)
    got = prefill(q8, k8, v8, cu, q_scale=qs, k_scale=ks, v_scale=vs, out=out)
    ref = prefill_ref(q8, k8, v8, cu, q_scale=qs, k_scale=ks, v_scale=vs,
                      compute_dtype=torch.float64).double()
    assert torch.isfinite(got).all()
    err = (got.double() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert err.max().item() < 4 * FP8_P_TOL, f"worst row {err.argmax().item()}: {err.max():.3g}"


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel runs on sm_90 only")
def test_fp8_values_of_one_sequence_never_reach_another() -> None:
    """A sequence's last key block runs past its end; NaN bytes in the next sequence's values
    must not reach it (``transposed_values_ref``: zeros between sequences)."""
    lens = [200, 900]
    q8, k8, v8, qs, ks, vs = _fp8_qkv(lens, 8, 8, False)
    v8 = v8.clone()
    v8.view(torch.uint8)[200:] = 0x7F  # e4m3fn NaN
    got = prefill(q8, k8, v8, cu_seqlens(lens), q_scale=qs, k_scale=ks, v_scale=vs)
    assert torch.isfinite(got[:200]).all() and torch.isnan(got[200:]).all()
    ref = prefill_ref(q8[:200], k8[:200], v8[:200], cu_seqlens([200]), q_scale=qs, k_scale=ks,
                      v_scale=vs, compute_dtype=torch.float64)
    assert ((got[:200].double() - ref.double()).norm() / ref.double().norm()) < FP8_P_TOL


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("head_dim", [64, 128], ids=["d64", "d128"])
def test_fp8_error_is_that_of_quantizing_the_inputs(head_dim: int) -> None:
    """FlashAttention-3's accuracy setting (entries N(0, 1) with 0.1% outliers N(0, 10)):
    the kernel's RMSE against float64 on the unquantized inputs within 2x of the RMSE of
    quantizing Q, K and V alone (issue 65's bound; measured 1.00x at 2 x 4K x 16 heads,
    2026-11-30, call E: 0.0197 both)."""
    from attention_kernels.fp8 import dequantize_kv, dequantize_queries, quantize_queries

    def gen(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, device=DEVICE)
        return torch.where(torch.rand(*shape, device=DEVICE) < 1e-3,
                           torch.randn(*shape, device=DEVICE) * 10, x)

    lens = [2048]
    cu = cu_seqlens(lens)
    q, k, v = (gen(2048, 4, head_dim) for _ in range(3))
    exact = prefill_ref(q.double(), k.double(), v.double(), cu)
    (q8, qs), (k8, ks), (v8, vs) = quantize_queries(q, 4), quantize_kv(k), quantize_kv(v)
    alone = prefill_ref(dequantize_queries(q8, qs, 4, torch.float64),
                        dequantize_kv(k8, ks, torch.float64),
                        dequantize_kv(v8, vs, torch.float64), cu)
    got = prefill(q8, k8, v8, cu, q_scale=qs, k_scale=ks, v_scale=vs)

    def rmse(t: torch.Tensor) -> float:
        return (t.double() - exact).pow(2).mean().sqrt().item()

    assert rmse(got) < 2 * rmse(alone), (rmse(got), rmse(alone))


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernel runs on sm_90 only")
def test_fp8_queries_into_outputs_of_any_alignment() -> None:
    """A launch compiled for a 16-byte aligned ``out`` (vector stores) is not reused for an
    ``out=`` view two bytes off (``_fp8_prefill`` keys its launches on alignment): both
    calls right, no misaligned store. Expanded per-sequence scale views are read right too."""
    lens = [300, 200]
    q8, k8, v8, qs, ks, vs = _fp8_qkv(lens, 8, 2, False)
    cu = cu_seqlens(lens)
    ref = prefill_ref(q8, k8, v8, cu, q_scale=qs, k_scale=ks, v_scale=vs,
                      compute_dtype=torch.float64).double()
    aligned = prefill(q8, k8, v8, cu, q_scale=qs, k_scale=ks, v_scale=vs)
    base = torch.empty(q8.numel() + 1, dtype=torch.bfloat16, device=DEVICE)
    shifted = base[1:].view(q8.shape)
    poison_(shifted)
    got = prefill(q8, k8, v8, cu, q_scale=qs.expand(2, 2), k_scale=ks.expand(2, 2),
                  v_scale=vs.expand(2, 2), out=shifted)
    torch.cuda.synchronize()
    for out in (aligned, got):
        assert ((out.double() - ref).norm() / ref.norm()).item() < FP8_P_TOL
