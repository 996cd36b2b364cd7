"""Decode-shaped requests (a ``DecodeHeader``): Decode and CacheDecode, one query token per
sequence (q ``[B, H, D]``, lse ``[B, H]``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from attention_client._errors import AttentionInputError
from attention_client._layouts import CacheTarget, check_layout, count_check, new_kv
from attention_client._regions import Placement
from attention_client._requests import (
    CACHE_DECODE,
    DECODE,
    KvScales,
    PreparedRequest,
    ScoreMods,
    Tensor,
    as_flag,
    encode_qkv,
    finish_request,
    require_rank,
    same_lse,
    spec,
    tensor_of,
)
from attention_client._tensors import as_cu_seqlens
from attention_wire.pb import attention_pb2 as pb


def _decode_request(
    method: str, wq: Tensor, wk: Tensor, wv: Tensor, cu_k: np.ndarray, like: Any, *,
    softmax_scale: float | None, num_splits: int, return_lse: bool,
    placement: Placement | None = None, out: Any = None, cache: CacheTarget | None = None,
    score: ScoreMods | None = None, kv_scales: KvScales | None = None,
) -> PreparedRequest:
    batch, heads = wq.shape[0], wq.shape[1]
    splits = (int(num_splits) if isinstance(num_splits, int | np.integer)
              and not isinstance(num_splits, bool) else -1)
    if not 0 <= splits <= np.iinfo(np.int32).max:
        raise AttentionInputError(f"num_splits must be an int >= 0, got {num_splits!r}")
    header = pb.DecodeHeader(
        q=spec(wq),
        k=spec(wk),
        v=spec(wv),
        cu_seqlens_k=cu_k.tolist(),
        num_splits=splits,
        return_lse=as_flag(return_lse, "return_lse"),
    )
    lse_shape = (batch, heads) if return_lse else None
    return finish_request(
        method, header, wq, wk, wv, like, batch, lse_shape, wq.shape, same_lse,
        softmax_scale=softmax_scale, placement=placement, out=out, cache=cache, score=score,
        kv_scales=kv_scales,
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
    score: ScoreMods | None = None,
    kv_scales: KvScales | None = None,
) -> PreparedRequest:
    wq, wk, wv = encode_qkv(q, k, v, placement, fp8_queries=True)
    require_rank(wq, 3, "[B, H, D]")
    for t in (wk, wv):
        require_rank(t, 3, "packed [total_k, H_kv, D]")
    if cu_seqlens_k is None:
        raise AttentionInputError("cu_seqlens_k is required for decode")
    cu_k = as_cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
    batch = wq.shape[0]
    if cu_k.size != batch + 1:
        raise AttentionInputError(
            f"cu_seqlens_k must have batch+1 = {batch + 1} entries (q has batch {batch}), "
            f"got {cu_k.size}"
        )
    return _decode_request(
        DECODE, wq, wk, wv, cu_k, q, softmax_scale=softmax_scale, num_splits=num_splits,
        return_lse=return_lse, placement=placement, out=out, score=score, kv_scales=kv_scales,
    )


def prepare_cache_decode(
    q: Any,
    k_new: Any,
    v_new: Any,
    target: CacheTarget,
    *,
    softmax_scale: float | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    score: ScoreMods | None = None,
    placement: Placement | None = None,
    out: Any = None,
) -> PreparedRequest:
    """CacheDecode: q ``[B, H, D]``, one cache per sequence, k_new/v_new ``[B, H_kv, D]`` (one
    new token per sequence, appended before attending) or None (none). ``placement``: q and
    the new tokens may go through registered regions, and so may the outputs (``out=``), as
    in a stateless decode."""
    empty = new_kv(k_new, v_new, ("k_new", "v_new"), target)
    if empty is None:
        wq, wk, wv = encode_qkv(q, k_new, v_new, placement, names=("q", "k_new", "v_new"))
    else:
        wq, (wk, wv) = tensor_of(q, "q", placement), empty
    require_rank(wq, 3, "[B, H, D]")
    for t in (wk, wv):
        require_rank(t, 3, "[B, H_kv, D] (one new token per sequence)")
    batch = wq.shape[0]
    count_check(batch, target, "q")
    if wk.shape[0] not in (0, batch):
        raise AttentionInputError(
            f"{wk.name} must hold one new token per sequence, [{batch}, H_kv, D], "
            f"got shape {wk.shape}"
        )
    check_layout(target, wq, wk, wv)
    # Empty cu_seqlens_k: one new token per sequence (or none when k has no rows).
    return _decode_request(
        CACHE_DECODE, wq, wk, wv, np.empty(0, np.int32), q, softmax_scale=softmax_scale,
        num_splits=num_splits, return_lse=return_lse, cache=target, score=score,
        placement=placement, out=out,
    )
