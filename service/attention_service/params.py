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
from attention_wire.messages import out_dtype
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
    """The compute rpcs. Each kind's rules live on its member, not in switches on the kind:
    whether it takes one query per sequence (its wire header and lse layout follow), whether
    it runs against server-side caches, and which kernel serves it (None: AppendKV, which
    only stores k/v). Plain attributes: read per request on the engine's hot path."""

    # (rpc, decode_like, cached, kernel, steps_rpc)
    PREFILL = ("Prefill", False, False, "prefill", "PrefillSteps")
    DECODE = ("Decode", True, False, "decode", "DecodeSteps")
    APPEND_KV = ("AppendKV", False, True, None, None)
    CACHE_PREFILL = ("CachePrefill", False, True, "paged_prefill", None)
    CACHE_DECODE = ("CacheDecode", True, True, "paged_decode", "CacheDecodeSteps")

    def __new__(cls, rpc: str, decode_like: bool, cached: bool, kernel: str | None,
                steps_rpc: str | None) -> Op:
        op = object.__new__(cls)
        op._value_ = rpc
        op.rpc = rpc
        # Its step stream, if it has one: each request message one whole call, each response
        # message its AttentionResult.
        op.steps_rpc = steps_rpc
        # One query per sequence, DecodeHeader on the wire, lse ``[batch, H]``.
        op.decode_like = decode_like
        # Runs against server-side KV caches (its k/v are the sequences' new tokens).
        op.cached = cached
        # The ``attention_kernels`` function that serves it, and whether it takes queries
        # and computes attention at all (AppendKV: no q, no outputs, no kernel).
        op.kernel = kernel
        op.queries = kernel is not None
        # Takes FLOAT8_E4M3 queries (with KvScales.q): the stateless ops, whose request
        # carries its scales (a cached op's come from its caches' layout, with no query's).
        op.fp8_queries = kernel in ("prefill", "decode")
        op.header = pb.DecodeHeader if decode_like else pb.PrefillHeader
        return op

    # Members are singletons: identity hashing is exact, and a C-level hash where Enum's own
    # is a Python call (hashed several times per request on the engine's hot path).
    __hash__ = object.__hash__

    def lse_shape(self, rows: int, heads: int) -> tuple[int, int]:
        """The kernels' lse layout: prefill ``[H, total_q]``, decode ``[batch, H]``."""
        return (rows, heads) if self.decode_like else (heads, rows)

    def lse_rows(self, lse: Any, start: int, stop: int) -> Any:
        """Query rows ``start:stop`` of an lse in this op's layout (columns for prefill)."""
        return lse[start:stop] if self.decode_like else lse[:, start:stop]


@dataclass(frozen=True)
class RegionSpan:
    """Bytes of a tensor inside a registered shared-memory region (same-host zero copy)."""

    region: str
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


# What a merged launch shares: ``Params.key``, a tuple of the params' own fields.
BatchKey = tuple[object, ...]


@dataclass(frozen=True)
class Params:
    """A validated request, described once: what a merged launch shares (``key``: the op, the
    kernel's parameters, the tensors' row layout) and what is its own (row counts, sequence
    boundaries, outputs asked for, caches, per-sequence scales and slopes). Everything else is
    derived from these, once per object where it is read per request (cached properties)."""

    op: Op
    dtype: int  # pb.DType of q, and of out but for FLOAT8_E4M3 queries (``out_dtype``)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool  # False for decode
    # None (the default 1/sqrt(D)) and an explicit 1/sqrt(D) are the same float in the
    # kernel: stored resolved, so they merge.
    softmax_scale: float
    num_splits: int  # decode only (0 = the server's choice); kept so an explicit one is honoured
    window: tuple[int, int]  # (left, right), -1 unbounded
    softcap: float  # 0 off
    # The wire dtype of k and v: q's dtype, or FLOAT8_E4M3 (then ``kv_scales`` on a stateless
    # op; cached ops use their caches' scales, which the engine knows).
    kv_dtype: int
    rows: int  # query rows: tokens for prefill, sequences for decode
    total_k: int  # key rows (cached ops: the new tokens only)
    cu_seqlens_q: tuple[int, ...] | None  # prefill only
    cu_seqlens_k: tuple[int, ...]
    max_seqlen_q: int
    max_seqlen_k: int
    return_lse: bool
    flops: int  # this request's floating-point operations (causal work counted once)
    # Cached ops: one cache per sequence, and whether the new k/v tokens are kept. Their k/v
    # hold only new tokens, so ``flops`` above counts only those; the engine, which knows the
    # cached lengths, computes the real work.
    cache_ids: tuple[str, ...] = ()
    store: bool = False
    # ALiBi slopes flat, num_heads or batch * num_heads of them, () off.
    alibi_slopes: tuple[float, ...] = ()
    # The scales of FP8 k/v on a stateless op: num_kv_heads each, or a row of them per
    # sequence (``sequence_scales``).
    kv_scales: KvScales | None = None

    @functools.cached_property
    def key(self) -> BatchKey:
        """What every request of one merged launch shares: requests with equal keys run the
        same kernel with the same parameters, so they can merge. The fields above up to
        ``kv_dtype``, then whether ALiBi is on (slopes are per sequence in the launch, so any
        two ALiBi requests merge) and, last (``key_with_fp8``), whether the kernel reads FP8
        keys and values (scales are per sequence in the launch too). A tuple, made once per
        object: hashed per request on the engine's hot path."""
        return (self.op, self.dtype, self.num_heads, self.num_kv_heads, self.head_dim,
                self.causal, self.softmax_scale, self.num_splits, self.window, self.softcap,
                self.kv_dtype, bool(self.alibi_slopes), self.kv_scales is not None)

    @property
    def q_shape(self) -> tuple[int, int, int]:
        """prefill ``[total_q, H, D]``; decode ``[batch, H, D]``."""
        return (self.rows, self.num_heads, self.head_dim)

    @property
    def k_shape(self) -> tuple[int, int, int]:
        return (self.total_k, self.num_kv_heads, self.head_dim)

    @functools.cached_property
    def sequence_scales(self) -> tuple[KvScales, ...]:
        """Each sequence's FP8 (k, v) scales, ``num_kv_heads`` each (``kv_scales`` must be
        set): the shared ones repeated, or the request's own rows. Once per Params (a
        stateless call's own), when the plan of its launch asks."""
        assert self.kv_scales is not None
        k, v = self.kv_scales
        h, n = self.num_kv_heads, len(self.cu_seqlens_k) - 1
        if len(k) == h:
            return ((k, v),) * n
        return tuple((k[i * h:(i + 1) * h], v[i * h:(i + 1) * h]) for i in range(n))

    @functools.cached_property
    def new_keys(self) -> list[int]:
        """Each sequence's keys in this request (``cu_seqlens_k``'s steps; a cached op's new
        tokens): read, never changed, by every cached call carrying these params."""
        return lengths(self.cu_seqlens_k)

    @functools.cached_property
    def memo(self) -> dict[object, object]:
        """Scratch for values the engine derives from these (immutable) params and reuses on
        every request that carries the same params object (front ends define them once)."""
        return {}

    # The next three are read per request on the engine's hot path (the batch queue, the
    # plan): computed once per Params object (frozen), as ``memo``.
    @functools.cached_property
    def tokens(self) -> int:
        """The batch-token unit: keys for decode, queries for prefill (new keys for AppendKV)."""
        if self.op.decode_like or not self.op.queries:
            return self.total_k
        return self.rows

    @functools.cached_property
    def budget_tokens(self) -> int:
        """Weight against the batching token budget: keys for decode; for prefill the larger of
        queries and keys, so a few queries over a long cached prefix still count as large."""
        if self.op.decode_like:
            return self.total_k
        return max(self.rows, self.total_k)

    @property
    def lse_shape(self) -> tuple[int, int] | None:
        """Prefill ``[H, total_q]``; decode ``[batch, H]``; None unless asked for."""
        if not self.return_lse:
            return None
        return self.op.lse_shape(self.rows, self.num_heads)

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
        """The pb.DType of tensor ``name`` (q, k, v, out): k and v may be FP8, and q too
        (Prefill or Decode: out is then BFLOAT16)."""
        if name in ("k", "v"):
            return self.kv_dtype
        return out_dtype(self.dtype) if name == "out" else self.dtype

    def nbytes(self, name: str) -> int:
        """Bytes of tensor ``name`` (q, k, v, out, lse); 0 for an lse not asked for."""
        return self._nbytes[name]

    @functools.cached_property
    def _nbytes(self) -> dict[str, int]:
        """``nbytes`` of each tensor, worked out once (a step's answer and accounting read
        them ~10 times: ~0.45 us each from the shapes)."""
        lse = self.lse_shape
        sizes = {n: math.prod(self.shape(n)) * ELEMENT_BYTES[self.wire_dtype(n)]
                 for n in ("q", "k", "v", "out")}
        sizes["lse"] = math.prod(lse) * LSE_BYTES if lse else 0
        return sizes

    @property
    def bytes_in(self) -> int:
        return sum(self.nbytes(n) for n in INPUTS)

    @functools.cached_property
    def kv_bytes(self) -> int:
        return self.nbytes("k") + self.nbytes("v")


def key_fp8(key: BatchKey) -> bool:
    """Whether a launch of ``key`` reads FP8 keys and values (``Params.key``'s last field)."""
    return bool(key[-1])


def key_with_fp8(key: BatchKey) -> BatchKey:
    """``key`` for FP8 keys and values: a request over FP8 caches (only the engine knows a
    cache's dtype)."""
    return (*key[:-1], True)


def check_cache_id(cid: str, field: str) -> str:
    """A cache id as the server accepts it: 1-256 bytes of UTF-8."""
    size = len(cid.encode())
    if not 1 <= size <= MAX_CACHE_ID_BYTES:
        raise invalid(field, f"{size} bytes; ids take 1-{MAX_CACHE_ID_BYTES}")
    return cid


def check_cache_ids(ids: Sequence[str], field: str) -> tuple[str, ...]:
    """Cache ids as the server accepts them: each as ``check_cache_id``, none twice."""
    seen: set[str] = set()
    for i, cid in enumerate(ids):
        check_cache_id(cid, f"{field}[{i}]")
        if cid in seen:
            raise invalid(f"{field}[{i}]", f"{cid!r} appears twice")
        seen.add(cid)
    return tuple(ids)


def check_kv_scales(msg: pb.KvScales, num_kv_heads: int, field: str,
                    fp8_queries: bool = False, num_seqs: int = 0) -> KvScales:
    """A KvScales message as the kernels take it: finite positive floats for keys and for
    values, and for queries when they are FP8 (``fp8_queries``; refused otherwise), each
    ``num_kv_heads`` of them (every sequence) or, with ``num_seqs`` > 1, ``num_seqs`` rows of
    ``num_kv_heads`` (sequence-major: FlashAttention-3's ``[batch, H_kv]`` descales);
    INVALID_ARGUMENT naming the entry otherwise. When any part is per sequence all come back
    so (the others' row repeated). The query scales come back folded into the key scales
    (``q * k``: both scale the logits), as the kernels fold them."""
    if not fp8_queries and len(msg.q):
        raise invalid(f"{field}.q", "set, but the queries are not FLOAT8_E4M3: query scales "
                      "are for FLOAT8_E4M3 queries")
    rows = num_seqs * num_kv_heads if num_seqs > 1 else num_kv_heads
    out = []
    for part in ("q", "k", "v") if fp8_queries else ("k", "v"):
        values = tuple(float(x) for x in getattr(msg, part))
        if len(values) not in (num_kv_heads, rows):
            raise invalid(f"{field}.{part}", f"{len(values)} scales for {num_kv_heads} kv "
                          "heads: give one per kv head" + (
                              f", or {num_seqs} x {num_kv_heads} (a row per sequence)"
                              if rows != num_kv_heads else ""))
        bad = next((i for i, x in enumerate(values) if not (math.isfinite(x) and x > 0)), None)
        if bad is not None:
            raise invalid(f"{field}.{part}[{bad}]", f"must be finite and > 0, got {values[bad]}")
        out.append(values)
    if any(len(x) != num_kv_heads for x in out):  # per sequence: every part so
        out = [x * num_seqs if len(x) == num_kv_heads else x for x in out]
    if fp8_queries:
        q, k, v = out
        folded = tuple(float(np.float32(a * b)) for a, b in zip(q, k, strict=True))
        bad = next((i for i, x in enumerate(folded) if not (math.isfinite(x) and x > 0)), None)
        if bad is not None:
            raise invalid(f"{field}.q[{bad}]", f"q[{bad}] * k[{bad}] = {q[bad] * k[bad]:g} "
                          "leaves float32's range")
        return folded, v
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
        op=op, dtype=dtype, num_heads=heads, num_kv_heads=k_shape[1], head_dim=dim,
        causal=causal, softmax_scale=(1.0 / math.sqrt(dim) if softmax_scale is None
                                      else float(softmax_scale)),
        num_splits=num_splits if op.decode_like else 0, window=(int(window[0]), int(window[1])),
        softcap=float(softcap), kv_dtype=kv_dtype or dtype, rows=q_shape[0], total_k=k_shape[0],
        cu_seqlens_q=tuple(cu_seqlens_q) if cu_seqlens_q is not None else None,
        cu_seqlens_k=tuple(cu_seqlens_k), max_seqlen_q=max_q, max_seqlen_k=max(len_k, default=0),
        return_lse=return_lse, flops=4 * pairs * heads * dim, cache_ids=tuple(cache_ids),
        store=store or not op.queries, alibi_slopes=tuple(float(x) for x in alibi_slopes),
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
