"""Prefill-shaped requests (a ``PrefillHeader``): Prefill, CachePrefill and AppendKV.

Prefill takes three forms (one sequence ``[N, H, D]``, a dense batch ``[B, N, H, D]``, packed
varlen with ``cu_seqlens``), all sent packed; the lse comes back ``[H, total_q]`` and is
turned batch-major for the dense form. The cache ops name one cache per sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from attention_client._errors import AttentionInputError
from attention_client._layouts import (
    CacheTarget,
    check_cu_values,
    check_layout,
    count_check,
    new_kv,
)
from attention_client._regions import Placement
from attention_client._requests import (
    APPEND_KV,
    CACHE_PREFILL,
    PREFILL,
    KvScales,
    PreparedRequest,
    ScoreMods,
    Tensor,
    as_flag,
    checked_header,
    encode_qkv,
    finish_request,
    place_tensors,
    require_rank,
    same_lse,
    spec,
    tensor_of,
)
from attention_client._tensors import (
    WireTensor,
    as_cu_seqlens,
    describe,
    storage_dtype,
)
from attention_wire.pb import attention_pb2 as pb


def _batch_major(lse: Any, heads: int, batch: int, n_q: int) -> Any:
    """The server's prefill lse [H, B*N] as the 4-D form's callers want it: [B, H, N]."""
    x = lse.reshape(heads, batch, n_q)
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x.transpose(1, 0, 2))
    return x.permute(1, 0, 2).contiguous()  # a torch tensor (a CUDA region's lse)


def _prefill_form(
    wq: Tensor, wk: Tensor, wv: Tensor, cu_seqlens: Any, cu_seqlens_k: Any
) -> tuple[Tensor, Tensor, Tensor, np.ndarray, np.ndarray, tuple[int, ...], Callable[[Any], Any]]:
    """The three prefill forms (one sequence, a dense batch, packed varlen) -> packed q, k, v,
    cu_seqlens_q, cu_seqlens_k (empty: the server uses cu_seqlens_q), out's shape as the caller
    sees it, and the lse layout fix."""
    user_shape = wq.shape
    lse_fix: Callable[[Any], Any] = same_lse
    if cu_seqlens is None:
        if cu_seqlens_k is not None:
            raise AttentionInputError("cu_seqlens_k needs cu_seqlens (the query boundaries) too")
        if len(wq.shape) == 3:  # one sequence
            for t in (wk, wv):
                require_rank(t, 3, "[N_k, H_kv, D] (q is 3-D)")
            cu_q = np.array([0, wq.shape[0]], np.int32)
            cu_k = np.array([0, wk.shape[0]], np.int32)
        elif len(wq.shape) == 4:  # a batch of equal-length sequences
            for t in (wk, wv):
                require_rank(t, 4, "[B, N_k, H_kv, D] (q is 4-D)")
            batch, n_q, heads = wq.shape[0], wq.shape[1], wq.shape[2]
            if wk.shape[0] != batch:
                raise AttentionInputError(f"k batch {wk.shape[0]} differs from q batch {batch}")
            n_k = wk.shape[1]
            cu_q = np.arange(batch + 1, dtype=np.int64) * n_q
            cu_k = np.arange(batch + 1, dtype=np.int64) * n_k
            if cu_q[-1] > np.iinfo(np.int32).max or cu_k[-1] > np.iinfo(np.int32).max:
                raise AttentionInputError("q or k has more than 2**31 - 1 tokens")
            cu_q, cu_k = cu_q.astype(np.int32), cu_k.astype(np.int32)
            wq = wq.reshaped((batch * n_q, *wq.shape[2:]))
            wk = wk.reshaped((batch * n_k, *wk.shape[2:]))
            wv = wv.reshaped((batch * n_k, *wv.shape[2:]))
            lse_fix = functools.partial(_batch_major, heads=heads, batch=batch, n_q=n_q)
        else:
            raise AttentionInputError(
                f"q must be 3-D [N, H, D] or 4-D [B, N, H, D], got shape {wq.shape}"
            )
    else:
        for t in (wq, wk, wv):
            require_rank(t, 3, "packed [total, H, D] (cu_seqlens given)")
        cu_q = as_cu_seqlens(cu_seqlens, "cu_seqlens")
        cu_k = (
            as_cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
            if cu_seqlens_k is not None
            else np.empty(0, np.int32)  # empty: the server uses cu_seqlens_q
        )
        if cu_k.size and cu_k.size != cu_q.size:
            raise AttentionInputError(
                f"cu_seqlens has {cu_q.size - 1} sequences but cu_seqlens_k has {cu_k.size - 1}"
            )
    return wq, wk, wv, cu_q, cu_k, user_shape, lse_fix


def _prefill_request(
    method: str, wq: Tensor, wk: Tensor, wv: Tensor, cu_q: np.ndarray, cu_k: np.ndarray,
    user_shape: tuple[int, ...], lse_fix: Callable[[Any], Any], like: Any, *,
    causal: bool, softmax_scale: float | None, return_lse: bool,
    placement: Placement | None = None, out: Any = None, cache: CacheTarget | None = None,
    score: ScoreMods | None = None, kv_scales: KvScales | None = None,
) -> PreparedRequest:
    header = pb.PrefillHeader(
        q=spec(wq),
        k=spec(wk),
        v=spec(wv),
        cu_seqlens_q=cu_q.tolist(),
        cu_seqlens_k=cu_k.tolist(),
        causal=as_flag(causal, "causal"),
        return_lse=as_flag(return_lse, "return_lse"),
    )
    lse_shape = (wq.shape[1], wq.shape[0]) if return_lse else None  # [H, total_q]
    return finish_request(
        method, header, wq, wk, wv, like, cu_q.size - 1, lse_shape, user_shape, lse_fix,
        softmax_scale=softmax_scale, placement=placement, out=out, cache=cache, score=score,
        kv_scales=kv_scales,
    )


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
    score: ScoreMods | None = None,
    kv_scales: KvScales | None = None,
) -> PreparedRequest:
    wq, wk, wv = encode_qkv(q, k, v, placement, fp8_queries=True)
    form = _prefill_form(wq, wk, wv, cu_seqlens, cu_seqlens_k)
    return _prefill_request(
        PREFILL, *form, q, causal=causal, softmax_scale=softmax_scale,
        return_lse=return_lse, placement=placement, out=out, score=score, kv_scales=kv_scales,
    )


def prepare_append_kv(k: Any, v: Any, cu_seqlens: Any, target: CacheTarget,
                      placement: Placement | None = None) -> PreparedRequest:
    """AppendKV: k, v ``[total, H_kv, D]`` split by ``cu_seqlens`` over ``target.ids`` (None:
    one cache gets all rows). The result is the caches' lengths. ``placement``: k and v may
    go through registered regions."""
    _, wk, wv = encode_qkv(None, k, v, placement, names=("q", "k", "v"))
    for t in (wk, wv):
        require_rank(t, 3, "[total, H_kv, D]")
    if cu_seqlens is None:
        if len(target.ids) != 1:
            raise AttentionInputError(
                f"cu_seqlens is required with {len(target.ids)} cache ids (one sequence each)"
            )
        cu_k = np.array([0, wk.shape[0]], np.int32)
    else:
        cu_k = as_cu_seqlens(cu_seqlens, "cu_seqlens")
        count_check(cu_k.size - 1, target, "cu_seqlens")
    check_cu_values(cu_k, wk.shape[0], "cu_seqlens", "k")
    check_layout(target, None, wk, wv)
    header = pb.PrefillHeader(
        k=spec(wk), v=spec(wv), cu_seqlens_k=cu_k.tolist(), cache=target.message()
    )
    no_q = WireTensor("q", np.empty(0, storage_dtype(wk.dtype)), wk.dtype)
    place_tensors(header, (no_q, wk, wv), placement, None, 0, 0, ())
    return PreparedRequest(
        method=APPEND_KV, header=checked_header(header), tensors=(no_q, wk, wv),
        out_shape=None, out_dtype=wk.dtype, lse_shape=None, result_dtype=None,
        result_device=None, user_shape=(),  # no output: the result is the caches' lengths
        lse_fix=same_lse, placement=placement, cache=target,
    )


def prepare_cache_prefill(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    target: CacheTarget,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    score: ScoreMods | None = None,
    placement: Placement | None = None,
    out: Any = None,
) -> PreparedRequest:
    """CachePrefill: the forms of ``prepare_prefill``, with k/v the new tokens (None: none;
    0 rows and no ``cu_seqlens_k``: none either) and one cache per sequence. ``placement``:
    q, the new tokens and the outputs (``out=``) may go through registered regions, as in a
    stateless prefill."""
    q_shape, _ = describe(q, "q")
    lead = (q_shape[0], 0) if len(q_shape) == 4 and cu_seqlens_q is None else (0,)
    empty = new_kv(k, v, ("k", "v"), target, lead)
    if empty is None:
        wq, wk, wv = encode_qkv(q, k, v, placement)
    else:
        wq, (wk, wv) = tensor_of(q, "q", placement), empty
    check_layout(target, wq, wk, wv)
    wq, wk, wv, cu_q, cu_k, user_shape, lse_fix = _prefill_form(
        wq, wk, wv, cu_seqlens_q, cu_seqlens_k
    )
    if not wq.shape[0]:  # refused before a handle creates the caches it names
        raise AttentionInputError("q has no tokens: a cache prefill needs at least one query "
                                  "(cache.append stores keys and values alone)")
    if not cu_k.size:  # sent explicitly: empty would mean cu_seqlens_q even without keys
        if wk.shape[0] == 0:
            cu_k = np.zeros_like(cu_q)
        elif wk.shape[0] == wq.shape[0]:
            cu_k = cu_q
        else:
            raise AttentionInputError(
                f"cu_seqlens_k is needed: k has {wk.shape[0]} new rows, q {wq.shape[0]}"
            )
    count_check(cu_q.size - 1, target, "q")
    check_cu_values(cu_q, wq.shape[0], "cu_seqlens_q", "q")
    check_cu_values(cu_k, wk.shape[0], "cu_seqlens_k", "k")
    return _prefill_request(
        CACHE_PREFILL, wq, wk, wv, cu_q, cu_k, user_shape, lse_fix, q, causal=causal,
        softmax_scale=softmax_scale, return_lse=return_lse, placement=placement, out=out,
        cache=target, score=score,
    )
