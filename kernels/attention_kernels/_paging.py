"""Block-table addressing shared by the paged paths of the prefill and decode kernels.

Paged layout (FlashAttention's ``flash_attn_with_kvcache`` / vLLM): ``k_pages, v_pages
[num_pages, PAGE_TOKENS, H_kv, D]`` with any page/token/head strides, and an int32 block table
whose row ``b`` lists sequence ``b``'s pages in order, so key ``j`` lives at slot
``j % PAGE_TOKENS`` of page ``table[b, j // PAGE_TOKENS]``. Entries past a sequence's length
are not part of the contract (often -1 or stale), so they must never be read.

``PAGE_TOKENS`` is a compile-time constant: a server has one page size per layout, and a
constant divisor turns ``//`` and ``%`` into a multiply and shift (a shift and mask for powers
of two) instead of a runtime integer division per key.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_pages(table_row, start_n, offs_n, end, PAGE_TOKENS: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Pages (int64) of keys ``start_n + offs_n`` (``start_n`` a multiple of ``BLOCK_N``): a
    scalar when the block sits inside one page, else one per key. Only entries of keys below
    ``end`` (the sequence length) are read; the others give page 0, a valid address that is
    never loaded (those keys' K/V loads are masked)."""
    if PAGE_TOKENS % BLOCK_N == 0:
        page = tl.load(table_row + start_n // PAGE_TOKENS, mask=start_n < end, other=0)
    else:
        pos = start_n + offs_n
        page = tl.load(table_row + pos // PAGE_TOKENS, mask=pos < end, other=0)
    return page.to(tl.int64)


@triton.jit
def block_rows(page, start_n, offs_n, stride_p, stride_t, PAGE_TOKENS: tl.constexpr):
    """int64 ``[BLOCK_N]`` element offsets of the rows of keys ``start_n + offs_n``."""
    slot = ((start_n + offs_n) % PAGE_TOKENS).to(tl.int64)
    return page * stride_p + slot * stride_t
