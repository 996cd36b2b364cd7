"""A cheaper launch path for small, repeated kernel calls.

A Triton launch through ``kernel[grid](...)`` binds and specializes every argument, builds a
cache key and looks the compiled kernel up on every call. Measured on an H100 host (triton
3.6, a one-off timing loop, 2026-11-23; decode 1 x 4K, 38 launch arguments): 28 us per
launch that way, 8 us when the same arguments go straight to the compiled kernel's launcher,
and our decode wrapper's own checks and set-up added another 38 us, against 21 us of host
time for a whole cuDNN SDPA call. With both pieces below: decode 1 x 4K 31.6 us against
cuDNN's 46.7 on another host; prefill [64, 128, 64] causal 77.7 us before, 27.0 after on a
host whose launches were 22% slower (git history:
``benchmarks/profile_host.py``, ``benchmarks/results/issue13/h100_2026-11-23b/``; cuDNN's host time
varies by host too).

Two pieces cut both:

* ``call_key``: what a call's checks and set-up depend on without reading values (per tensor
  its shape, strides, dtype, device, and the 16-byte alignment Triton specializes pointers
  on; the scalar arguments and their types). A wrapper keeps its checked, derived launch
  set-up (a plan) under that key (``PlanCache``), so a repeated call skips the checks and set-up
  it already did for the same key.
* ``KernelLaunch``: one kernel with a fixed grid and fixed compile-time arguments. Its first
  call goes through Triton (compiling if need be) and keeps the compiled kernel; later calls on
  the GPU hand the run-time arguments straight to the compiled kernel's launcher. Triton's
  own path is kept where it is needed: under the interpreter, with launch hooks installed
  (profilers), and on a device other than the current one.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Hashable
from typing import Any

import torch
from triton import knobs

from attention_kernels._checks import kv_scale_args
from attention_kernels.configs import interpreting, padded_head_dim


# Triton specializes integer arguments on divisibility by 16 only, so the rows of head dims
# that are multiples of 4 or 8 but not 16 (40, 72, 100, 200) were read 2 bytes at a time. The
# kernels mark their row pointers instead (``_paging.row_ptrs``). H200, bf16, GPU time, 64 x
# 4096 decode (32q/8kv) and causal 4 x 4096 prefill (16q/8kv), before (rows copied into
# 16-aligned ones where that paid, else none) -> marked: decode D 72 939 -> 186 us (D 80: 178),
# 100 1285 -> 254 (112: 225), 40 447 -> 155, 200 2068 -> 473; prefill 72 960 -> 850, 100 1209
# -> 1063, 40 449 -> 416, 200 1890 -> 1777 (2026-12-02; the copies are gone).
def row_align(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None,
              strides: tuple[int | None, ...], kv_shifted: bool = False) -> int:
    """The bytes (4, 8 or 16) every row of q, k, v and out starts at a multiple of, for a
    kernel's ``ROW_ALIGN``. ``strides``: the K/V strides as the launch passes them (k token,
    k head, v token, v head, table, k page, v page; None: unused); q's are its own; out is
    ``[T, H, D]`` contiguous, in q's dtype when the call makes it. Each stride counts in its
    own tensor's element size. 0 where Triton sees the alignment itself (every stride a
    multiple of 16 elements: a mark would replace its own finding), or where nothing is
    worth marking (2-byte rows, or data not 16-byte aligned: a base's alignment is part of a
    plan's key, ``call_key``). ``kv_shifted``: K/V rows are read skewed (``kv_shift``), so
    only q's and out's count."""
    head_dim = q.shape[-1]
    rows = ((q, q.stride()[:2]), (k, (strides[0], strides[1], strides[5])),
            (v, (strides[2], strides[3], strides[6])),
            (out if out is not None else q, (q.shape[1] * head_dim, head_dim)))
    if kv_shifted:
        rows = (rows[0], rows[3])
    g, seen = 0, True
    for t, row_strides in rows:
        if t.data_ptr() % 16:
            return 0
        for s in row_strides:
            if s is not None:
                seen = seen and s % 16 == 0
                g = math.gcd(g, s * t.element_size())
    if seen:
        return 0
    nbytes = g & -g
    return min(nbytes, 16) if nbytes >= 4 else 0


def kv_shift(k: torch.Tensor, v: torch.Tensor, strides: tuple[int | None, ...],
             head_dim: int, block_d: int, piece: int = 16) -> int:
    """A kernel's ``KV_SHIFT``: the elements in a ``piece`` of K/V (16 or 8 bytes; else 0)
    when a program can read its K/V rows in whole pieces although they do not start on piece
    boundaries, or end inside a piece:

    * every row of one kv head starts equally far past a boundary, its skew (all strides but
      the head's are multiples of the piece, as in packed ``[T, 8, 100]`` bf16: token 1600
      bytes, head 200), so the program reads its rows skewed (``_paging.kv_bases``), and the
      largest skew plus the head dim fits ``block_d``;
    * a piece can hold a neighbouring head's elements, or bytes past the last row up to the
      next boundary: taken only when the tensor's extent (first to last element, from its
      shape and strides) ends on one, or its storage holds those bytes (``kv_room``, part of
      a plan's key), so every byte read lies inside the storage. Rows padded to 16 bytes, a
      server's cache pages at odd head dims, are read so: skew 0, their pads (any values)
      the neighbours' columns; a mask that ends inside a piece would read the whole row an
      element at a time.

    ``strides`` as ``row_align`` takes them."""
    size = k.element_size()  # v's too (``_checks``)
    vec = piece // size
    skew = max(vec - math.gcd(strides[1], vec), vec - math.gcd(strides[3], vec))
    if (skew == 0 and head_dim % vec == 0) or head_dim + skew > block_d:
        return 0  # rows whole already (``row_align`` marks them), or the skew does not fit
    if any(s is not None and s % vec for s in (strides[0], strides[2], strides[5], strides[6])):
        return 0
    for t in (k, v):
        if t.data_ptr() % 16 or t.numel() == 0 or not _room(t):
            return 0
    return vec


def _room(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds every byte from its start up to the first 16-byte
    boundary at or past its extent's end (a non-empty ``t``)."""
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    end = t.data_ptr() + extent * t.element_size()
    if end % 16 == 0:
        return True
    storage = t.untyped_storage()
    return -(-end // 16) * 16 <= storage.data_ptr() + storage.nbytes()


def kv_room(k: torch.Tensor, v: torch.Tensor) -> bool | None:
    """For a plan's key: whether ``kv_shift``'s pieces past K's and V's extents lie inside
    their storage (``_room``); None where it never asks: rows of whole 16-byte pieces that
    start on 16 bytes (head strides too: D 64 rows 68 apart are skewed). A few Python
    operations per call only for the others."""
    try:
        vec = 16 // k.element_size()
        if (k.shape[-1] % vec == 0 and k.stride(-2) % vec == 0 and v.stride(-2) % vec == 0) \
                or k.numel() == 0 or v.numel() == 0:
            return None
        return _room(k) and _room(v)
    except (AttributeError, IndexError, TypeError):
        return None  # not tensors: the checks refuse them


def kv_tile(k: torch.Tensor, v: torch.Tensor, strides: tuple[int | None, ...],
            head_dim: int) -> tuple[int, int]:
    """(``BLOCK_D``, ``KV_SHIFT``) of a decode launch: the padded head dim and ``kv_shift``
    there; where the largest skew does not fit it, twice that (up to 256) when it fits
    there. D 59 bf16, 8 kv heads packed: skews up to 7 elements, 66 > 64 columns. H200,
    64 x 4096 keys, 32q/8kv, GPU time: 447 us read element by element, 170 in 128-wide
    skewed tiles (D 64: 142), 2026-12-02; decode's plan now reads that shape at 64 in 8-byte
    pieces (``configs.wide_skew_split_count``). (Prefill gained 6% that way; it copies such
    rows into padded ones instead.)"""
    block_d = padded_head_dim(head_dim)
    shift = kv_shift(k, v, strides, head_dim, block_d)
    if shift == 0 and block_d < 256:
        wide = kv_shift(k, v, strides, head_dim, 2 * block_d)
        if wide:
            return 2 * block_d, wide
    return block_d, shift


def call_key(tensors: tuple[object, ...], scalars: tuple[object, ...],
             window: object) -> tuple[Any, ...] | None:
    """What a kernel wrapper's checks and set-up read of a call, without reading any tensor
    value: per tensor its shape, strides, dtype, device and the 16-byte alignment Triton
    specializes pointers on; the scalar arguments with their types (``True == 1`` and
    ``False == 0.0`` as values, but the checks refuse a bool where a number belongs); and
    ``window`` (a pair of ints). None where a call cannot be keyed (then it takes the
    checked path every time)."""
    if not (type(window) is tuple and len(window) == 2 and type(window[0]) is int
            and type(window[1]) is int):
        return None
    sigs: list[object] = []
    for t in tensors:
        if t is None:
            sigs.append(None)
        elif isinstance(t, torch.Tensor):
            sigs.append((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15 == 0))
        else:
            return None
    return (*sigs, window, *scalars, *map(type, scalars))


class PlanCache:
    """Derived launch set-ups by key, bounded: a caller cycling through more distinct shapes
    than ``capacity`` starts over rather than growing without end (each entry is small, but a
    server sees unbounded shape variety)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._plans: dict[Hashable, Any] = {}

    def get(self, key: Hashable | None) -> Any:
        if key is None:
            return None
        try:
            return self._plans.get(key)
        except TypeError:  # an unhashable argument (a list where a tuple goes): no reuse
            return None

    def put(self, key: Hashable | None, plan: Any) -> None:
        if key is None:
            return
        if len(self._plans) >= self.capacity:
            self._plans.clear()
        with contextlib.suppress(TypeError):
            self._plans[key] = plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


class KernelLaunch:
    """``fn[grid](*args, **constexprs)`` with ``grid`` and ``constexprs`` (and launch options
    such as ``num_warps``) fixed; ``args`` are the kernel's run-time parameters, in order."""

    __slots__ = ("fn", "grid", "kwargs", "compiled", "device", "_tail")

    def __init__(self, fn: Any, grid: tuple[int, ...], kwargs: dict[str, Any]) -> None:
        self.fn = fn
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.kwargs = kwargs
        self.compiled: Any = None
        self.device = -1
        self._tail: tuple[Any, ...] = ()

    def __call__(self, *args: Any) -> None:
        compiled = self.compiled
        if (compiled is not None and not knobs.runtime.launch_enter_hook.calls
                and not knobs.runtime.launch_exit_hook.calls):
            device = torch._C._cuda_getDevice()
            if device == self.device:
                g0, g1, g2 = self.grid
                compiled.run(g0, g1, g2, torch._C._cuda_getCurrentRawStream(device),
                             compiled.function, compiled.packed_metadata, None, None, None,
                             *args, *self._tail)
                return
        kernel = self.fn[self.grid](*args, **self.kwargs)
        if compiled is None and not interpreting() and hasattr(kernel, "packed_metadata"):
            # The launcher takes every parameter in signature order, compile-time ones too
            # (it skips them): the constexprs follow the run-time arguments.
            params = self.fn.params[len(args):]
            if all(p.is_constexpr for p in params):
                self._tail = tuple(self.kwargs.get(p.name, p.default) for p in params)
                self.device = torch._C._cuda_getDevice()
                self.compiled = kernel


def outputs(out: torch.Tensor | None, lse_out: torch.Tensor | None, return_lse: bool,
            out_shape: tuple[int, ...], lse_shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A call's ``(out, lse)``: the caller's buffers (already checked) or fresh ones. Without
    ``return_lse`` the lse is ``out`` again, a pointer the kernel never writes through."""
    if out is None:
        out = torch.empty(out_shape, dtype=dtype, device=device)
    if not return_lse:
        return out, out
    if lse_out is None:
        lse_out = torch.empty(lse_shape, dtype=torch.float32, device=device)
    return out, lse_out


def launch_inputs(
    plan: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None, k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[Any, ...]:
    """A checked call's tensors as its ``plan`` (``copy_q`` / ``copy_kv``) launches them:
    ``(q, k, v, table, slopes, k_scales, v_scales, scale_stride)``."""
    if plan.copy_q:
        q = q.contiguous()
    if plan.copy_kv:
        k, v = k.contiguous(), v.contiguous()
    if table is not None and not table.is_contiguous():
        table = table.contiguous()
    slopes = alibi_slopes.contiguous() if alibi_slopes is not None else None
    ks, vs, stride_sb = kv_scale_args((k_scale, v_scale) if k_scale is not None else None)
    return q, k, v, table, slopes, ks, vs, stride_sb


def table_row_stride(table: torch.Tensor) -> int:
    """The block table's row stride as ``launch_inputs`` passes the table: one that is not
    contiguous goes through a contiguous copy, its rows ``shape[1]`` apart (a plan that took
    the caller's stride read a column slice of a wider table from the wrong entries)."""
    return table.stride(0) if table.is_contiguous() else table.shape[1]


def no_keys(out: torch.Tensor, lse: torch.Tensor, return_lse: bool) -> None:
    """What a launch with no keys at all would write: zeros, lse -inf."""
    out.zero_()
    if return_lse:
        lse.fill_(float("-inf"))
