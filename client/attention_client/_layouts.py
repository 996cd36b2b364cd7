"""The caches' side of a request, off the path of a stateless call: their layout
(``KvLayout``: what a handle's tensors are checked against), the caches a cache op runs
against (``CacheTarget``), cache ids (``as_cache_ids``) and the checks of the cache ops'
tensors against both (``check_layout``, ``new_kv``, ``count_check``, ``check_cu_values``)."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_client._errors import AttentionInputError
from attention_client._requests import (
    MAX_HEAD_DIM,
    KvScales,
    Tensor,
    check_scale_heads,
    kv_scales_of,
    scales_message,
)
from attention_client._tensors import (
    FP8_QUERY_DTYPES,
    QUERY_DTYPES,
    WireTensor,
    as_wire_dtype,
    dtype_name,
    storage_dtype,
)
from attention_wire.pb import attention_pb2 as pb

# What the server takes as a cache id (check_cache_id in attention_service.params).
MAX_CACHE_ID_BYTES = 256


@dataclass(frozen=True)
class KvLayout:
    """The layout of server-side caches: the queries run against them (and their outputs)
    are ``dtype`` (a pb.DType) with heads that ``num_kv_heads`` divides; keys and values
    have ``num_kv_heads`` heads of ``head_dim`` and are stored in ``kv_dtype`` (0: ``dtype``;
    FLOAT8_E4M3 with ``kv_scales``)."""

    dtype: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: int = 0
    kv_scales: KvScales | None = None

    @classmethod
    def of(cls, num_kv_heads: int, head_dim: int, dtype: Any, kv_dtype: Any = None,
           k_scale: Any = None, v_scale: Any = None) -> KvLayout:
        heads, dim = _positive(num_kv_heads, "num_kv_heads"), _positive(head_dim, "head_dim")
        if dim > MAX_HEAD_DIM:
            raise AttentionInputError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {dim}")
        wire = as_wire_dtype(dtype)
        if wire not in QUERY_DTYPES:
            raise AttentionInputError(f"dtype {dtype_name(wire)} is for keys and values only: "
                                      "give the queries' dtype, and kv_dtype for the stored one")
        stored = as_wire_dtype(kv_dtype, "kv_dtype") if kv_dtype is not None else wire
        scales = kv_scales_of(k_scale, v_scale, rows=False)  # a cache is one sequence
        if stored == wire:
            if scales is not None:
                raise AttentionInputError("k_scale/v_scale are for kv_dtype float8_e4m3fn")
            return cls(wire, heads, dim)
        if stored != pb.FLOAT8_E4M3 or wire not in FP8_QUERY_DTYPES:
            raise AttentionInputError(f"kv_dtype {dtype_name(stored)} with dtype "
                                      f"{dtype_name(wire)}: leave kv_dtype unset, or "
                                      "float8_e4m3fn with float16 or bfloat16")
        if scales is None:
            raise AttentionInputError("kv_dtype float8_e4m3fn needs k_scale and v_scale (one "
                                      "float per kv head)")
        check_scale_heads(scales, heads)
        return cls(wire, heads, dim, stored, scales)

    @classmethod
    def from_message(cls, layout: pb.CacheLayout) -> KvLayout:
        kv_dtype = int(layout.kv_dtype) if layout.kv_dtype != layout.dtype else 0
        scales = None
        if layout.HasField("kv_scales"):  # float32 on the wire, as kv_scales_of keeps them
            scales = (tuple(layout.kv_scales.k), tuple(layout.kv_scales.v))
        return cls(int(layout.dtype), int(layout.num_kv_heads), int(layout.head_dim),
                   kv_dtype, scales)

    def message(self) -> pb.CacheLayout:
        msg = pb.CacheLayout(
            dtype=self.dtype, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            kv_dtype=self.kv_dtype,
        )
        if self.kv_scales is not None:
            msg.kv_scales.CopyFrom(scales_message(self.kv_scales))
        return msg

    @property
    def stored_dtype(self) -> int:
        return self.kv_dtype or self.dtype

    def empty_kv(self, name: str, lead: tuple[int, ...] = (0,)) -> WireTensor:
        """No new tokens: a ``[*lead, num_kv_heads, head_dim]`` tensor with no rows, in the
        stored dtype (so a step without tokens merges with steps sending FP8 ones)."""
        shape = (*lead, self.num_kv_heads, self.head_dim)
        dtype = self.stored_dtype
        return WireTensor(name, np.empty(shape, storage_dtype(dtype)), dtype)

    def check(self, t: Tensor, kv: bool) -> None:
        """AttentionInputError naming ``t`` when it does not fit: dtype, head_dim, kv heads
        (or, for a query, a head count the kv heads divide)."""
        if t.dtype != self.dtype and not (kv and t.dtype == self.stored_dtype):
            held = dtype_name(self.dtype)
            if kv and self.stored_dtype != self.dtype:
                held += f" (or {dtype_name(self.stored_dtype)}, as they are stored)"
            raise AttentionInputError(
                f"{t.name} has dtype {dtype_name(t.dtype)}, but the caches take {held}"
            )
        heads, dim = t.shape[-2], t.shape[-1]
        if dim != self.head_dim:
            raise AttentionInputError(
                f"{t.name} has head_dim {dim} (shape {t.shape}), but the caches have "
                f"head_dim {self.head_dim}"
            )
        if kv and heads != self.num_kv_heads:
            raise AttentionInputError(
                f"{t.name} has {heads} kv heads (shape {t.shape}), but the caches have "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if not kv and heads % self.num_kv_heads:
            raise AttentionInputError(
                f"{t.name} has {heads} heads (shape {t.shape}), not a multiple of the caches' "
                f"num_kv_heads {self.num_kv_heads}"
            )


@dataclass(frozen=True)
class CacheTarget:
    """The caches a cache op runs against (one per sequence), and whether the new tokens are
    kept. ``layout``, when known, is what the tensors are checked against before sending."""

    ids: tuple[str, ...]
    store: bool = True
    layout: KvLayout | None = None

    def message(self) -> pb.CacheTarget:
        return pb.CacheTarget(cache_ids=self.ids, store=self.store)


def _positive(x: Any, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int | np.integer) or x < 1:
        raise AttentionInputError(f"{name} must be a positive integer, got {x!r}")
    return int(x)


def as_cache_ids(ids: Any, name: str = "ids") -> tuple[str, ...]:
    """A str or a sequence of str -> a tuple; AttentionInputError naming ``name`` for an empty
    list, an id of 0 or over 256 UTF-8 bytes, a non-str, or an id given twice."""
    if isinstance(ids, str):
        ids = (ids,)
    elif isinstance(ids, bytes | bytearray) or not hasattr(ids, "__iter__"):
        raise AttentionInputError(
            f"{name} must be a str or a sequence of str, got {type(ids).__name__}"
        )
    elif isinstance(ids, AbstractSet | Mapping):  # ids go with rows in order: none here
        raise AttentionInputError(
            f"{name} must be a str or a sequence of str, got {type(ids).__name__}: its order "
            "is arbitrary, so which cache got which rows would be too (pass a list)"
        )
    out = tuple(ids)
    if not out:
        raise AttentionInputError(f"{name} is empty: name at least one cache")
    seen: set[str] = set()
    for i, cid in enumerate(out):
        if not isinstance(cid, str):
            raise AttentionInputError(f"{name}[{i}] must be a str, got {type(cid).__name__}")
        try:
            nbytes = len(cid.encode())
        except UnicodeEncodeError:  # a lone surrogate: no UTF-8 form, so no wire form either
            raise AttentionInputError(f"{name}[{i}] is not valid UTF-8 text: {cid!r}") from None
        if not 1 <= nbytes <= MAX_CACHE_ID_BYTES:
            raise AttentionInputError(f"{name}[{i}] must take 1-{MAX_CACHE_ID_BYTES} UTF-8 bytes")
        if cid in seen:
            raise AttentionInputError(f"{name}[{i}] {cid!r} appears twice")
        seen.add(cid)
    return out


# ---- KV-cache ops: tensors checked against the layout if known ----


def check_cu_values(cu: np.ndarray, total: int, name: str, rows_of: str) -> None:
    """The cache ops check boundaries here too: a refused request must not come after its
    caches were created."""
    if cu.size and (cu[0] != 0 or (np.diff(cu) < 0).any() or cu[-1] != total):
        raise AttentionInputError(
            f"{name} must start at 0, never decrease and end at {total} (the rows of "
            f"{rows_of}), got {cu.tolist()}"
        )


def check_layout(target: CacheTarget, q: Tensor | None, k: Tensor, v: Tensor) -> None:
    if target.layout is None:
        return
    if q is not None:
        target.layout.check(q, kv=False)
    target.layout.check(k, kv=True)
    target.layout.check(v, kv=True)


def new_kv(
    k: Any, v: Any, names: tuple[str, str], target: CacheTarget, lead: tuple[int, ...] = (0,)
) -> tuple[Tensor, Tensor] | None:
    """No new tokens (k and v both None): empty k and v of the caches' layout. None when k and
    v are given."""
    if (k is None) != (v is None):
        raise AttentionInputError(f"{names[0]} and {names[1]} must both be given, or both be None")
    if k is not None:
        return None
    if target.layout is None:
        raise AttentionInputError(
            f"{names[0]}/{names[1]} None (no new tokens) needs the caches' layout "
            "(use a kv_cache handle)"
        )
    return target.layout.empty_kv(names[0], lead), target.layout.empty_kv(names[1], lead)


def count_check(sequences: int, target: CacheTarget, what: str) -> None:
    if sequences != len(target.ids):
        raise AttentionInputError(
            f"ids names {len(target.ids)} caches, but {what} has {sequences} sequences: "
            "name one cache per sequence"
        )
