"""Validation of request headers and chunk streams: bad input never reaches a kernel.

Every refusal names the offending field first (``header.q.shape: ...``). Header checks use only
the header, so a request over the size limit is refused before any of its bytes are buffered.
cu_seqlens are untrusted: their values are checked here, on the host, before any launch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import grpc
import torch
from attention_client.pb import attention_pb2 as pb
from attention_kernels._checks import check_cu_seqlens_values, supported_head_dim

from attention_service.codec import (
    ELEMENT_BYTES,
    TORCH_DTYPES,
    HostAllocator,
    TensorBuffer,
    dtype_name,
)
from attention_service.config import MAX_MESSAGE_BYTES, MESSAGE_OVERHEAD_BYTES
from attention_service.errors import RequestError, exhausted, invalid

INPUT_FIELDS: dict[int, str] = {pb.Q: "q", pb.K: "k", pb.V: "v"}
# One output row must fit one default-sized response message (see codec.output_messages).
MAX_ROW_BYTES = MAX_MESSAGE_BYTES - MESSAGE_OVERHEAD_BYTES


@dataclass(frozen=True)
class Plan:
    """A validated header: everything needed to receive the bytes and run the request."""

    rpc: str  # "Prefill" | "Decode"
    dtype: torch.dtype
    q_shape: tuple[int, int, int]
    k_shape: tuple[int, int, int]
    nbytes: dict[int, int]  # input field -> byte length
    cu_seqlens_q: list[int] | None  # None for decode
    cu_seqlens_k: list[int]
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    softmax_scale: float | None
    return_lse: bool
    num_splits: int
    flops: int
    tokens: int  # queries for prefill, keys for decode (the batch_tokens unit)

    @property
    def bytes_in(self) -> int:
        return sum(self.nbytes.values())

    @property
    def num_heads(self) -> int:
        return self.q_shape[1]

    @property
    def head_dim(self) -> int:
        return self.q_shape[2]


def _dtype(header_spec: pb.TensorSpec, name: str) -> int:
    if header_spec.dtype not in TORCH_DTYPES:
        raise invalid(
            f"header.{name}.dtype",
            f"unknown or unsupported dtype {dtype_name(header_spec.dtype)}; "
            "use FLOAT16, BFLOAT16 or FLOAT32",
        )
    return header_spec.dtype


def _shape(header_spec: pb.TensorSpec, name: str, dims: Sequence[str]) -> tuple[int, int, int]:
    shape = tuple(header_spec.shape)
    if len(shape) != 3:
        raise invalid(
            f"header.{name}.shape",
            f"must have rank 3 [{', '.join(dims)}], got rank {len(shape)} {list(shape)}",
        )
    for i, (size, dim) in enumerate(zip(shape, dims, strict=True)):
        # Token counts may be 0 for k/v (rows then see no key); heads and head_dim may not.
        least = 0 if i == 0 and name in ("k", "v") else 1
        if size < least:
            raise invalid(f"header.{name}.shape[{i}]", f"{dim} must be >= {least}, got {size}")
    return shape  # type: ignore[return-value]


def _check_qkv(h: pb.PrefillHeader | pb.DecodeHeader, q_dims: Sequence[str]) -> tuple[int, ...]:
    """Dtypes and shapes of q, k, v; returns (pb dtype, q shape, k shape)."""
    if not h.HasField("q"):
        raise invalid("header.q", "missing")
    dt = _dtype(h.q, "q")
    for name in ("k", "v"):
        if not h.HasField(name):
            raise invalid(f"header.{name}", "missing")
        other = _dtype(getattr(h, name), name)
        if other != dt:
            raise invalid(
                f"header.{name}.dtype",
                f"{dtype_name(other)} differs from q's dtype {dtype_name(dt)}",
            )
    q_shape = _shape(h.q, "q", q_dims)
    kv_dims = ("total_k", "num_kv_heads", "head_dim")
    k_shape = _shape(h.k, "k", kv_dims)
    v_shape = _shape(h.v, "v", kv_dims)
    if v_shape != k_shape:
        raise invalid("header.v.shape", f"{list(v_shape)} differs from k's shape {list(k_shape)}")
    num_heads, head_dim = q_shape[1], q_shape[2]
    if k_shape[2] != head_dim:
        raise invalid(
            "header.k.shape[2]", f"head_dim {k_shape[2]} differs from q's head_dim {head_dim}"
        )
    if not supported_head_dim(head_dim):
        raise invalid(
            "header.q.shape[2]",
            f"head_dim {head_dim} unsupported: must be a multiple of 8 in [8, 256]",
        )
    if num_heads % k_shape[1] != 0:
        raise invalid(
            "header.k.shape[1]",
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({k_shape[1]})",
        )
    row_bytes = num_heads * head_dim * ELEMENT_BYTES[dt]
    if row_bytes > MAX_ROW_BYTES:
        raise invalid(
            "header.q.shape[1]",
            f"one output row (num_heads * head_dim) is {row_bytes} bytes, over the "
            f"{MAX_ROW_BYTES}-byte message limit",
        )
    return dt, q_shape, k_shape


def _scale(h: pb.PrefillHeader | pb.DecodeHeader) -> float | None:
    if not h.HasField("softmax_scale"):
        return None
    if not math.isfinite(h.softmax_scale):
        raise invalid("header.softmax_scale", f"must be finite, got {h.softmax_scale}")
    return float(h.softmax_scale)


def _check_size(nbytes: dict[int, int], limit: int) -> None:
    total = sum(nbytes.values())
    if total > limit:
        raise exhausted(
            "header",
            f"request tensors take {total} bytes (q {nbytes[pb.Q]}, k {nbytes[pb.K]}, "
            f"v {nbytes[pb.V]}), over the server limit of {limit} bytes",
        )


def _check_cu(values: Sequence[int], total: int, name: str) -> list[int]:
    vals = list(values)
    if len(vals) < 2:
        raise invalid(name, f"must have batch+1 >= 2 entries, got {len(vals)}")
    for i, x in enumerate(vals):
        if x < 0:
            raise invalid(name, f"entry {i} is negative ({x})")
    try:
        check_cu_seqlens_values(vals, total, name)
    except ValueError as exc:
        # Its messages start with the field name already.
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    return vals


def _lengths(cu: Sequence[int]) -> list[int]:
    return [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]


def _causal_pairs(seqlen_q: int, seqlen_k: int) -> int:
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


def validate_prefill_header(h: pb.PrefillHeader, max_request_bytes: int) -> Plan:
    dt, q_shape, k_shape = _check_qkv(h, ("total_q", "num_heads", "head_dim"))
    scale = _scale(h)
    total_q, num_heads, head_dim = q_shape
    if h.return_lse and total_q * 4 > MAX_ROW_BYTES:
        # lse is [num_heads, total_q] and travels in rows of total_q floats.
        raise invalid(
            "header.return_lse",
            f"lse rows of total_q={total_q} floats exceed the {MAX_ROW_BYTES}-byte message "
            f"limit; at most {MAX_ROW_BYTES // 4} query tokens per request with return_lse",
        )
    esize = ELEMENT_BYTES[dt]
    nbytes = {
        pb.Q: math.prod(q_shape) * esize,
        pb.K: math.prod(k_shape) * esize,
        pb.V: math.prod(k_shape) * esize,
    }
    _check_size(nbytes, max_request_bytes)
    cu_q = _check_cu(h.cu_seqlens_q, total_q, "header.cu_seqlens_q")
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
        cu_k = _check_cu(h.cu_seqlens_k, k_shape[0], "header.cu_seqlens_k")
    len_q, len_k = _lengths(cu_q), _lengths(cu_k)
    if h.causal:
        pairs = sum(_causal_pairs(sq, sk) for sq, sk in zip(len_q, len_k, strict=True))
    else:
        pairs = sum(sq * sk for sq, sk in zip(len_q, len_k, strict=True))
    return Plan(
        rpc="Prefill", dtype=TORCH_DTYPES[dt], q_shape=q_shape, k_shape=k_shape, nbytes=nbytes,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(len_q), max_seqlen_k=max(len_k),
        causal=h.causal, softmax_scale=scale, return_lse=h.return_lse, num_splits=0,
        flops=4 * pairs * num_heads * head_dim, tokens=total_q,
    )


def validate_decode_header(h: pb.DecodeHeader, max_request_bytes: int) -> Plan:
    dt, q_shape, k_shape = _check_qkv(h, ("batch", "num_heads", "head_dim"))
    scale = _scale(h)
    if h.num_splits < 0:
        raise invalid(
            "header.num_splits", f"must be >= 0 (0 = server's choice), got {h.num_splits}"
        )
    batch, num_heads, head_dim = q_shape
    esize = ELEMENT_BYTES[dt]
    nbytes = {
        pb.Q: math.prod(q_shape) * esize,
        pb.K: math.prod(k_shape) * esize,
        pb.V: math.prod(k_shape) * esize,
    }
    _check_size(nbytes, max_request_bytes)
    if len(h.cu_seqlens_k) != batch + 1:
        raise invalid(
            "header.cu_seqlens_k",
            f"has {len(h.cu_seqlens_k)} entries but q has batch {batch} (needs batch+1 = "
            f"{batch + 1})",
        )
    cu_k = _check_cu(h.cu_seqlens_k, k_shape[0], "header.cu_seqlens_k")
    len_k = _lengths(cu_k)
    return Plan(
        rpc="Decode", dtype=TORCH_DTYPES[dt], q_shape=q_shape, k_shape=k_shape, nbytes=nbytes,
        cu_seqlens_q=None, cu_seqlens_k=cu_k, max_seqlen_q=1, max_seqlen_k=max(len_k),
        causal=False, softmax_scale=scale, return_lse=h.return_lse, num_splits=h.num_splits,
        flops=4 * k_shape[0] * num_heads * head_dim, tokens=k_shape[0],
    )


class InputAssembler:
    """Collects the chunks of q, k and v into host buffers, checking offsets as they come."""

    def __init__(self, plan: Plan, alloc: HostAllocator) -> None:
        self.plan = plan
        self.buffers = {f: TensorBuffer(n, alloc) for f, n in plan.nbytes.items()}

    def add(self, chunks: Iterable[pb.TensorChunk]) -> None:
        for c in chunks:
            name = INPUT_FIELDS.get(c.field)
            if name is None:
                raise invalid("chunks.field", f"unknown input field {c.field} (use Q, K or V)")
            buf = self.buffers[c.field]
            if c.offset < buf.received:
                raise invalid(
                    f"chunks[{name}].offset",
                    f"{c.offset} overlaps bytes already received (next offset is {buf.received})",
                )
            if c.offset > buf.received:
                raise invalid(
                    f"chunks[{name}].offset",
                    f"{c.offset} is out of order (next offset is {buf.received})",
                )
            if c.offset + len(c.data) > buf.nbytes:
                raise invalid(
                    f"chunks[{name}]",
                    f"bytes [{c.offset}, {c.offset + len(c.data)}) run past the end of {name} "
                    f"({buf.nbytes} bytes for its shape and dtype)",
                )
            buf.write(c.data)

    def finish(self) -> dict[str, torch.Tensor]:
        """The tensors, once every byte arrived."""
        p = self.plan
        for f, buf in self.buffers.items():
            if buf.received != buf.nbytes:
                name = INPUT_FIELDS[f]
                raise invalid(
                    f"chunks[{name}]",
                    f"missing bytes at end of stream: received {buf.received} of {buf.nbytes} "
                    f"bytes for {name}'s shape and dtype",
                )
        return {
            "q": self.buffers[pb.Q].tensor(p.dtype, p.q_shape),
            "k": self.buffers[pb.K].tensor(p.dtype, p.k_shape),
            "v": self.buffers[pb.V].tensor(p.dtype, p.k_shape),
        }
