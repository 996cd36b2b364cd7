"""The small rpcs' replies as plain Python values: GetServerInfo (``server_info_dict``),
a cache's CacheInfo (``cache_info_dict``) and the cache pool's KvPoolInfo (``pool_info_dict``).
A compute call's reply is read by its ``_requests.PreparedRequest`` (``add_reply``)."""

from __future__ import annotations

from typing import Any

from attention_wire.pb import attention_pb2 as pb


def server_info_dict(info: pb.ServerInfo) -> dict[str, Any]:
    """GetServerInfo as plain Python values; dtypes by name ("FLOAT16", ...)."""
    out: dict[str, Any] = {}
    for field in info.DESCRIPTOR.fields:
        value = getattr(info, field.name)
        if field.name == "dtypes":
            value = [pb.DType.Name(d) for d in value]
        elif field.message_type is not None:  # nixl_transports: each as a dict
            value = [{f.name: getattr(m, f.name) for f in m.DESCRIPTOR.fields} for m in value]
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
