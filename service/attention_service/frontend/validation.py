"""Validation of request headers and chunk streams: bad input never reaches the engine.

Every refusal names the offending field first (``header.q.shape: ...``). Header checks use only
the header, so a request over the size limit is refused before any of its bytes are buffered.
cu_seqlens are untrusted: their values are checked here, on the host, before any launch.
Pure Python: front-end processes do not import torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
from google.protobuf.message import DecodeError

from attention_service.config import MAX_MESSAGE_BYTES, MESSAGE_OVERHEAD_BYTES, ServerConfig
from attention_service.errors import RequestError, exhausted, invalid
from attention_service.params import (
    ELEMENT_BYTES,
    INPUTS,
    LSE_BYTES,
    OUTPUTS,
    QUERY_DTYPES,
    KvScales,
    Op,
    Params,
    RegionSpan,
    check_cache_ids,
    check_kv_scales,
    kv_dtype_allowed,
    make_params,
)
from attention_wire.messages import (
    RawRequest,
    WireError,
    out_dtype,
    read_request,
    request_header,
)
from attention_wire.pb import attention_pb2 as pb

INPUT_FIELDS: dict[int, str] = {pb.Q: "q", pb.K: "k", pb.V: "v"}
# One output row must fit one default-sized response message (see streams.output_messages).
MAX_ROW_BYTES = MAX_MESSAGE_BYTES - MESSAGE_OVERHEAD_BYTES
MAX_HEAD_DIM = 256


class Limits(NamedTuple):
    """What one request may ask of the server (``ServerConfig``'s admission limits), and how
    slowly it may arrive."""

    max_request_bytes: int
    max_sequences: int
    max_heads_ratio: int
    max_request_flops: float
    # How slowly an upload may arrive (streams.receive_request): the longest wait for the next
    # message of an incomplete one (0: none), and the bytes/s it must average once that long
    # has passed since its header (0: no minimum).
    upload_idle_timeout: float
    min_upload_rate: int

    @staticmethod
    def of(config: ServerConfig) -> Limits:
        return Limits(*(getattr(config, f) for f in Limits._fields))


def _over(field: str, what: str, value: object, limit: object, flag: str) -> RequestError:
    return exhausted(field, f"{what} {value}, over the server's limit of {limit} ({flag})")


def _check_sequences(count: int, field: str, limits: Limits) -> None:
    # Before the list is converted or checked: a 4 MiB cu_seqlens must cost nothing.
    if count > limits.max_sequences:
        raise _over(field, "sequences:", count, limits.max_sequences, "--max-sequences")


def _check_work(params: Params, limits: Limits) -> None:
    if params.flops > limits.max_request_flops:
        raise _over("header", "attention FLOPs:", f"{params.flops:.3g}",
                    f"{limits.max_request_flops:.3g}", "--max-request-flops")


def supported_head_dim(head_dim: int) -> bool:
    """The kernels' rule (attention_kernels._checks; a test keeps the two equal): every head
    dim from 1 to 256."""
    return 1 <= head_dim <= MAX_HEAD_DIM


def dtype_name(value: int) -> str:
    try:
        return pb.DType.Name(value)
    except ValueError:
        return str(value)


def _dtype(header_spec: pb.TensorSpec, name: str, kv: bool = False,
           op: Op | None = None) -> int:
    """A tensor's dtype: FLOAT8_E4M3 for keys and values (``kv``), and for queries of an
    ``op`` that takes them (``Op.fp8_queries``: Prefill and Decode)."""
    fp8_ok = kv or (op is not None and op.fp8_queries)
    if header_spec.dtype not in (ELEMENT_BYTES if fp8_ok else QUERY_DTYPES):
        also = (" (or FLOAT8_E4M3 for keys and values)" if kv else
                " (FLOAT8_E4M3 queries: Prefill and Decode only)"
                if header_spec.dtype == pb.FLOAT8_E4M3 else "")
        raise invalid(
            f"header.{name}.dtype",
            f"unknown or unsupported dtype {dtype_name(header_spec.dtype)}; use FLOAT16, "
            f"BFLOAT16 or FLOAT32{also}",
        )
    return int(header_spec.dtype)


def _shape(header_spec: pb.TensorSpec, name: str, dims: Sequence[str],
           empty_q: bool = False) -> tuple[int, int, int]:
    """``empty_q``: q may have 0 rows (an empty batch of a stateless Prefill or Decode, answered
    with empty outputs, as flash_attn does); k and v always may."""
    shape = tuple(header_spec.shape)
    if len(shape) != 3:
        raise invalid(
            f"header.{name}.shape",
            f"must have rank 3 [{', '.join(dims)}], got rank {len(shape)} {list(shape)}",
        )
    for i, (size, dim) in enumerate(zip(shape, dims, strict=True)):
        # Token counts may be 0 for k/v (rows then see no key); heads and head_dim may not.
        least = 0 if i == 0 and (name in ("k", "v") or empty_q) else 1
        if size < least:
            raise invalid(f"header.{name}.shape[{i}]", f"{dim} must be >= {least}, got {size}")
    return shape  # type: ignore[return-value]


def _kv_dtype(h: pb.PrefillHeader | pb.DecodeHeader, dt: int) -> int:
    """k's and v's dtype: both the same, and q's or FLOAT8_E4M3 beside fp16/bf16 queries."""
    for name in ("k", "v"):
        if not h.HasField(name):
            raise invalid(f"header.{name}", "missing")
    kv_dt = _dtype(h.k, "k", kv=True)
    other = _dtype(h.v, "v", kv=True)
    if other != kv_dt:
        raise invalid("header.v.dtype", f"{dtype_name(other)} differs from k's dtype "
                      f"{dtype_name(kv_dt)}")
    if not kv_dtype_allowed(dt, kv_dt):
        why = ("FLOAT8_E4M3 queries need FLOAT8_E4M3 keys and values" if dt == pb.FLOAT8_E4M3
               else "FLOAT8_E4M3 keys and values need FLOAT16 or BFLOAT16 queries"
               if kv_dt == pb.FLOAT8_E4M3 else "use q's dtype (or FLOAT8_E4M3)")
        raise invalid("header.k.dtype", f"{dtype_name(kv_dt)} with q's dtype "
                      f"{dtype_name(dt)}: {why}")
    return kv_dt


def _check_qkv(
    h: pb.PrefillHeader | pb.DecodeHeader, q_dims: Sequence[str], with_q: bool = True,
    max_heads_ratio: int = 1 << 30, empty_q: bool = False, op: Op | None = None,
) -> dict[str, Any]:
    """Dtypes and shapes of q, k, v, checked: ``make_params``' dtype, kv_dtype, q_shape and
    k_shape. ``with_q`` False (AppendKV): q must be absent, its dtype is taken as k's and its
    shape as ``[0, num_kv_heads, head_dim]``. ``empty_q``: q may have 0 rows. ``op``: the
    rpc (a Prefill or Decode may send FLOAT8_E4M3 queries)."""
    if not with_q:
        if h.HasField("q"):
            raise invalid("header.q", "set, but AppendKV takes no queries: leave q unset")
        if not h.HasField("k"):
            raise invalid("header.k", "missing")
        dt = _dtype(h.k, "k", kv=True)
    elif not h.HasField("q"):
        raise invalid("header.q", "missing")
    else:
        dt = _dtype(h.q, "q", op=op)
    kv_dt = _kv_dtype(h, dt)
    kv_dims = ("total_k", "num_kv_heads", "head_dim")
    k_shape = _shape(h.k, "k", kv_dims)
    v_shape = _shape(h.v, "v", kv_dims)
    q_shape = _shape(h.q, "q", q_dims, empty_q) if with_q else (0, k_shape[1], k_shape[2])
    if v_shape != k_shape:
        raise invalid("header.v.shape", f"{list(v_shape)} differs from k's shape {list(k_shape)}")
    num_heads, head_dim = q_shape[1], q_shape[2]
    if not supported_head_dim(head_dim):  # first: a k that differs from it is the lesser news
        raise invalid(
            f"header.{'q' if with_q else 'k'}.shape[2]",
            f"head_dim {head_dim} unsupported: must be in [1, {MAX_HEAD_DIM}]",
        )
    if k_shape[2] != head_dim:
        raise invalid(
            "header.k.shape[2]", f"head_dim {k_shape[2]} differs from q's head_dim {head_dim}"
        )
    if num_heads % k_shape[1] != 0:
        raise invalid(
            "header.k.shape[1]",
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({k_shape[1]})",
        )
    row_bytes = num_heads * head_dim * ELEMENT_BYTES[out_dtype(dt)]
    if row_bytes > MAX_ROW_BYTES:
        raise invalid(
            "header.q.shape[1]",
            f"one output row (num_heads * head_dim) is {row_bytes} bytes, over the "
            f"{MAX_ROW_BYTES}-byte message limit",
        )
    if num_heads // k_shape[1] > max_heads_ratio:
        raise _over("header.q.shape[1]", "query heads per kv head:",
                    f"{num_heads // k_shape[1]} ({num_heads} / {k_shape[1]})", max_heads_ratio,
                    "--max-heads-ratio")
    return {"dtype": dt, "kv_dtype": kv_dt, "q_shape": q_shape, "k_shape": k_shape}


def _kv_scales(h: pb.PrefillHeader | pb.DecodeHeader, op: Op, kv_dtype: int,
               num_kv_heads: int, num_seqs: int, dtype: int = 0) -> KvScales | None:
    """The scales of a stateless op's FP8 keys and values (None for any other request), per
    kv head or per sequence (``num_seqs`` rows), with FP8 queries' (``dtype``) folded into
    the keys'."""
    fp8 = kv_dtype == pb.FLOAT8_E4M3
    if not h.HasField("kv_scales"):
        if fp8 and not op.cached:
            raise invalid("header.kv_scales", "missing: FLOAT8_E4M3 keys and values need "
                          "their per-kv-head scales")
        return None
    if op.cached:
        raise invalid("header.kv_scales", f"set, but {op.rpc} uses its caches' scales "
                      "(CacheLayout.kv_scales): leave it unset")
    if not fp8:
        raise invalid("header.kv_scales", f"set, but k and v are {dtype_name(kv_dtype)}: "
                      "scales are for FLOAT8_E4M3 keys and values")
    return check_kv_scales(h.kv_scales, num_kv_heads, "header.kv_scales",
                           fp8_queries=dtype == pb.FLOAT8_E4M3, num_seqs=num_seqs)


def _scale(h: pb.PrefillHeader | pb.DecodeHeader) -> float | None:
    if not h.HasField("softmax_scale"):
        return None
    if not math.isfinite(h.softmax_scale):
        raise invalid("header.softmax_scale", f"must be finite, got {h.softmax_scale}")
    return float(h.softmax_scale)


def _score(h: pb.PrefillHeader | pb.DecodeHeader, num_heads: int, batch: int
           ) -> dict[str, Any]:
    """A header's ScoreOptions, checked: ``make_params``' window, softcap and alibi_slopes
    (the kernels' defaults when absent)."""
    if not h.HasField("score"):
        return {}
    s = h.score
    window = []
    for side in ("window_left", "window_right"):
        value = getattr(s, side) if s.HasField(side) else -1
        if value < -1:
            raise invalid(f"header.score.{side}", f"must be >= -1 (-1: unbounded), got {value}")
        window.append(int(value))
    if not (math.isfinite(s.softcap) and s.softcap >= 0):
        raise invalid("header.score.softcap", f"must be finite and >= 0 (0: off), got {s.softcap}")
    slopes = tuple(s.alibi_slopes)
    if slopes:
        if len(slopes) not in (num_heads, batch * num_heads):
            raise invalid("header.score.alibi_slopes",
                          f"{len(slopes)} slopes: give num_heads ({num_heads}) or batch * "
                          f"num_heads ({batch} * {num_heads} = {batch * num_heads})")
        bad = next((i for i, x in enumerate(slopes) if not math.isfinite(x)), None)
        if bad is not None:
            raise invalid(f"header.score.alibi_slopes[{bad}]", f"must be finite, got {slopes[bad]}")
    return {"window": (window[0], window[1]), "softcap": float(s.softcap), "alibi_slopes": slopes}


def _check_size(params: Params, limit: int) -> None:
    total = params.bytes_in
    if total > limit:
        sizes = ", ".join(f"{n} {params.nbytes(n)}" for n in INPUTS)
        raise exhausted(
            "header",
            f"request tensors take {total} bytes ({sizes}), over the server limit of {limit} "
            "bytes (--max-request-bytes)",
        )


def _check_cu(values: Sequence[int], total: int, name: str, least: int = 2) -> list[int]:
    """Values check (untrusted): batch+1 >= ``least`` entries (1: a decode of no sequences),
    no negative entry, starts at 0, non-decreasing, ends at the token count."""
    vals = list(values)
    if len(vals) < least:
        raise invalid(name, f"must have batch+1 >= {least} entries, got {len(vals)}")
    arr = np.asarray(vals, dtype=np.int64)
    if (arr < 0).any():
        i = int(np.flatnonzero(arr < 0)[0])
        raise invalid(name, f"entry {i} is negative ({vals[i]})")
    if vals[0] != 0:
        raise invalid(name, "must start at 0")
    steps = np.diff(arr)
    if (steps < 0).any():
        i = int(np.flatnonzero(steps < 0)[0]) + 1
        raise invalid(name, f"must be non-decreasing (entry {i}: {vals[i]} < {vals[i - 1]})")
    if vals[-1] != total:
        raise invalid(name, f"must end at the token count {total}, got {vals[-1]}")
    return vals


def _regions(h: pb.PrefillHeader | pb.DecodeHeader, params: Params) -> dict[str, RegionSpan]:
    """The tensors the header places in registered regions, with their sizes checked."""
    if not h.HasField("regions"):
        return {}
    spans: dict[str, RegionSpan] = {}
    for name in (*INPUTS, *OUTPUTS):
        if not h.regions.HasField(name):
            continue
        s = getattr(h.regions, name)
        field = f"header.regions.{name}"
        if name == "lse" and not params.return_lse:
            raise invalid(field, "set, but return_lse is not")
        if name in ("q", "out") and not params.op.queries:
            raise invalid(field, "set, but AppendKV has no queries and no output")
        if not s.region:
            raise invalid(f"{field}.region", "missing: name a registered region")
        want = params.nbytes(name)
        if s.byte_size != want:
            raise invalid(
                f"{field}.byte_size",
                f"{s.byte_size} bytes, but {name}'s shape and dtype take {want}",
            )
        spans[name] = RegionSpan(s.region, int(s.offset), int(s.byte_size))
    return spans


def _cache_target(
    h: pb.PrefillHeader | pb.DecodeHeader, op: Op, batch: int
) -> tuple[tuple[str, ...], bool]:
    """(cache ids, store) of a cached op; a plain op must not name caches."""
    if not op.cached:
        if h.HasField("cache"):
            raise invalid("header.cache", f"set, but {op.rpc} does not use server-side caches "
                          "(CachePrefill, CacheDecode and AppendKV do)")
        return (), False
    if not h.HasField("cache"):
        raise invalid("header.cache", f"missing: {op.rpc} needs one cache id per sequence")
    ids = check_cache_ids(h.cache.cache_ids, "header.cache.cache_ids")
    if len(ids) != batch:
        raise invalid("header.cache.cache_ids",
                      f"{len(ids)} ids for {batch} sequences: name one cache per sequence")
    return ids, h.cache.store


def validate_prefill_header(
    h: pb.PrefillHeader, limits: Limits, op: Op = Op.PREFILL
) -> tuple[Params, dict[str, RegionSpan]]:
    """Prefill, CachePrefill and AppendKV (no q: its cu_seqlens_q is all zeros)."""
    append = not op.queries  # AppendKV
    qkv = _check_qkv(h, ("total_q", "num_heads", "head_dim"), not append,
                     limits.max_heads_ratio, empty_q=not op.cached, op=op)
    q_shape, k_shape = qkv["q_shape"], qkv["k_shape"]
    _check_sequences(len(h.cu_seqlens_q) - 1, "header.cu_seqlens_q", limits)
    _check_sequences(len(h.cu_seqlens_k) - 1, "header.cu_seqlens_k", limits)
    scale = _scale(h)
    total_q = q_shape[0]
    if append:
        qkv["kv_scales"] = _kv_scales(h, op, qkv["kv_dtype"], k_shape[1], 0)  # refused: cached
        if h.return_lse:
            raise invalid("header.return_lse", "set, but AppendKV computes no attention")
        if len(h.cu_seqlens_q):
            raise invalid("header.cu_seqlens_q", "set, but AppendKV takes no queries")
        if h.HasField("score"):
            raise invalid("header.score", "set, but AppendKV computes no attention")
        cu_k = _check_cu(h.cu_seqlens_k, k_shape[0], "header.cu_seqlens_k")
        ids, _ = _cache_target(h, op, len(cu_k) - 1)
        params = make_params(op, cu_seqlens_k=cu_k, cu_seqlens_q=[0] * len(cu_k),
                             cache_ids=ids, **qkv)
        _check_size(params, limits.max_request_bytes)
        return params, _regions(h, params)
    if h.return_lse and total_q * LSE_BYTES > MAX_ROW_BYTES:
        # lse is [num_heads, total_q] and travels in rows of total_q floats.
        raise invalid(
            "header.return_lse",
            f"lse rows of total_q={total_q} floats exceed the {MAX_ROW_BYTES}-byte message "
            f"limit; at most {MAX_ROW_BYTES // LSE_BYTES} query tokens per request with "
            "return_lse",
        )
    # An empty batch of a stateless Prefill may name no sequence at all (cu_seqlens_q [0]).
    least = 1 if total_q == 0 and not op.cached else 2
    cu_q = _check_cu(h.cu_seqlens_q, total_q, "header.cu_seqlens_q", least)
    if len(h.cu_seqlens_k) == 0:
        if k_shape[0] != total_q:
            raise invalid(
                "header.cu_seqlens_k",
                f"empty (so equal to cu_seqlens_q, ending at {total_q}) but k has "
                f"{k_shape[0]} tokens",
            )
        cu_k = cu_q
    else:
        if len(h.cu_seqlens_k) != len(cu_q):
            raise invalid(
                "header.cu_seqlens_k",
                f"q/k batch mismatch: {len(h.cu_seqlens_k) - 1} sequences but cu_seqlens_q "
                f"has {len(cu_q) - 1}",
            )
        cu_k = _check_cu(h.cu_seqlens_k, k_shape[0], "header.cu_seqlens_k", least)
    # Per-sequence scales are counted against the checked sequences (q/k batches agree).
    qkv["kv_scales"] = _kv_scales(h, op, qkv["kv_dtype"], k_shape[1], len(cu_k) - 1,
                                  qkv["dtype"])
    ids, store = _cache_target(h, op, len(cu_q) - 1)
    params = make_params(
        op, cu_seqlens_k=cu_k, cu_seqlens_q=cu_q, causal=h.causal, softmax_scale=scale,
        return_lse=h.return_lse, cache_ids=ids, store=store,
        **_score(h, q_shape[1], len(cu_q) - 1), **qkv,
    )
    _check_size(params, limits.max_request_bytes)
    _check_work(params, limits)
    return params, _regions(h, params)


def validate_decode_header(
    h: pb.DecodeHeader, limits: Limits, op: Op = Op.DECODE
) -> tuple[Params, dict[str, RegionSpan]]:
    """Decode and CacheDecode (whose empty cu_seqlens_k means one new token per sequence, or
    none when k has no rows)."""
    qkv = _check_qkv(h, ("batch", "num_heads", "head_dim"),
                     max_heads_ratio=limits.max_heads_ratio, empty_q=not op.cached, op=op)
    q_shape, k_shape = qkv["q_shape"], qkv["k_shape"]
    _check_sequences(q_shape[0], "header.q.shape[0]", limits)
    qkv["kv_scales"] = _kv_scales(h, op, qkv["kv_dtype"], k_shape[1], q_shape[0],
                                  qkv["dtype"])
    scale = _scale(h)
    if h.num_splits < 0:
        raise invalid(
            "header.num_splits", f"must be >= 0 (0 = server's choice), got {h.num_splits}"
        )
    batch = q_shape[0]
    cu_seqlens_k = list(h.cu_seqlens_k)
    if op.cached and not cu_seqlens_k and k_shape[0] in (0, batch):
        cu_seqlens_k = list(range(batch + 1)) if k_shape[0] else [0] * (batch + 1)
    if len(cu_seqlens_k) != batch + 1:
        raise invalid(
            "header.cu_seqlens_k",
            f"has {len(cu_seqlens_k)} entries but q has batch {batch} (needs batch+1 = "
            f"{batch + 1})",
        )
    cu_k = _check_cu(cu_seqlens_k, k_shape[0], "header.cu_seqlens_k", 2 if batch else 1)
    ids, store = _cache_target(h, op, batch)
    params = make_params(
        op, cu_seqlens_k=cu_k, softmax_scale=scale, return_lse=h.return_lse,
        num_splits=h.num_splits, cache_ids=ids, store=store, **_score(h, q_shape[1], batch),
        **qkv,
    )
    _check_size(params, limits.max_request_bytes)
    _check_work(params, limits)
    return params, _regions(h, params)


def validate_header(
    op: Op, h: pb.PrefillHeader | pb.DecodeHeader, limits: Limits
) -> tuple[Params, dict[str, RegionSpan]]:
    return _HEADER_CHECKS[op.header](h, limits, op)  # type: ignore[no-any-return]


_HEADER_CHECKS = {pb.PrefillHeader: validate_prefill_header,
                  pb.DecodeHeader: validate_decode_header}


# Parsed headers by (op, wire bytes), for headers up to MEMO_HEADER_BYTES: a KV-cache
# session's decode steps repeat one header (same shapes, same caches) call after call; plain
# Decode headers change every step (k grows) and only pass through. Shared messages are only
# read. Bounded: at most MEMO_ENTRIES headers and MEMO_BYTES of their wire bytes; a full memo
# starts over. A step of 64 caches has a ~1 KB header (its ids): parsing and checking it again
# each step took ~290 us of a front end's CPU (2-core dev box), the memo ~1 us.
MEMO_HEADER_BYTES = 16 << 10
MEMO_ENTRIES = 1024
MEMO_BYTES = 4 << 20


class Memo(dict):  # type: ignore[type-arg]
    """A dict that ``memoized`` keeps under MEMO_ENTRIES entries and MEMO_BYTES of keys."""

    nbytes = 0


_PARSED: Memo = Memo()


def memoized(memo: dict[Any, Any], key: Any, make: Callable[[], Any], size: int = 0) -> Any:
    """``memo[key]``, made by ``make()`` (and kept) when missing; ``make``'s exceptions
    propagate and leave nothing behind. ``size``: the key's bytes (a ``Memo`` counts them).
    At MEMO_ENTRIES entries, or MEMO_BYTES of keys, the memo starts over."""
    got = memo.get(key)
    if got is None:
        got = make()
        counted = isinstance(memo, Memo)
        if len(memo) >= MEMO_ENTRIES or (counted and memo.nbytes + size > MEMO_BYTES):
            memo.clear()
            if counted:
                memo.nbytes = 0
        memo[key] = got
        if counted:
            memo.nbytes += size
    return got


# Checked headers by (op, wire bytes, limits), for headers up to MEMO_HEADER_BYTES: the checks
# are a pure function of those three, and a KV-cache session's step header repeats. A front end
# at one client spent ~15% of its samples in validate_decode_header (H200, py-spy,
# 2026-11-23). Refused headers are not kept: they raise again. Bounded like wire's memo.
_CHECKED: Memo = Memo()  # (op, wire bytes, limits) -> (Params, regions)


def checked_header(
    op: Op, h: pb.PrefillHeader | pb.DecodeHeader, header_bytes: bytes | None, limits: Limits
) -> tuple[Params, Mapping[str, RegionSpan]]:
    """``validate_header``, answered from a memo when ``header_bytes`` (``h``'s wire bytes)
    passed the same checks before. The regions are a read-only view, shared by the calls."""
    if header_bytes is None or len(header_bytes) > MEMO_HEADER_BYTES:
        return validate_header(op, h, limits)

    def check() -> tuple[Params, Mapping[str, RegionSpan]]:
        params, regions = validate_header(op, h, limits)
        return params, MappingProxyType(regions)

    return memoized(_CHECKED, (op, header_bytes, limits), check,  # type: ignore[no-any-return]
                    len(header_bytes))


def parse_header(op: Op, raw: bytes) -> Any:
    if len(raw) > MEMO_HEADER_BYTES:
        return op.header.FromString(raw)
    return memoized(_PARSED, (op, raw), lambda: op.header.FromString(raw), len(raw))


def parse_request(message: bytes, op: Op) -> RawRequest:
    """``message`` as a PrefillRequest / DecodeRequest (``attention_wire.messages``), its
    header parsed once per distinct header (the memo above); INVALID_ARGUMENT if it is not
    valid protobuf."""
    try:
        return read_request(message, lambda raw: parse_header(op, raw))
    except (WireError, DecodeError) as exc:
        raise invalid("message", f"not a valid {op.rpc}Request: {exc}") from None


# The caches a step header names, by the header's wire bytes: a model host's steps repeat a
# few headers (one per layer), and a 64-id header's ids read once, not each step.
_STEP_CACHES: Memo = Memo()
_NO_CACHES: frozenset[str] = frozenset()


def step_cache_ids(raw: bytes, op: Op) -> frozenset[str]:
    """The caches a call names; none for a stateless op, and for a message ``serve`` will
    refuse."""
    if not op.cached:
        return _NO_CACHES
    try:
        header_bytes = request_header(raw)
    except WireError:
        return _NO_CACHES
    if header_bytes is None:
        return _NO_CACHES

    def read() -> frozenset[str]:
        try:
            return frozenset(parse_header(op, header_bytes).cache.cache_ids)
        except DecodeError:
            return _NO_CACHES

    return memoized(_STEP_CACHES, header_bytes, read, len(header_bytes))  # type: ignore[no-any-return]
