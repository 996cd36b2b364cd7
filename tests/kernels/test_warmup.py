"""``warmup``'s worker processes: how many, each call run once, failures that cost only time,
and (GPU) that the in-process pass after them compiles nothing."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from attention_kernels import kernel_warmup
from attention_kernels.kernel_warmup import (
    WORKERS_ENV,
    WarmupSpec,
    compile_in_workers,
    default_workers,
    warmup,
)
from tests.kernels.conftest import DEVICE, ON_GPU

SPEC = WarmupSpec((64,), (torch.float16,), "cpu", False, ())


def test_default_workers_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert default_workers(torch.device("cpu")) == 3
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv(WORKERS_ENV, bad)
        with pytest.raises(ValueError, match=WORKERS_ENV):
            default_workers(torch.device("cpu"))
    monkeypatch.delenv(WORKERS_ENV)
    assert default_workers(torch.device("cpu")) == 1  # nothing compiles on the CPU
    with pytest.raises(ValueError, match="workers must be >= 1"):
        warmup((64,), (torch.float16,), "cpu", workers=0)


def test_a_worker_runs_every_call_once_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers share one counter: each call index goes to exactly one of them."""
    ran: list[int] = []
    monkeypatch.setattr(kernel_warmup, "warmup_calls",
                        lambda spec: [lambda i=i: ran.append(i) for i in range(7)])
    taken = mp.get_context("spawn").Value("i", 3)  # another worker took 0-2 already
    kernel_warmup._worker(SPEC, taken, 7)
    assert ran == [3, 4, 5, 6]
    with pytest.raises(RuntimeError, match="built 7 calls, the parent 8"):
        kernel_warmup._worker(SPEC, taken, 8)


def test_warmup_through_workers_runs_clean(caplog: pytest.LogCaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    """Spawned workers rebuild the same calls and run them (no worker warns: a failing one
    would only be logged, the in-process pass covering for it). An empty cache: a cold start,
    so the workers do start."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="attention_kernels"):
        assert warmup((64,), (torch.float16,), DEVICE, with_lse=False, workers=2) > 0
    assert not [r for r in caplog.records if r.name == "attention_kernels"], caplog.text


def test_workers_start_only_on_a_cold_cache(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    """Before starting workers, the first, middle and last calls run in-process: when none of
    them adds a file to Triton's cache (a restart), no worker starts."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    ran: list[int] = []
    calls = [lambda i=i: ran.append(i) for i in range(9)]
    assert not kernel_warmup._cache_is_warm(calls)  # an empty cache is a cold one
    assert ran == [0, 4, 8]
    (tmp_path / "old").write_text("x")
    assert kernel_warmup._cache_is_warm(calls)

    def compile_one() -> None:
        (tmp_path / f"new{len(ran)}").write_text("x")
        ran.append(-1)

    assert not kernel_warmup._cache_is_warm([compile_one])


@pytest.mark.skipif(ON_GPU, reason="the interpreter compiles nothing: files alone tell the state")
def test_warmup_skips_workers_on_a_warm_cache(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    started: list[int] = []
    monkeypatch.setattr(kernel_warmup, "compile_in_workers", lambda spec, n, w: started.append(w))
    warmup((64,), (torch.float16,), DEVICE, with_lse=False, workers=3)
    assert started == [3]  # empty: cold
    (tmp_path / "old").write_text("x")
    warmup((64,), (torch.float16,), DEVICE, with_lse=False, workers=3)
    assert started == [3]  # the probes added nothing: warm


def test_a_failing_worker_costs_only_time(caplog: pytest.LogCaptureFixture) -> None:
    bad = WarmupSpec((64,), (torch.float16,), "cpu", False, (0,))  # page size 0 divides by 0
    with caplog.at_level(logging.WARNING, logger="attention_kernels"):
        compile_in_workers(bad, 3, 1)
    assert "exited with 1" in caplog.text


@pytest.mark.skipif(not ON_GPU, reason="compiles happen on a GPU only")
def test_workers_leave_nothing_to_compile(tmp_path: Path) -> None:
    """From an empty Triton cache, the workers compile every variant: the in-process pass
    after them adds nothing to the on-disk cache (it only loads)."""
    script = textwrap.dedent("""
        import os, torch
        from attention_kernels.kernel_warmup import (
            WarmupSpec, compile_in_workers, warmup, warmup_calls)
        spec = WarmupSpec((64, 128), (torch.bfloat16,), "cuda", True, (16,))
        compile_in_workers(spec, len(warmup_calls(spec)), 4)
        def files():
            return {os.path.join(d, f) for d, _, fs in os.walk(os.environ["TRITON_CACHE_DIR"])
                    for f in fs}
        before = files()
        warmup(spec.head_dims, spec.dtypes, spec.device, page_tokens=spec.page_tokens,
               workers=1)
        new = sorted(files() - before)
        assert before and not new, f"{len(before)} files, {len(new)} new: {new[:4]}"
    """)
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_prefill_variants_take_the_padded_gluon_launches(
        monkeypatch: pytest.MonkeyPatch, sm90_stand_in: list[tuple[int, int]]) -> None:
    """On an sm_90 device (these CPU tensors stand for one) the warm-up's prefill calls at a
    head dim the Gluon kernel takes only padded (D 40-127 other than 64, 128) include launches
    big enough for it: it compiles builds of its own per such head dim, and at D 59 (out's
    token stride a multiple of 16 at 16 heads, not at 18) for both kinds of token stride."""
    from attention_kernels import prefill_kernel

    monkeypatch.setattr(kernel_warmup, "interpreting", lambda: False)
    monkeypatch.setattr(kernel_warmup, "_many_heads", lambda total_q, device: 16)

    def padded_calls(d: int) -> int:
        q = torch.zeros(5, 4, d, dtype=torch.bfloat16)
        kv = torch.zeros(5, 2, d, dtype=torch.bfloat16)
        calls = kernel_warmup._prefill_variants(q, kv, torch.tensor([0, 5]), (False, True))
        return sum(prefill_kernel._padded_gluon_dim(c.args[0], c.args[1], c.args[2], True,
                                                    c.keywords["causal"], 1) > 0
                   for c in calls)

    assert padded_calls(72) == 8  # (non-)causal x lse x hint
    assert padded_calls(59) == padded_calls(100) == 16  # at 16 and 18 heads
    assert padded_calls(64) == padded_calls(32) == 0


def test_fast_dram_decodes_name_the_rule_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU of fast DRAM (faked) the warm-up runs ``configs.fast_dram_decode``'s tiles,
    direct (groups 1, 2) and split (groups 1-8): D 40 over one layout (its 2, 8 and 16 kv
    head layouts plan alike), D 111 over 8 and 16 packed kv heads (rows skewed; token strides
    of both divisibilities by 16; over 2 heads no common skew, no rule). Each call runs.
    ``test_any_head_dim`` checks that these plan the variants real calls plan."""
    from attention_kernels.configs import NARROW_ROWS_TILE, SKEWED_ROWS_TILE

    monkeypatch.setattr(kernel_warmup, "fast_dram", lambda device: True)
    device = torch.device(DEVICE)
    for d, tile, heads in ((40, NARROW_ROWS_TILE, {2}), (111, SKEWED_ROWS_TILE, {8, 16})):
        merges: list = []
        calls = kernel_warmup._fast_dram_decodes(d, torch.bfloat16, device, (False, True),
                                                 merges)
        layouts = len(heads)  # per layout: 2 groups x 2 lse direct, 4 groups x 2 lse split
        assert len(calls) == 12 * layouts and len(merges) == 8 * layouts
        assert {call.args[1].shape[1] for call in calls} == heads
        for call in calls:
            assert call.keywords["_config"] == tile
            call()
    assert kernel_warmup._fast_dram_decodes(40, torch.float32, device, (False,), []) == []
    assert kernel_warmup._fast_dram_decodes(59, torch.bfloat16, device, (False,), []) == []
    monkeypatch.setattr(kernel_warmup, "fast_dram", lambda device: False)
    assert kernel_warmup._fast_dram_decodes(40, torch.bfloat16, device, (False,), []) == []
