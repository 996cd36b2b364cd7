"""Wire field -> argument name, per public call: what ``_errors.translate`` rewrites the
server's messages with (``header.cu_seqlens_q: must start at 0`` from ``client.attention``
reads ``cu_seqlens: must start at 0``).

Keys are wire field paths without the ``header.`` prefix. Identity entries are there so that
the prefix goes (``header.softmax_scale`` -> ``softmax_scale``). A key ``t.shape[i]`` rewrites
that dimension on its own: the 4-D prefill form reaches the server packed as
``[B * N, H, D]``, so the server's ``q.shape[1]`` is the caller's ``q.shape[2]``.
"""

from __future__ import annotations

from collections.abc import Mapping

Names = Mapping[str, str]

_SCALARS = {
    **{n: n for n in ("causal", "softmax_scale", "return_lse", "num_splits")},
    "score.window_left": "window_size[0]", "score.window_right": "window_size[1]",
    "score.softcap": "softcap", "score.alibi_slopes": "alibi_slopes",
    "score": "window_size / softcap / alibi_slopes",
}
# CreateCaches, sent by a cache handle before a call that names a new id.
_LAYOUT = {
    "layout.dtype": "dtype", "layout.num_kv_heads": "num_kv_heads",
    "layout.head_dim": "head_dim",
}


def _packed_4d(*tensors: str) -> dict[str, str]:
    """[B, N, H, D] sent as [B * N, H, D]: the server's dims in the caller's."""
    out: dict[str, str] = {}
    for t in tensors:
        out[f"{t}.shape[0]"] = f"{t}.shape[0] * {t}.shape[1]"
        out[f"{t}.shape[1]"] = f"{t}.shape[2]"
        out[f"{t}.shape[2]"] = f"{t}.shape[3]"
    return out


def attention(four_d: bool = False) -> Names:
    """``client.attention(q, k, v, cu_seqlens, cu_seqlens_k, ...)``."""
    names = {
        "q": "q", "k": "k", "v": "v", "cu_seqlens_q": "cu_seqlens",
        "cu_seqlens_k": "cu_seqlens_k", **_SCALARS,
    }
    return names | _packed_4d("q", "k", "v") if four_d else names


def decode() -> Names:
    """``client.decode(q, k, v, cu_seqlens_k, ...)``."""
    return {"q": "q", "k": "k", "v": "v", "cu_seqlens_k": "cu_seqlens_k", **_SCALARS}


def cache_append(ids: str = "ids") -> Names:
    """``cache.append(ids, k, v, cu_seqlens)``: AppendKV's keys are its cu_seqlens_k."""
    return {
        "k": "k", "v": "v", "cu_seqlens_k": "cu_seqlens", "cache.cache_ids": ids,
        "cache_ids": ids, **_LAYOUT,
    }


def cache_prefill(four_d: bool = False, ids: str = "ids") -> Names:
    """``cache.prefill(q, ids, k, v, cu_seqlens_q, cu_seqlens_k, ...)``."""
    names = {
        "q": "q", "k": "k", "v": "v", "cu_seqlens_q": "cu_seqlens_q",
        "cu_seqlens_k": "cu_seqlens_k", "cache.cache_ids": ids, "cache_ids": ids, **_SCALARS,
        **_LAYOUT,
    }
    return names | _packed_4d("q", "k", "v") if four_d else names


def cache_decode(ids: str = "ids") -> Names:
    """``cache.decode(q, ids, k_new, v_new, ...)`` / ``client.decode_step(q, cache_ids, ...)``."""
    return {
        "q": "q", "k": "k_new", "v": "v_new", "cache.cache_ids": ids, "cache_ids": ids,
        **_SCALARS, **_LAYOUT,
    }


def cache_ids(ids: str = "ids") -> Names:
    """CreateCaches / ReleaseCaches / ListCaches by id."""
    return {"cache_ids": ids, "all": "all", **_LAYOUT}


# The tables the calls use, built once at import (each call only reads its table).
# What ``client.attention`` and ``KvCache.prefill`` pick from by q's rank (packed or [B, N, H, D]).
ATTENTION, ATTENTION_4D = attention(), attention(four_d=True)
CACHE_PREFILL, CACHE_PREFILL_4D = cache_prefill(), cache_prefill(four_d=True)
DECODE = decode()
CACHE_APPEND = cache_append()
CACHE_DECODE = cache_decode()
DECODE_STEP = cache_decode("cache_ids")  # ``client.decode_step``: the caches by ``cache_ids``
CACHE_IDS = cache_ids()
FORK: Names = {"source_id": "source_id", "target_id": "target_id", "length": "length"}
REGISTER: Names = {"byte_size": "nbytes", "name": "name"}
