"""Drop-in entry points for code written against ``flash_attn`` or torch's ``varlen_attn``,
computed by a remote attention server, and a ``torch.library`` custom op so that
``torch.compile``d models can call it.

    from attention_client.flash import flash_attn_varlen_func, set_client
    set_client(AttentionClient("gpu-box:50051"))          # or ATTENTION_TARGET=gpu-box:50051
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 causal=True, window_size=(256, 0))

Same argument names, order and defaults as ``flash_attn.flash_attn_varlen_func`` /
``flash_attn_func`` / ``flash_attn_with_kvcache`` and the packed forms (2.x) and
``torch.nn.attention.varlen.varlen_attn``. What a remote inference op cannot do is refused with
``NotImplementedError`` naming the argument: dropout, rotary embedding, a local paged cache in
torch's ``varlen_attn`` (``block_table``: keep the cache on the server instead,
``client.kv_cache``), and inputs that require grad while grad is enabled (the op is
forward-only: an output that claimed ``requires_grad`` would fail only at ``backward()``).
``return_attn_probs=True`` returns flash_attn's ``(out, softmax_lse, S_dmask)`` with ``S_dmask``
None (it only means something with dropout, which is refused): lse is float32 ``[H, total_q]``
(varlen) or ``[B, H, N_q]``, +inf for a query that sees no key (flash_attn 2's value; the
service's own calls give -inf). ``max_seqlen_*`` (any one integer, as flash_attn takes them) are
accepted and checked against ``cu_seqlens`` (the server derives them). FP8 attention takes
FlashAttention-3's keyword arguments: float8_e4m3fn q, k, v with ``q_descale`` /
``k_descale`` / ``v_descale`` (float32 ``[batch, H_kv]``, one row per sequence, or
``[H_kv]``; None: 1) and a bfloat16 output.
Needs torch (the rest of the client does not).
"""

from __future__ import annotations

import atexit
import contextlib
import operator
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from attention_client._errors import AttentionInputError
from attention_client._requests import as_flag
from attention_client.client import AttentionClient

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "get_client",
    "set_client",
    "use_client",
    "varlen_attn",
]

_lock = threading.Lock()
_default: AttentionClient | None = None
_local = threading.local()


def set_client(client: AttentionClient | None) -> None:
    """The client these functions (and the custom op) use when not given one."""
    global _default
    with _lock:
        _default = client


@contextlib.contextmanager
def use_client(client: AttentionClient) -> Iterator[AttentionClient]:
    """Route the calls of this thread through ``client`` inside the block."""
    previous = getattr(_local, "client", None)
    _local.client = client
    try:
        yield client
    finally:
        _local.client = previous


def get_client() -> AttentionClient:
    """This thread's client (``use_client``), else the default (``set_client``), else one
    made on first use from ``ATTENTION_TARGET`` (and ``ATTENTION_TOKEN``, plaintext)."""
    global _default
    local = getattr(_local, "client", None)
    if local is not None:
        return local
    with _lock:
        if _default is None:
            target = os.environ.get("ATTENTION_TARGET")
            if not target:
                raise RuntimeError(
                    "no attention server: call attention_client.flash.set_client(client), use "
                    "use_client(client), or set ATTENTION_TARGET=host:port"
                )
            _default = AttentionClient(target, token=os.environ.get("ATTENTION_TOKEN") or None)
            # Closed before the interpreter tears gRPC down: a stream still open then can print
            # "Exception ignored in ... _Rendezvous.__del__" at exit (a user's report).
            atexit.register(_default.close)
        return _default


# ---- the custom op: what torch.compile sees -----------------------------------------------

@torch.library.custom_op("attention_client::varlen_attention", mutates_args=())
def _varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, causal: bool, softmax_scale: float | None, window_left: int,
    window_right: int, softcap: float, alibi_slopes: torch.Tensor | None,
) -> torch.Tensor:
    out = get_client().attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
    )
    return out.contiguous()  # a fresh tensor: a custom op's output may not alias an input


@_varlen_attention.register_fake
def _varlen_attention_fake(q: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(q)


varlen_attention = torch.ops.attention_client.varlen_attention


def _refuse(name: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"{name}: {why}")


def _refuse_block_table(block_table: torch.Tensor | None) -> None:
    if block_table is not None:
        raise _refuse("block_table", "a local paged KV cache cannot be read remotely; keep "
                      "the cache on the server (client.kv_cache / decode_step)")


def _refuse_grad(**tensors: torch.Tensor | None) -> None:
    """Forward-only: an input that requires grad (with grad enabled) is refused now, naming
    it, rather than an output claiming a ``requires_grad`` whose backward cannot run."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise _refuse(f"{name}.requires_grad", "the remote op is forward-only (no "
                          "backward); call it under torch.no_grad() or "
                          "torch.inference_mode(), or pass detached tensors")


def _check_max(name: str, value: Any, cu: torch.Tensor) -> None:
    """Any integer flash_attn takes (an int, a numpy integer, a 0-d integer tensor such as
    ``seqlens.max()``), at least the longest sequence in ``cu``."""
    if value is None or torch.compiler.is_compiling():
        return  # a data-dependent check: left out of compiled graphs (the server checks cu)
    longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < longest:
        raise AttentionInputError(
            f"{name} must be an int >= the longest sequence ({longest}), got {value!r}"
        )


def _descales(q: torch.Tensor, k: torch.Tensor, batch: int, **descales: torch.Tensor | None
              ) -> dict[str, torch.Tensor]:
    """FlashAttention-3's descale factors as the client's ``q_scale`` / ``k_scale`` /
    ``v_scale``: each float32 ``[batch, H_kv]`` (a row per sequence, sent so when rows
    differ) or ``[H_kv]``, None meaning 1, for float8_e4m3fn inputs only."""
    fp8_kv = k.dtype == torch.float8_e4m3fn
    fp8_q = q.dtype == torch.float8_e4m3fn
    heads = k.shape[-2]
    out = {}
    for name, d in descales.items():
        wanted = fp8_q if name == "q_descale" else fp8_kv
        if not wanted:
            if d is not None:
                raise AttentionInputError(f"{name} is for float8_e4m3fn {name[0]}; "
                                          f"{name[0]} is {(q if name[0] == 'q' else k).dtype}")
            continue
        if d is None:
            d = torch.ones(heads)
        if (not isinstance(d, torch.Tensor) or d.dtype != torch.float32
                or d.shape[-1:] != (heads,) or d.dim() > 2):
            raise AttentionInputError(f"{name} must be a float32 tensor [batch, {heads}] or "
                                      f"[{heads}] (num_heads_k), got {d!r}")
        if d.dim() == 2 and d.shape[0] != batch:
            raise AttentionInputError(f"{name} has {d.shape[0]} rows for {batch} sequences: "
                                      f"give [{batch}, {heads}] or [{heads}]")
        if d.dim() == 2 and (not d.shape[0] or bool((d == d[:1]).all())):
            d = d[0] if d.shape[0] else torch.ones(heads)  # one row for every sequence
        out[name[0] + "_scale"] = d.detach().float().cpu()
    return out


def _varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    *, causal: bool, softmax_scale: float | None, window_size: Any, softcap: float,
    alibi_slopes: Any, return_lse: bool, client: AttentionClient | None,
    descales: dict[str, torch.Tensor | None] | None = None,
) -> Any:
    _refuse_grad(q=q, k=k, v=v, alibi_slopes=alibi_slopes)
    left, right = (int(x) for x in window_size)
    scales = _descales(q, k, len(cu_q) - 1, **(descales or {}))
    if client is None and not return_lse and not scales:
        return varlen_attention(q, k, v, cu_q, cu_k, as_flag(causal, "causal"), softmax_scale,
                                left, right, float(softcap), alibi_slopes)
    return (client or get_client()).attention(
        q, k, v, cu_q, cu_k, causal=causal, softmax_scale=softmax_scale,
        window_size=(left, right), softcap=softcap, alibi_slopes=alibi_slopes,
        return_lse=return_lse, **scales,
    )


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    client: AttentionClient | None = None,
) -> Any:
    """``flash_attn.flash_attn_varlen_func``: q ``[total_q, H, D]``, k/v ``[total_k, H_kv, D]``,
    int32 ``cu_seqlens_*``; with ``block_table`` ``[B, max_blocks]`` int32, k/v are flash_attn's
    pages ``[num_blocks, block_size, H_kv, D]`` and each sequence's keys the first
    ``cu_seqlens_k`` lengths of its pages: those pages' rows are sent (gathered here; the
    server's paged kernels serve its own caches). Returns out ``[total_q, H, D]``, or with
    ``return_attn_probs``
    ``(out, softmax_lse [H, total_q] float32, None)``. ``deterministic`` is accepted (the
    forward pass is deterministic anyway). FP8 (float8_e4m3fn) inputs take FlashAttention-3's
    ``q_descale`` / ``k_descale`` / ``v_descale`` (``_descales``)."""
    if dropout_p:
        raise _refuse("dropout_p", f"{dropout_p}: the remote op is inference only; pass 0.0")
    _check_max("max_seqlen_q", max_seqlen_q, cu_seqlens_q)
    _check_max("max_seqlen_k", max_seqlen_k, cu_seqlens_k)
    if block_table is not None:  # flash_attn's paged layout: the keys the call reads, packed
        k, v = _paged_keys(k, v, block_table, cu_seqlens_k)
    res = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal,
                  softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                  alibi_slopes=alibi_slopes, return_lse=bool(return_attn_probs), client=client,
                  descales={"q_descale": q_descale, "k_descale": k_descale,
                            "v_descale": v_descale})
    if return_attn_probs:
        out, lse = res
        return out, _flash_lse(lse), None  # flash_attn's S_dmask: only with dropout
    return res


def _flash_lse(lse: torch.Tensor) -> torch.Tensor:
    """flash_attn 2's lse of a query that sees no key: +inf (the service's: -inf, log 0)."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    client: AttentionClient | None = None,
) -> Any:
    """``flash_attn.flash_attn_func``: q ``[B, N_q, H, D]``, k/v ``[B, N_k, H_kv, D]``; with
    ``return_attn_probs`` ``(out, softmax_lse [B, H, N_q] float32, None)``; FP8 inputs with
    FlashAttention-3's descale factors as in ``flash_attn_varlen_func``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise AttentionInputError(
            f"q, k, v must be 4-D [batch, seqlen, heads, head_dim], got {list(q.shape)}, "
            f"{list(k.shape)}, {list(v.shape)}"
        )
    batch, n_q, n_k = q.shape[0], q.shape[1], k.shape[1]
    if k.shape[0] != batch or v.shape[:2] != k.shape[:2]:
        raise AttentionInputError(
            f"k and v must be [batch={batch}, seqlen_k, H_kv, D] with one seqlen_k, got "
            f"{list(k.shape)}, {list(v.shape)}")
    cu_q = torch.arange(batch + 1, dtype=torch.int32) * n_q
    cu_k = torch.arange(batch + 1, dtype=torch.int32) * n_k
    res = flash_attn_varlen_func(
        q.reshape(batch * n_q, *q.shape[2:]), k.reshape(batch * n_k, *k.shape[2:]),
        v.reshape(batch * n_k, *v.shape[2:]), cu_q, cu_k, n_q, n_k, dropout_p, softmax_scale,
        causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, client=client,
    )
    if return_attn_probs:
        out, lse, _ = res  # lse [H, B * N_q] -> flash_attn's [B, H, N_q]
        heads = q.shape[2]
        return (out.reshape(q.shape),
                lse.reshape(heads, batch, n_q).transpose(0, 1).contiguous(), None)
    return res.reshape(q.shape)


def _unpack(t: torch.Tensor, name: str, parts: int, dims: int) -> tuple[torch.Tensor, ...]:
    """``t``'s ``parts`` tensors along dim ``dims - 3`` (flash_attn's packed layouts: qkv
    ``[B, S, 3, H, D]`` / ``[total, 3, H, D]``, kv with 2), as views."""
    axis = dims - 3
    if not isinstance(t, torch.Tensor) or t.dim() != dims or t.shape[axis] != parts:
        raise AttentionInputError(
            f"{name} must be {dims}-D with {parts} at dim {axis} (flash_attn's packed layout), "
            f"got {list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    return t.unbind(axis)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
    return_attn_probs: bool = False, *, client: AttentionClient | None = None,
) -> Any:
    """``flash_attn.flash_attn_qkvpacked_func``: qkv ``[B, S, 3, H, D]``; as
    ``flash_attn_func``."""
    q, k, v = _unpack(qkv, "qkv", 3, 5)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, client=client)


def flash_attn_kvpacked_func(
    q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
    softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
    return_attn_probs: bool = False, *, client: AttentionClient | None = None,
) -> Any:
    """``flash_attn.flash_attn_kvpacked_func``: q ``[B, S_q, H, D]``, kv ``[B, S_k, 2, H_kv,
    D]``; as ``flash_attn_func``."""
    k, v = _unpack(kv, "kv", 2, 5)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs, client=client)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, dropout_p: float = 0.0,
    softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
    return_attn_probs: bool = False, *, client: AttentionClient | None = None,
) -> Any:
    """``flash_attn.flash_attn_varlen_qkvpacked_func``: qkv ``[total, 3, H, D]``, one
    ``cu_seqlens`` for queries and keys; as ``flash_attn_varlen_func``."""
    q, k, v = _unpack(qkv, "qkv", 3, 4)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs,
                                  client=client)


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
    softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
    return_attn_probs: bool = False, *, client: AttentionClient | None = None,
) -> Any:
    """``flash_attn.flash_attn_varlen_kvpacked_func``: q ``[total_q, H, D]``, kv ``[total_k,
    2, H_kv, D]``; as ``flash_attn_varlen_func``."""
    k, v = _unpack(kv, "kv", 2, 4)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs,
                                  client=client)


def _paged_keys(k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                cu_seqlens_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's first ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` keys from its pages
    (``k_pages``/``v_pages`` ``[num_blocks, block_size, H_kv, D]``, ``block_table`` ``[B,
    max_blocks]``), packed ``[total_k, H_kv, D]``: only the pages the call reads are sent."""
    if k_pages.dim() != 4 or v_pages.shape != k_pages.shape:
        raise AttentionInputError(
            f"with block_table, k and v must be one shape [num_blocks, block_size, H_kv, D], "
            f"got {list(k_pages.shape)}, {list(v_pages.shape)}")
    lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).detach().to("cpu", torch.int64)
    page = k_pages.shape[1]
    if block_table.dim() != 2 or block_table.shape[0] != len(lens) or bool(
            (lens > block_table.shape[1] * page).any()) or bool((lens < 0).any()):
        raise AttentionInputError(
            f"block_table must be [{len(lens)}, max_blocks] with room for each sequence's keys "
            f"({lens.tolist()} at {page} per block), got {list(block_table.shape)}")
    table = _block_ids(block_table)
    pos = torch.cat([torch.arange(int(n)) for n in lens] or [torch.zeros(0, dtype=torch.int64)])
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
    at = _page_slots(table, seq, pos, k_pages)
    return k_pages[at], v_pages[at]


def _block_ids(block_table: torch.Tensor) -> torch.Tensor:
    """``block_table`` as CPU int64, refused unless it holds integers (a float table's ids
    would be truncated silently)."""
    if block_table.dtype.is_floating_point or block_table.dtype == torch.bool:
        raise AttentionInputError(f"block_table must hold integer block ids (int32), got "
                                  f"{block_table.dtype}")
    return block_table.detach().to("cpu", torch.int64)


def _page_slots(table: torch.Tensor, seq: torch.Tensor | int, pos: torch.Tensor,
                pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) on ``pages``' device of position ``pos`` of sequence ``seq`` through
    ``table`` (CPU int64), every block checked to name one of ``pages``' blocks."""
    page, num_blocks = pages.shape[1], pages.shape[0]
    ids = table[seq, pos // page]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        bad = ids[(ids < 0) | (ids >= num_blocks)][0]
        raise AttentionInputError(f"block_table names block {int(bad)}, outside the "
                                  f"{num_blocks} blocks of k_cache / k (0..{num_blocks - 1})")
    return ids.to(pages.device), (pos % page).to(pages.device)


def _seqlens(value: Any, batch: int, name: str, default: int) -> torch.Tensor:
    """An int or a [batch] integer tensor (flash_attn's ``cache_seqlens`` / ``cache_leftpad``)
    as a CPU int64 tensor; None: ``default`` for every sequence."""
    if value is None:
        return torch.full((batch,), default, dtype=torch.int64)
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.full((batch,), value, dtype=torch.int64)
    if (not isinstance(value, torch.Tensor) or value.shape != (batch,)
            or value.dtype.is_floating_point or value.dtype == torch.bool):
        raise AttentionInputError(f"{name} must be an int or an integer tensor of shape "
                                  f"[{batch}], got {value!r}")
    return value.detach().to("cpu", torch.int64)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    client: AttentionClient | None = None,
) -> Any:
    """``flash_attn.flash_attn_with_kvcache`` (2.x), the compatibility path for decode code
    that keeps its KV cache locally: each sequence's keys from ``cache_leftpad`` to its new
    end (the cached ones, then the new ``k``/``v`` ``[B, S_new, H_kv, D]``) are sent with q
    ``[B, S_q, H, D]`` and attended remotely (``causal``: the queries are the last S_q
    positions); once that succeeded the new ``k``/``v`` are written into ``k_cache``/``v_cache``
    in place at ``cache_seqlens`` (rows ``cache_batch_idx``, or pages through ``block_table``
    ``[B, max_blocks]`` with the caches ``[num_blocks, block_size, H_kv, D]``). Returns out
    ``[B, S_q, H, D]``, with ``return_softmax_lse`` also lse ``[B, H, S_q]`` float32. Every
    step sends the whole context: a KV cache kept on the server (``client.kv_cache``,
    ``decode_steps``) sends only q and the new tokens (docs/client.md). Rotary embedding is
    not applied here: ``rotary_cos``/``rotary_sin`` raise NotImplementedError; ``num_splits``
    is accepted (the server chooses). FP8 caches (and queries) take FlashAttention-3's
    ``q_descale`` / ``k_descale`` / ``v_descale``, as in
    ``flash_attn_varlen_func``."""
    if rotary_cos is not None or rotary_sin is not None:
        raise _refuse("rotary_cos" if rotary_cos is not None else "rotary_sin",
                      "rotary embedding is not applied by the remote op; rotate q and k "
                      "before the call")
    if (k is None) != (v is None):
        raise AttentionInputError("k and v must be given together (or neither)")
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise AttentionInputError(
            f"q must be [B, S_q, H, D] and k_cache, v_cache one shape [B_cache, S_cache, H_kv, "
            f"D] (paged: [num_blocks, block_size, H_kv, D]), got {list(q.shape)}, "
            f"{list(k_cache.shape)}, {list(v_cache.shape)}")
    batch, s_q = q.shape[0], q.shape[1]
    if q.shape[3] != k_cache.shape[3] or q.shape[2] % k_cache.shape[2]:
        raise AttentionInputError(
            f"q [B, S_q, H, D] must have k_cache's head dim and a multiple of its heads, got "
            f"{list(q.shape)} against {list(k_cache.shape)}")
    paged = block_table is not None
    if paged and cache_batch_idx is not None:
        raise AttentionInputError("cache_batch_idx cannot be used with block_table")
    if paged and (block_table.dim() != 2 or block_table.shape[0] != batch):  # type: ignore[union-attr]
        raise AttentionInputError(f"block_table must be [{batch}, max_blocks], got "
                                  f"{list(block_table.shape)}")  # type: ignore[union-attr]
    s_new = 0
    if k is not None:
        if k.dim() != 4 or k.shape[0] != batch or v.shape != k.shape:  # type: ignore[union-attr]
            raise AttentionInputError(f"k and v must be one shape [{batch}, S_new, H_kv, D], "
                                      f"got {list(k.shape)}, {list(v.shape)}")  # type: ignore[union-attr]
        if k.shape[2:] != k_cache.shape[2:] or k.dtype != k_cache.dtype or \
                v.dtype != v_cache.dtype:  # type: ignore[union-attr]
            raise AttentionInputError(
                f"k and v must have k_cache's heads, head dim and dtype ({list(k_cache.shape[2:])}"
                f" {k_cache.dtype}), got {list(k.shape[2:])} {k.dtype}, {v.dtype}")  # type: ignore[union-attr]
        s_new = k.shape[1]
    page = k_cache.shape[1]
    capacity = block_table.shape[1] * page if paged else k_cache.shape[1]  # type: ignore[union-attr]
    lens = _seqlens(cache_seqlens, batch, "cache_seqlens", capacity - s_new)
    starts = _seqlens(cache_leftpad, batch, "cache_leftpad", 0)
    rows = _cache_rows(cache_batch_idx, batch, k_cache.shape[0], paged)
    ends = lens + s_new
    if bool((lens < 0).any()) or bool((ends > capacity).any()) or bool((starts < 0).any()) or \
            bool((starts > lens).any()):
        raise AttentionInputError(
            f"cache_seqlens {lens.tolist()} (+ {s_new} new) and cache_leftpad "
            f"{starts.tolist()} must fit the cache's {capacity} positions")
    table = _block_ids(block_table) if paged else None  # type: ignore[arg-type]
    # Where each sequence's cached keys are and its new ones go, every block id checked first;
    # the new tokens are written into the caches only once the call has succeeded (a refused
    # or failed call leaves them as they were).
    places = []
    for b in range(batch):
        if paged:
            at = _page_slots(table, b, torch.arange(int(starts[b]), int(ends[b])),  # type: ignore[arg-type]
                             k_cache)
            old = int(lens[b] - starts[b])
            places.append(((at[0][:old], at[1][:old]), (at[0][old:], at[1][old:])))
        else:
            row = int(rows[b])
            places.append(((row, slice(int(starts[b]), int(lens[b]))),
                           (row, slice(int(lens[b]), int(ends[b])))))
    keys = [k_cache[c] for c, _ in places]
    values = [v_cache[c] for c, _ in places]
    if s_new:
        keys = [x for b, c in enumerate(keys) for x in (c, k[b])]  # type: ignore[index]
        values = [x for b, c in enumerate(values) for x in (c, v[b])]  # type: ignore[index]
    cu_k = [0]
    for b in range(batch):
        cu_k.append(cu_k[-1] + int(ends[b] - starts[b]))
    cu_q = torch.arange(batch + 1, dtype=torch.int32) * s_q
    res = _varlen(q.reshape(batch * s_q, *q.shape[2:]), torch.cat(keys), torch.cat(values),
                  cu_q, torch.tensor(cu_k, dtype=torch.int32), causal=causal,
                  softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                  alibi_slopes=alibi_slopes, return_lse=return_softmax_lse, client=client,
                  descales={"q_descale": q_descale, "k_descale": k_descale,
                            "v_descale": v_descale})
    if s_new:
        for b, (_, fresh) in enumerate(places):
            k_cache[fresh] = k[b]  # type: ignore[index]
            v_cache[fresh] = v[b]  # type: ignore[index]
    if not return_softmax_lse:
        return res.reshape(q.shape)
    out, lse = res  # lse [H, B * S_q] -> flash_attn's [B, H, S_q]
    lse = _flash_lse(lse.reshape(q.shape[2], batch, s_q).transpose(0, 1).contiguous())
    return out.reshape(q.shape), lse


def _cache_rows(cache_batch_idx: Any, batch: int, cache_rows: int, paged: bool) -> torch.Tensor:
    """The cache row of each sequence (``cache_batch_idx``, default 0..batch-1) as CPU int64,
    each inside the cache (a negative index would wrap around silently)."""
    if paged:
        return torch.zeros(0, dtype=torch.int64)
    if cache_batch_idx is None:
        if cache_rows < batch:
            raise AttentionInputError(f"k_cache has {cache_rows} rows for a batch of {batch}: "
                                      "pass cache_batch_idx")
        return torch.arange(batch)
    if (not isinstance(cache_batch_idx, torch.Tensor) or cache_batch_idx.shape != (batch,)
            or cache_batch_idx.dtype.is_floating_point or cache_batch_idx.dtype == torch.bool):
        raise AttentionInputError(f"cache_batch_idx must be an integer tensor of shape "
                                  f"[{batch}], got {cache_batch_idx!r}")
    rows = cache_batch_idx.detach().to("cpu", torch.int64)
    if batch and (int(rows.min()) < 0 or int(rows.max()) >= cache_rows):
        raise AttentionInputError(f"cache_batch_idx must name rows of k_cache (0..{cache_rows - 1}"
                                  f"), got {rows.tolist()}")
    return rows


def varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
    client: AttentionClient | None = None,
) -> Any:
    """``torch.nn.attention.varlen.varlen_attn``: causal is ``window_size=(-1, 0)`` there, as
    here; ``return_aux`` with ``lse=True`` adds lse ``[T_q, H]``. ``seqused_k`` keeps the first
    ``seqused_k[i]`` keys of each sequence. ``num_splits`` is accepted (the server chooses; the
    answer does not depend on it beyond rounding)."""
    _refuse_block_table(block_table)
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise AttentionInputError(
            f"query has {query.shape[1]} heads but key {key.shape[1]}: pass enable_gqa=True "
            "for grouped-query attention"
        )
    cu_k = cu_seq_q if cu_seq_k is None else cu_seq_k
    if seqused_k is not None:
        key, value, cu_k = _used_keys(key, value, cu_k, seqused_k)
    _check_max("max_q", max_q, cu_seq_q)
    want_lse = bool(return_aux is not None and getattr(return_aux, "lse", False))
    res = _varlen(query, key, value, cu_seq_q, cu_k, causal=False, softmax_scale=scale,
                  window_size=window_size, softcap=0.0, alibi_slopes=None,
                  return_lse=want_lse, client=client)
    if want_lse:
        out, lse = res
        return out, lse.transpose(0, 1).contiguous()  # ours [H, T_q], torch's [T_q, H]
    return res


def _used_keys(
    key: torch.Tensor, value: torch.Tensor, cu_k: torch.Tensor, seqused_k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``seqused_k[i]`` keys of each sequence, repacked."""
    starts, used = cu_k[:-1].long().cpu(), seqused_k.long().cpu()
    room = cu_k[1:].long().cpu() - starts
    if used.shape != starts.shape or bool((used < 0).any()) or bool((used > room).any()):
        raise AttentionInputError(
            f"seqused_k must hold one count per sequence in [0, its key length], got "
            f"{seqused_k.tolist()}"
        )
    index = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), used.tolist(),
                                                                 strict=True)]
                      or [torch.zeros(0, dtype=torch.long)])  # no sequences: no keys
    index = index.to(key.device)
    cu = torch.zeros(len(used) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(used, 0)
    return key.index_select(0, index), value.index_select(0, index), cu.to(cu_k.device)
