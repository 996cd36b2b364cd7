"""What a validated request is, in plain Python: the leaf that front end and engine share.

Front-end processes never import torch, so dtypes here are wire enums (``pb.DType`` values)
and shapes are tuples; the engine maps them to torch types. ``Params`` is immutable and
pickles small (it crosses from a front-end process to the engine with every call).
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_service.errors import invalid
from attention_wire.pb import attention_pb2 as pb

MAX_CACHE_ID_BYTES = 256
ELEMENT_BYTES: dict[int, int] = {
    pb.FLOAT16: 2, pb.BFLOAT16: 2, pb.FLOAT32: 4, pb.FLOAT8_E4M3: 1,
}
# Queries (and outputs) take these; keys and values also FLOAT8_E4M3 beside a 16-bit query.
QUERY_DTYPES = (pb.FLOAT16, pb.BFLOAT16, pb.FLOAT32)
FP8_QUERY_DTYPES = (pb.FLOAT16, pb.BFLOAT16)


def kv_dtype_allowed(dtype: int, kv_dtype: int) -> bool:
    """Keys and values in ``kv_dtype`` beside queries in ``dtype``: the same, or FLOAT8_E4M3
    beside FLOAT16/BFLOAT16 (the kernels' rule)."""
    return kv_dtype == dtype or (kv_dtype == pb.FLOAT8_E4M3 and dtype in FP8_QUERY_DTYPES)

# Per-kv-head dequantization scales of FP8 keys and values: (k scales, v scales).
KvScales = tuple[tuple[float, ...], tuple[float, ...]]
INPUTS = ("q", "k", "v")
OUTPUTS = ("out", "lse")
LSE_BYTES = 4  # float32


class Op(enum.Enum):
    """The compute rpcs. The per-kind rules live on this class, not in string switches."""

    PREFILL = "Prefill"
    DECODE = "Decode"
    APPEND_KV = "AppendKV"  # a cache prefill without queries: k/v stored, nothing computed
    CACHE_PREFILL = "CachePrefill"
    CACHE_DECODE = "CacheDecode"

    # Members are singletons: identity hashing is exact, and a C-level hash where Enum's own
    # is a Python call (hashed several times per request on the engine's hot path).
    __hash__ = object.__hash__

    @property
    def rpc(self) -> str:
        return self.value

    @property
    def decode_like(self) -> bool:
        """One query per sequence, DecodeHeader on the wire, lse ``[batch, H]``."""
        return self is Op.DECODE or self is Op.CACHE_DECODE

    @property
    def cached(self) -> bool:
        """Runs against server-side KV caches (its k/v are the sequences' new tokens)."""
        return self in _CACHED

    def lse_shape(self, rows: int, heads: int) -> tuple[int, int]:
        """The kernels' lse layout: prefill ``[H, total_q]``, decode ``[batch, H]``."""
        return (rows, heads) if self.decode_like else (heads, rows)

    def lse_rows(self, lse: Any, start: int, stop: int) -> Any:
        """Query rows ``start:stop`` of an lse in this op's layout (columns for prefill)."""
        return lse[start:stop] if self.decode_like else lse[:, start:stop]


_CACHED = frozenset((Op.APPEND_KV, Op.CACHE_PREFILL, Op.CACHE_DECODE))


@dataclass(frozen=True)
class RegionSpan:
    """Bytes of a tensor inside a registered shared-memory region (same-host zero copy)."""

    region: str
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class Params:
    """A validated request: shapes, sequence boundaries and kernel parameters."""

    op: Op
    dtype: int  # pb.DType
    q_shape: tuple[int, int, int]  # prefill [total_q, H, D]; decode [batch, H, D]
    k_shape: tuple[int, int, int]  # [total_k, H_kv, D]
    cu_seqlens_q: tuple[int, ...] | None  # prefill only
    cu_seqlens_k: tuple[int, ...]
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    softmax_scale: float | None
    return_lse: bool
    num_splits: int  # decode only (0 = the server's choice)
    flops: int  # this request's floating-point operations (causal work counted once)
    # Cached ops: one cache per sequence, and whether the new k/v tokens are kept. Their k/v
    # hold only new tokens, so ``flops`` above counts only those; the engine, which knows the
    # cached lengths, computes the real work.
    cache_ids: tuple[str, ...] = ()
    store: bool = False
    # flash_attn's score modifiers (ScoreOptions): window (left, right), -1 unbounded; softcap
    # 0 off; ALiBi slopes flat, num_heads or batch * num_heads of them, () off.
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: tuple[float, ...] = ()
    # The wire dtype of k and v (``dtype`` or FLOAT8_E4M3), and the scales of FP8 k/v on a
    # stateless op (cached ops use their caches' scales, which the engine knows).
    kv_dtype: int = 0
    kv_scales: KvScales | None = None

    @functools.cached_property
    def memo(self) -> dict[object, object]:
        """Scratch for values the engine derives from these (immutable) params and reuses on
        every request that carries the same params object (front ends define them once)."""
        return {}

    @property
    def num_heads(self) -> int:
        return self.q_shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_shape[1]

    @property
    def head_dim(self) -> int:
        return self.q_shape[2]

    @property
    def rows(self) -> int:
        """Query rows: tokens for prefill, sequences for decode."""
        return self.q_shape[0]

    @property
    def total_k(self) -> int:
        return self.k_shape[0]

    # The next three are read per request on the engine's hot path (the batch queue, the
    # plan): computed once per Params object (frozen), as ``memo``.
    @functools.cached_property
    def tokens(self) -> int:
        """The batch-token unit: keys for decode, queries for prefill (new keys for AppendKV)."""
        if self.op.decode_like or self.op is Op.APPEND_KV:
            return self.k_shape[0]
        return self.q_shape[0]

    @functools.cached_property
    def budget_tokens(self) -> int:
        """Weight against the batching token budget: keys for decode; for prefill the larger of
        queries and keys, so a few queries over a long cached prefix still count as large."""
        if self.op.decode_like:
            return self.k_shape[0]
        return max(self.q_shape[0], self.k_shape[0])

    @property
    def lse_shape(self) -> tuple[int, int] | None:
        """Prefill ``[H, total_q]``; decode ``[batch, H]``; None unless asked for."""
        if not self.return_lse:
            return None
        return self.op.lse_shape(self.q_shape[0], self.q_shape[1])

    def shape(self, name: str) -> tuple[int, ...]:
        if name in ("q", "out"):
            return self.q_shape
        if name in ("k", "v"):
            return self.k_shape
        lse = self.lse_shape
        if name != "lse" or lse is None:
            raise KeyError(name)
        return lse

    def wire_dtype(self, name: str) -> int:
        """The pb.DType of tensor ``name`` (q, k, v, out): k and v may be FP8."""
        return self.kv_dtype if name in ("k", "v") else self.dtype

    def nbytes(self, name: str) -> int:
        """Bytes of tensor ``name`` (q, k, v, out, lse); 0 for an lse not asked for."""
        if name == "lse":
            lse = self.lse_shape
            return math.prod(lse) * LSE_BYTES if lse else 0
        return math.prod(self.shape(name)) * ELEMENT_BYTES[self.wire_dtype(name)]

    @property
    def bytes_in(self) -> int:
        return sum(self.nbytes(n) for n in INPUTS)

    @functools.cached_property
    def kv_bytes(self) -> int:
        return self.nbytes("k") + self.nbytes("v")


def check_cache_ids(ids: Sequence[str], field: str) -> tuple[str, ...]:
    """Cache ids as the server accepts them: 1-256 bytes of UTF-8 each, none twice."""
    seen: set[str] = set()
    for i, cid in enumerate(ids):
        size = len(cid.encode())
        if not 1 <= size <= MAX_CACHE_ID_BYTES:
            raise invalid(f"{field}[{i}]", f"{size} bytes; ids take 1-{MAX_CACHE_ID_BYTES}")
        if cid in seen:
            raise invalid(f"{field}[{i}]", f"{cid!r} appears twice")
        seen.add(cid)
    return tuple(ids)


def check_kv_scales(msg: pb.KvScales, num_kv_heads: int, field: str) -> KvScales:
    """A KvScales message as the kernels take it: num_kv_heads finite positive floats for
    keys and for values; INVALID_ARGUMENT naming the entry otherwise."""
    out = []
    for part in ("k", "v"):
        values = tuple(float(x) for x in getattr(msg, part))
        if len(values) != num_kv_heads:
            raise invalid(f"{field}.{part}", f"{len(values)} scales for {num_kv_heads} kv "
                          "heads: give one per kv head")
        bad = next((i for i, x in enumerate(values) if not (math.isfinite(x) and x > 0)), None)
        if bad is not None:
            raise invalid(f"{field}.{part}[{bad}]", f"must be finite and > 0, got {values[bad]}")
        out.append(values)
    return out[0], out[1]


def lengths(cu: Sequence[int]) -> list[int]:
    return [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]


def causal_pairs(seqlen_q: int, seqlen_k: int) -> int:
    """Visible (query, key) pairs under the bottom-right causal mask.

    Query i sees keys j <= i + seqlen_k - seqlen_q, i.e. max(0, i + seqlen_k - seqlen_q + 1)
    keys (never more than seqlen_k): a sum of consecutive integers ending at seqlen_k.
    """
    a = seqlen_k - seqlen_q + 1
    first_i = max(0, 1 - a)
    count = seqlen_q - first_i
    if count <= 0:
        return 0
    return (first_i + a + seqlen_k) * count // 2


def make_params(
    op: Op, dtype: int, q_shape: tuple[int, int, int], k_shape: tuple[int, int, int],
    cu_seqlens_k: Sequence[int], cu_seqlens_q: Sequence[int] | None = None, *,
    causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False,
    num_splits: int = 0, cache_ids: Sequence[str] = (), store: bool = False,
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: Sequence[float] = (), kv_dtype: int = 0, kv_scales: KvScales | None = None,
) -> Params:
    """Params with the derived fields (max lengths, FLOPs) computed; inputs already checked.
    For cached ops the lengths and FLOPs count only the request's new tokens. ``kv_dtype`` 0
    means ``dtype``."""
    heads, dim = q_shape[1], q_shape[2]
    len_k = lengths(cu_seqlens_k)
    if not op.decode_like:
        assert cu_seqlens_q is not None
        len_q = lengths(cu_seqlens_q)
        max_q = max(len_q, default=0)
    else:
        cu_seqlens_q, causal, max_q = None, False, 1
        len_q = [1] * len(len_k)
    pairs = visible_pairs(len_q, len_k, causal, window)
    return Params(
        op=op, dtype=dtype, q_shape=tuple(q_shape), k_shape=tuple(k_shape),  # type: ignore[arg-type]
        cu_seqlens_q=tuple(cu_seqlens_q) if cu_seqlens_q is not None else None,
        cu_seqlens_k=tuple(cu_seqlens_k), max_seqlen_q=max_q, max_seqlen_k=max(len_k, default=0),
        causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
        num_splits=num_splits if op.decode_like else 0, flops=4 * pairs * heads * dim,
        cache_ids=tuple(cache_ids), store=store or op is Op.APPEND_KV,
        window=(int(window[0]), int(window[1])), softcap=float(softcap),
        alibi_slopes=tuple(float(x) for x in alibi_slopes), kv_dtype=kv_dtype or dtype,
        kv_scales=kv_scales,
    )


def visible_pairs(
    len_q: Sequence[int], len_k: Sequence[int], causal: bool, window: tuple[int, int] = (-1, -1)
) -> int:
    """(query, key) pairs that the masks leave visible, summed over sequences: the work of a
    request. Query i of a sequence sits at key position p = i + len_k - len_q and sees keys
    max(0, p - left) .. min(len_k - 1, p + right), with right 0 when causal; -1 is unbounded."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left < 0 and right < 0:
        return sum(sq * sk for sq, sk in zip(len_q, len_k, strict=True))
    if left < 0 and right == 0:
        return sum(causal_pairs(sq, sk) for sq, sk in zip(len_q, len_k, strict=True))
    sq = np.asarray(len_q, dtype=np.int64)
    sk = np.repeat(np.asarray(len_k, dtype=np.int64), sq)
    starts = np.repeat(np.cumsum(sq) - sq, sq)
    p = np.arange(int(sq.sum()), dtype=np.int64) - starts + sk - np.repeat(sq, sq)
    lo = np.maximum(0, p - left) if left >= 0 else np.zeros_like(p)
    hi = np.minimum(sk - 1, p + right) if right >= 0 else sk - 1
    return int(np.clip(hi - lo + 1, 0, None).sum())
