"""Response assembler: OUT/LSE row slices -> preallocated arrays, with every row checked.

Each slice (parsed by ``attention_wire.messages`` without copying its bytes) is copied
straight into its rows of the final array: the one copy on the client. Every row must arrive
exactly once and the stream must end with RequestStats; anything else raises ProtocolError,
never a silently wrong tensor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from attention_client._errors import ProtocolError
from attention_client._tensors import dtype_name, storage_dtype
from attention_wire.messages import OutputSlice
from attention_wire.pb import attention_pb2 as pb


class _Target:
    """One output tensor being filled: its storage, a [rows, row_bytes] byte view, rows seen."""

    def __init__(self, name: str, shape: tuple[int, ...], wire_dtype: int) -> None:
        self.name = name
        self.shape = tuple(int(d) for d in shape)
        self.wire_dtype = wire_dtype
        self.array = np.empty(self.shape, storage_dtype(wire_dtype))
        self.rows = self.shape[0]
        self.row_bytes = math.prod(self.shape[1:]) * self.array.itemsize
        self.bytes = self.array.reshape(-1).view(np.uint8).reshape(self.rows, self.row_bytes)
        self.seen = np.zeros(self.rows, dtype=bool)

    def add(self, chunk: OutputSlice, method: str) -> None:
        if chunk.dtype != self.wire_dtype or chunk.shape != self.shape:
            raise ProtocolError(
                f"{self.name} chunk has spec {_name(chunk.dtype)}{list(chunk.shape)}, "
                f"expected {dtype_name(self.wire_dtype)}{list(self.shape)}",
                method,
            )
        start, count = chunk.row_start, chunk.row_count
        if start < 0 or count < 0 or start + count > self.rows:
            raise ProtocolError(
                f"{self.name} rows [{start}, {start + count}) outside [0, {self.rows})", method
            )
        data = chunk.data
        if len(data) != count * self.row_bytes:
            raise ProtocolError(
                f"{self.name} rows [{start}, {start + count}) carry {len(data)} bytes, "
                f"expected {count * self.row_bytes}",
                method,
            )
        if self.seen[start : start + count].any():
            raise ProtocolError(
                f"{self.name} rows [{start}, {start + count}) arrived more than once", method
            )
        self.seen[start : start + count] = True
        if count:
            self.bytes[start : start + count] = np.frombuffer(data, np.uint8).reshape(
                count, self.row_bytes
            )

    def check_complete(self, method: str) -> None:
        if self.row_bytes == 0 or self.seen.all():  # zero-width rows carry nothing to wait for
            return
        missing = np.flatnonzero(~self.seen)
        raise ProtocolError(
            f"{self.name} is missing {missing.size} of {self.rows} rows "
            f"(first missing row {int(missing[0])})",
            method,
        )


def _name(dtype: int) -> str:
    return dtype_name(dtype) if dtype in pb.DType.values() else f"dtype {dtype}"


def stats_dict(stats: pb.RequestStats) -> dict[str, Any]:
    """The stats as plain Python values (repeated fields as lists)."""
    out = {name: getattr(stats, name) for name in _STATS_SCALARS}
    for name in _STATS_LISTS:
        out[name] = list(getattr(stats, name))
    return out


def _is_repeated(field: Any) -> bool:
    # FieldDescriptor.label is deprecated in newer protobuf; is_repeated replaces it.
    rep = getattr(field, "is_repeated", None)
    return bool(rep) if rep is not None else field.label == field.LABEL_REPEATED


# RequestStats' fields by kind, read once (every call's stats go through stats_dict).
_STATS_SCALARS = tuple(f.name for f in pb.RequestStats.DESCRIPTOR.fields if not _is_repeated(f))
_STATS_LISTS = tuple(f.name for f in pb.RequestStats.DESCRIPTOR.fields if _is_repeated(f))


class ResponseAssembler:
    """Feed every parsed response (``responses.parse_response``) to ``add``; ``finish`` returns
    (out, lse, stats). A shape of None: that output is not streamed (it went into a region,
    or lse was not asked for) and must not arrive."""

    def __init__(
        self,
        method: str,
        out_shape: tuple[int, ...] | None,
        out_dtype: int,
        lse_shape: tuple[int, ...] | None,
    ) -> None:
        self.method = method
        self._targets: dict[int, _Target] = {}
        if out_shape is not None:
            self._targets[pb.OUT] = _Target("OUT", out_shape, out_dtype)
        if lse_shape is not None:
            self._targets[pb.LSE] = _Target("LSE", lse_shape, pb.FLOAT32)
        self._stats: pb.RequestStats | None = None

    def add(self, response: OutputSlice | pb.RequestStats | None) -> None:
        if self._stats is not None:
            raise ProtocolError("message after the final RequestStats", self.method)
        if isinstance(response, pb.RequestStats):
            self._stats = response
            return
        if response is None:
            raise ProtocolError("response message with no payload", self.method)
        chunk = response
        target = self._targets.get(chunk.field)
        if target is None:
            raise ProtocolError(
                f"unexpected output field {pb.OutputField.Name(chunk.field)}"
                if chunk.field in pb.OutputField.values()
                else f"unknown output field {chunk.field}",
                self.method,
            )
        target.add(chunk, self.method)

    def finish(self) -> tuple[np.ndarray | None, np.ndarray | None, dict[str, Any]]:
        for target in self._targets.values():
            target.check_complete(self.method)
        if self._stats is None:
            raise ProtocolError("response stream ended without RequestStats", self.method)
        out, lse = self._targets.get(pb.OUT), self._targets.get(pb.LSE)
        return (
            out.array if out is not None else None,
            lse.array if lse is not None else None,
            stats_dict(self._stats),
        )


def server_info_dict(info: pb.ServerInfo) -> dict[str, Any]:
    """GetServerInfo as plain Python values; dtypes by name ("FLOAT16", ...)."""
    out: dict[str, Any] = {}
    for field in info.DESCRIPTOR.fields:
        value = getattr(info, field.name)
        if field.name == "dtypes":
            value = [pb.DType.Name(d) for d in value]
        elif not isinstance(value, str | bytes | int | float | bool):
            value = list(value)
        out[field.name] = value
    return out


def cache_info_dict(info: pb.CacheInfo) -> dict[str, Any]:
    """CacheInfo as plain values, its layout flattened (dtypes by name: "FLOAT16", ...;
    kv_dtype is what keys and values are stored in; k_scale/v_scale only for FP8)."""
    lay = info.layout
    fp8 = {"k_scale": list(lay.kv_scales.k), "v_scale": list(lay.kv_scales.v)}
    return {
        "cache_id": info.cache_id,
        "dtype": pb.DType.Name(lay.dtype),
        "kv_dtype": pb.DType.Name(lay.kv_dtype or lay.dtype),
        **(fp8 if lay.HasField("kv_scales") else {}),
        "num_kv_heads": info.layout.num_kv_heads,
        "head_dim": info.layout.head_dim,
        "length": info.length,
        "pages": info.pages,
        "shared_pages": info.shared_pages,
        "idle_seconds": info.idle_seconds,
        "busy": info.busy,
    }


def pool_info_dict(pool: pb.KvPoolInfo) -> dict[str, Any]:
    """KvPoolInfo as a dict (page_bytes, pages_total/used/free, caches_live, ttl_seconds,
    caller_pages_used, caller_pages_limit, caller_caches)."""
    return {f.name: getattr(pool, f.name) for f in pool.DESCRIPTOR.fields}
