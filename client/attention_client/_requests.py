"""Turn user arguments into a validated request: header bytes, tensors, and the expected outputs.

Client-side checks only catch the obvious (rank, dtype, matching shapes): the server is the
authority on everything else (head dims, cu_seqlens values, limits) and answers
INVALID_ARGUMENT naming the field. With a ``Placement`` (registered regions, see _regions.py)
tensors that live in (or are staged into) a region travel as spans instead of bytes, and the
outputs go into q's region when it has room.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_client._regions import Placement, Span
from attention_client._tensors import (
    Origin,
    RegionTensor,
    WireTensor,
    as_cu_seqlens,
    describe,
    storage_dtype,
    to_user,
    to_wire,
)
from attention_wire.pb import attention_pb2 as pb

Tensor = WireTensor | RegionTensor

PREFILL = "Prefill"
DECODE = "Decode"

# gRPC's default receive limit is 4 MiB; every message we send stays below this, header included.
MAX_HEADER_BYTES = 3 * 1024 * 1024 + 512 * 1024


@dataclass
class PreparedRequest:
    """Everything needed to send one call and to rebuild its result."""

    method: str  # PREFILL | DECODE
    header: bytes  # serialized PrefillHeader / DecodeHeader
    tensors: tuple[Tensor, Tensor, Tensor]  # q, k, v: wire bytes, or spans of regions
    out_shape: tuple[int, ...]  # OUT as the server sends it
    out_dtype: int  # pb.DType of OUT (q's)
    lse_shape: tuple[int, ...] | None  # LSE as the server sends it, None if not requested
    origin: Origin  # the flavour results come back in (q's)
    user_shape: tuple[int, ...]  # out's shape as the caller sees it
    lse_fix: Callable[[Any], Any]  # server lse layout -> the caller's
    placement: Placement | None = None
    out_span: Span | None = None  # OUT written into a region instead of streamed
    lse_span: Span | None = None
    user_out: Any = None  # ``out=``: returned as the result once the server wrote it

    @property
    def streamed_out_shape(self) -> tuple[int, ...] | None:
        return None if self.out_span is not None else self.out_shape

    @property
    def streamed_lse_shape(self) -> tuple[int, ...] | None:
        return None if self.lse_span is not None else self.lse_shape

    def result(self, out: Any, lse: Any) -> Any:
        """The user's result: ``out``/``lse`` as streamed (storage arrays), or read from the
        region spans the server wrote (a private copy; ``out=`` is returned as it is)."""
        if self.placement is not None and self.lse_span is not None:
            assert self.lse_shape is not None
            lse = self.placement.read(self.lse_span, self.lse_shape, pb.FLOAT32)
        if self.user_out is not None:
            result = self.user_out
        else:
            if self.placement is not None and self.out_span is not None:
                out = self.placement.read(self.out_span, self.out_shape, self.out_dtype)
            result = to_user(out.reshape(self.user_shape), self.origin)
        if lse is None:
            return result
        return result, to_user(self.lse_fix(lse), self.origin, is_lse=True)


def _tensor(x: Any, name: str, placement: Placement | None) -> Tensor:
    placed = placement.input(x, name) if placement is not None else None
    return placed if placed is not None else to_wire(x, name)[0]


def _encode_qkv(
    q: Any, k: Any, v: Any, placement: Placement | None = None
) -> tuple[Tensor, Tensor, Tensor, Origin]:
    _, _, origin = describe(q, "q")
    wq, wk, wv = (_tensor(x, n, placement) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    if not wq.dtype == wk.dtype == wv.dtype:
        names = ", ".join(pb.DType.Name(t.dtype) for t in (wq, wk, wv))
        raise ValueError(f"q, k, v must share one dtype, got {names}")
    if wk.shape != wv.shape:
        raise ValueError(f"v shape {wv.shape} differs from k shape {wk.shape}")
    return wq, wk, wv, origin


def _require_rank(t: Tensor, rank: int, layout: str) -> None:
    if len(t.shape) != rank:
        raise ValueError(f"{t.name} must be {rank}-D {layout}, got shape {t.shape}")


def _nbytes(shape: tuple[int, ...], wire_dtype: int) -> int:
    return int(np.prod(shape, dtype=np.int64)) * storage_dtype(wire_dtype).itemsize


def _spec(t: Tensor) -> pb.TensorSpec:
    return pb.TensorSpec(dtype=t.dtype, shape=t.shape)


def _place_outputs(
    header: Any, tensors: tuple[Tensor, ...], placement: Placement | None, out: Any,
    out_nbytes: int, lse_nbytes: int,
) -> tuple[Span | None, Span | None]:
    """Spans of the inputs in regions, and of the outputs (``out=`` or scratch near q)."""
    spans = {t.name: t.span for t in tensors if isinstance(t, RegionTensor)}
    out_span = lse_span = None
    if placement is not None:
        if out is not None:
            out_span = placement.user_output(out)
            if out_span is None:
                raise ValueError("out must be a contiguous tensor inside a registered region")
            if out_span.nbytes != out_nbytes:
                raise ValueError(f"out has {out_span.nbytes} bytes, the result {out_nbytes}")
        q_span = spans.get("q")
        if q_span is not None:
            if out_span is None:
                out_span = placement.output(q_span, out_nbytes)
            if lse_nbytes:
                lse_span = placement.output(q_span, lse_nbytes)
    elif out is not None:
        raise ValueError("out= needs registered regions (use_regions is off)")
    if out_span is not None:
        spans["out"] = out_span
    if lse_span is not None:
        spans["lse"] = lse_span
    if spans:
        header.regions.CopyFrom(pb.TensorRegions(**{n: s.message() for n, s in spans.items()}))
    return out_span, lse_span


def _scale(softmax_scale: float | None) -> float | None:
    if softmax_scale is None:
        return None
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale!r}")
    return scale


def _checked_header(header: Any) -> bytes:
    data = header.SerializeToString()
    if len(data) > MAX_HEADER_BYTES:
        raise ValueError(
            f"request header is {len(data)} bytes (cu_seqlens too long), over the "
            f"{MAX_HEADER_BYTES} byte limit that keeps messages under gRPC's 4 MiB default: "
            "split the batch over several calls"
        )
    return data


def _batch_major(lse: Any, heads: int, batch: int, n_q: int) -> Any:
    """The server's prefill lse [H, B*N] as the 4-D form's callers want it: [B, H, N]."""
    x = lse.reshape(heads, batch, n_q)
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x.transpose(1, 0, 2))
    return x.permute(1, 0, 2).contiguous()  # a torch tensor (a CUDA region's lse)


def _same(lse: Any) -> Any:
    return lse


def prepare_prefill(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens: Any = None,
    cu_seqlens_k: Any = None,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    placement: Placement | None = None,
    out: Any = None,
) -> PreparedRequest:
    wq, wk, wv, origin = _encode_qkv(q, k, v, placement)
    user_shape = wq.shape
    lse_fix: Callable[[Any], Any] = _same
    if cu_seqlens is None:
        if cu_seqlens_k is not None:
            raise ValueError("cu_seqlens_k needs cu_seqlens (the query boundaries) too")
        if len(wq.shape) == 3:  # one sequence
            for t in (wk, wv):
                _require_rank(t, 3, "[N_k, H_kv, D] (q is 3-D)")
            cu_q = np.array([0, wq.shape[0]], np.int32)
            cu_k = np.array([0, wk.shape[0]], np.int32)
        elif len(wq.shape) == 4:  # a batch of equal-length sequences
            for t in (wk, wv):
                _require_rank(t, 4, "[B, N_k, H_kv, D] (q is 4-D)")
            batch, n_q, heads = wq.shape[0], wq.shape[1], wq.shape[2]
            if wk.shape[0] != batch:
                raise ValueError(f"k batch {wk.shape[0]} differs from q batch {batch}")
            n_k = wk.shape[1]
            cu_q = np.arange(batch + 1, dtype=np.int64) * n_q
            cu_k = np.arange(batch + 1, dtype=np.int64) * n_k
            if cu_q[-1] > np.iinfo(np.int32).max or cu_k[-1] > np.iinfo(np.int32).max:
                raise ValueError("q or k has more than 2**31 - 1 tokens")
            cu_q, cu_k = cu_q.astype(np.int32), cu_k.astype(np.int32)
            wq = wq.reshaped((batch * n_q, *wq.shape[2:]))
            wk = wk.reshaped((batch * n_k, *wk.shape[2:]))
            wv = wv.reshaped((batch * n_k, *wv.shape[2:]))
            lse_fix = functools.partial(_batch_major, heads=heads, batch=batch, n_q=n_q)
        else:
            raise ValueError(
                f"q must be 3-D [N, H, D] or 4-D [B, N, H, D], got shape {wq.shape}"
            )
    else:
        for t in (wq, wk, wv):
            _require_rank(t, 3, "packed [total, H, D] (cu_seqlens given)")
        cu_q = as_cu_seqlens(cu_seqlens, "cu_seqlens")
        cu_k = (
            as_cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
            if cu_seqlens_k is not None
            else np.empty(0, np.int32)  # empty: the server uses cu_seqlens_q
        )
        if cu_k.size and cu_k.size != cu_q.size:
            raise ValueError(
                f"cu_seqlens has {cu_q.size - 1} sequences but cu_seqlens_k has {cu_k.size - 1}"
            )
    header = pb.PrefillHeader(
        q=_spec(wq),
        k=_spec(wk),
        v=_spec(wv),
        cu_seqlens_q=cu_q.tolist(),
        cu_seqlens_k=cu_k.tolist(),
        causal=bool(causal),
        return_lse=bool(return_lse),
    )
    scale = _scale(softmax_scale)
    if scale is not None:
        header.softmax_scale = scale
    total_q, heads = wq.shape[0], wq.shape[1]
    lse_shape = (heads, total_q) if return_lse else None
    out_span, lse_span = _place_outputs(
        header, (wq, wk, wv), placement, out, _nbytes(wq.shape, wq.dtype),
        _nbytes(lse_shape, pb.FLOAT32) if lse_shape else 0,
    )
    return PreparedRequest(
        method=PREFILL, header=_checked_header(header), tensors=(wq, wk, wv),
        out_shape=wq.shape, out_dtype=wq.dtype, lse_shape=lse_shape, origin=origin,
        user_shape=user_shape, lse_fix=lse_fix, placement=placement, out_span=out_span,
        lse_span=lse_span, user_out=out,
    )


def prepare_decode(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_k: Any,
    *,
    softmax_scale: float | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    placement: Placement | None = None,
    out: Any = None,
) -> PreparedRequest:
    wq, wk, wv, origin = _encode_qkv(q, k, v, placement)
    _require_rank(wq, 3, "[B, H, D]")
    for t in (wk, wv):
        _require_rank(t, 3, "packed [total_k, H_kv, D]")
    if cu_seqlens_k is None:
        raise ValueError("cu_seqlens_k is required for decode")
    cu_k = as_cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
    batch, heads = wq.shape[0], wq.shape[1]
    if cu_k.size != batch + 1:
        raise ValueError(
            f"cu_seqlens_k must have batch+1 = {batch + 1} entries (q has batch {batch}), "
            f"got {cu_k.size}"
        )
    splits = int(num_splits)
    if not 0 <= splits <= np.iinfo(np.int32).max:
        raise ValueError(f"num_splits must be >= 0, got {num_splits}")
    header = pb.DecodeHeader(
        q=_spec(wq),
        k=_spec(wk),
        v=_spec(wv),
        cu_seqlens_k=cu_k.tolist(),
        num_splits=splits,
        return_lse=bool(return_lse),
    )
    scale = _scale(softmax_scale)
    if scale is not None:
        header.softmax_scale = scale
    lse_shape = (batch, heads) if return_lse else None
    out_span, lse_span = _place_outputs(
        header, (wq, wk, wv), placement, out, _nbytes(wq.shape, wq.dtype),
        _nbytes(lse_shape, pb.FLOAT32) if lse_shape else 0,
    )
    return PreparedRequest(
        method=DECODE, header=_checked_header(header), tensors=(wq, wk, wv),
        out_shape=wq.shape, out_dtype=wq.dtype, lse_shape=lse_shape, origin=origin,
        user_shape=wq.shape, lse_fix=_same, placement=placement, out_span=out_span,
        lse_span=lse_span, user_out=out,
    )
