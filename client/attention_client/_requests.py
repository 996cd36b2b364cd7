"""Turn user arguments into a validated request: header bytes, tensors, and the expected outputs.

Client-side checks only catch the obvious (rank, dtype, matching shapes): the server is the
authority on everything else (head dims, cu_seqlens values, limits) and answers
INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_client._tensors import Origin, WireTensor, as_cu_seqlens, to_user, to_wire
from attention_wire.pb import attention_pb2 as pb

PREFILL = "Prefill"
DECODE = "Decode"

# gRPC's default receive limit is 4 MiB; every message we send stays below this, header included.
MAX_HEADER_BYTES = 3 * 1024 * 1024 + 512 * 1024


@dataclass
class PreparedRequest:
    """Everything needed to send one call and to rebuild its result."""

    method: str  # PREFILL | DECODE
    header: bytes  # serialized PrefillHeader / DecodeHeader
    tensors: tuple[WireTensor, WireTensor, WireTensor]  # q, k, v in wire layout
    out_shape: tuple[int, ...]  # OUT as the server sends it
    out_dtype: int  # pb.DType of OUT (q's)
    lse_shape: tuple[int, ...] | None  # LSE as the server sends it, None if not requested
    finish: Callable[[np.ndarray, np.ndarray | None], Any]  # storage arrays -> user result


def _encode_qkv(q: Any, k: Any, v: Any) -> tuple[WireTensor, WireTensor, WireTensor, Origin]:
    wq, origin = to_wire(q, "q")
    wk, _ = to_wire(k, "k")
    wv, _ = to_wire(v, "v")
    if not wq.dtype == wk.dtype == wv.dtype:
        names = ", ".join(pb.DType.Name(t.dtype) for t in (wq, wk, wv))
        raise ValueError(f"q, k, v must share one dtype, got {names}")
    if wk.shape != wv.shape:
        raise ValueError(f"v shape {wv.shape} differs from k shape {wk.shape}")
    return wq, wk, wv, origin


def _require_rank(t: WireTensor, rank: int, layout: str) -> None:
    if len(t.shape) != rank:
        raise ValueError(f"{t.name} must be {rank}-D {layout}, got shape {t.shape}")


def _spec(t: WireTensor) -> pb.TensorSpec:
    return pb.TensorSpec(dtype=t.dtype, shape=t.shape)


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


def _finisher(
    origin: Origin, out_shape: tuple[int, ...], lse_fix: Callable[[np.ndarray], np.ndarray]
) -> Callable[[np.ndarray, np.ndarray | None], Any]:
    def finish(out: np.ndarray, lse: np.ndarray | None) -> Any:
        result = to_user(out.reshape(out_shape), origin)
        if lse is None:
            return result
        return result, to_user(lse_fix(lse), origin, is_lse=True)

    return finish


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
) -> PreparedRequest:
    wq, wk, wv, origin = _encode_qkv(q, k, v)
    user_shape = wq.shape
    lse_fix: Callable[[np.ndarray], np.ndarray] = lambda lse: lse
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
            # The server's lse is [H, B*N]; callers of the 4-D form want [B, H, N].
            lse_fix = lambda lse: np.ascontiguousarray(
                lse.reshape(heads, batch, n_q).transpose(1, 0, 2)
            )
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
    return PreparedRequest(
        method=PREFILL,
        header=_checked_header(header),
        tensors=(wq, wk, wv),
        out_shape=wq.shape,
        out_dtype=wq.dtype,
        lse_shape=(heads, total_q) if return_lse else None,
        finish=_finisher(origin, user_shape, lse_fix),
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
) -> PreparedRequest:
    wq, wk, wv, origin = _encode_qkv(q, k, v)
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
    return PreparedRequest(
        method=DECODE,
        header=_checked_header(header),
        tensors=(wq, wk, wv),
        out_shape=wq.shape,
        out_dtype=wq.dtype,
        lse_shape=(batch, heads) if return_lse else None,
        finish=_finisher(origin, wq.shape, lambda lse: lse),
    )
