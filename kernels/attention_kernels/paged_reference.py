"""Plain-torch paged attention: gather the pages into the packed layout, then the reference.

The oracle of the paged kernels in the tests and, with ``gather_pages``, the service's ``cpu``
backend for server-side KV caches, so it needs no Triton. Semantics are those of
``paged_decode`` / ``paged_prefill`` (see ``_paging.py`` for the layout). Unlike the kernels it
validates the values it is given (lengths, and the pages a sequence uses), since it reads them
on the host anyway.
"""

from __future__ import annotations

import torch

from attention_kernels._checks import check_paged_inputs, check_paged_values
from attention_kernels.reference import decode_ref, prefill_ref


def gather_pages(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seqlens_k: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys and values of every sequence, packed: ``(k [total_k, H_kv, D], v, cu_seqlens_k
    int32 [batch + 1])``, on the pages' device.

    One gather per tensor with (page, slot) index pairs, so the pool is never copied or
    reshaped whatever its strides; only table entries within a sequence's length are read.
    Reads ``seqlens_k`` and ``block_table`` values on the host (a sync for GPU tensors).
    """
    if k_pages.dim() != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must be 4-D [num_pages, page_tokens, "
                         f"num_kv_heads, head_dim] of one shape, got {tuple(k_pages.shape)} "
                         f"and {tuple(v_pages.shape)}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table must be int32 [batch, max_pages_per_seq], got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if (seqlens_k.dtype != torch.int32 or seqlens_k.dim() != 1
            or seqlens_k.shape[0] != block_table.shape[0]):
        raise ValueError(f"seqlens_k must be int32 [batch={block_table.shape[0]}], got "
                         f"{seqlens_k.dtype} {tuple(seqlens_k.shape)}")
    num_pages, page_tokens = k_pages.shape[0], k_pages.shape[1]
    check_paged_values(block_table, seqlens_k, num_pages, page_tokens)
    device = k_pages.device
    lens = seqlens_k.to(device=device, dtype=torch.int64)
    cu = torch.zeros(lens.shape[0] + 1, dtype=torch.int64, device=device)
    torch.cumsum(lens, 0, out=cu[1:])
    total = int(cu[-1])
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=device), lens,
                                  output_size=total)
    pos = torch.arange(total, device=device) - cu[seq]  # key index within its sequence
    page = block_table.to(device)[seq, pos // page_tokens].long()
    slot = pos % page_tokens
    return k_pages[page, slot], v_pages[page, slot], cu.to(torch.int32)


def paged_decode_ref(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    max_seqlen_k: int | None = None,
    softmax_scale: float | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    compute_dtype: torch.dtype | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``paged_decode`` in plain torch: ``decode_ref`` on the gathered keys/values."""
    check_paged_inputs(q, k_pages, v_pages, block_table, seqlens_k)
    k, v, cu_k = gather_pages(k_pages, v_pages, block_table, seqlens_k)
    return decode_ref(q, k, v, cu_k, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
                      num_splits=num_splits, return_lse=return_lse, compute_dtype=compute_dtype,
                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        k_scale=k_scale, v_scale=v_scale, q_scale=q_scale)


def paged_prefill_ref(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``paged_prefill`` in plain torch: ``prefill_ref`` on the gathered keys/values."""
    check_paged_inputs(q, k_pages, v_pages, block_table, seqlens_k, cu_seqlens_q)
    k, v, cu_k = gather_pages(k_pages, v_pages, block_table, seqlens_k)
    return prefill_ref(q, k, v, cu_seqlens_q, cu_k, max_seqlen_q=max_seqlen_q,
                       max_seqlen_k=max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                       return_lse=return_lse, compute_dtype=compute_dtype,
                       window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        k_scale=k_scale, v_scale=v_scale, q_scale=q_scale)
