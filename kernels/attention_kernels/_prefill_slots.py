"""Where a prefill program's tile is: the slot scheme both prefill kernels (the portable Triton
one and the Gluon Hopper one) launch with, and the key range a causal tile visits.

Sequence ``b`` owns the tile slots ``[cu_q[b] // BLOCK_M + b, cu_q[b+1] // BLOCK_M + b + 1)``
(``prefill_kernel``'s module docstring says why), so the grid is known from shapes alone. The
search for a slot's sequence stays in each kernel: it needs a block of indices, and Gluon's
blocks carry a layout where Triton's do not; the scalar helpers below are shared (a Gluon
kernel may call a ``triton.jit`` function on scalars).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Program order: the grid runs ``slot_run`` query-block slots of one head, then the same
# slots of the next head, and so on (slots in reverse, so causal's longest blocks go first).
# 1 (one slot across every head, then the next slot) spreads causal work best; all of them
# (0 here: every slot of a head, then the next head) keeps the ~132 resident programs on one
# head's K/V, which then stay in L2. H100, bf16, ``tune_prefill_order.py``, 2026-11-24, two
# runs, TFLOP/s of all slots over 1: non-causal D128 N 4K / 8K / 16K 1.01-1.04 / 1.03 /
# 1.05-1.06, D64 1.03-1.05 / 1.04-1.07 / 1.04-1.06; causal 0.96-1.03 (GQA 32/8 0.98,
# varlen [8192, 16 x 4] 0.94-0.96, runs of 4-32 slots no better): keyed by "masked" (causal
# or a window).
SLOT_RUN = {False: 0, True: 1}


def slot_grid(total_q: int, batch: int, num_heads: int, block_m: int,
              masked: bool) -> tuple[int, int, int]:
    """``(num_slots, slot_run, programs)`` of a launch: its slot count, the ``SLOT_RUN`` order
    for ``masked`` (causal or a window), and the grid size (the last run's spare programs find
    ``slot < 0`` and return)."""
    num_slots = total_q // block_m + batch + 1
    slot_run = SLOT_RUN[masked] or num_slots
    runs = -(-num_slots // slot_run)
    return num_slots, slot_run, runs * slot_run * num_heads


@triton.jit
def program_tile(pid, slot_run, num_heads, num_slots):
    """``(head, slot)`` of program ``pid``: runs of ``slot_run`` slots of one head, slots in
    reverse so each sequence's last query blocks (most causal work) go first. ``slot < 0``:
    a spare program."""
    run = pid // slot_run
    head = run % num_heads
    slot = num_slots - 1 - ((run // num_heads) * slot_run + pid % slot_run)
    return head, slot


@triton.jit
def causal_key_range(first_row, seqlen_q, seqlen_k, ROWS: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """``(n_full, n_end)`` for the query rows ``first_row .. first_row + ROWS`` (bottom-right
    causal when ``IS_CAUSAL``; rows below 0 or past ``seqlen_q`` do not exist): keys
    ``[0, n_full)`` are visible to every row, ``[n_full, n_end)`` to some. A caller with no
    existing row must not use ``n_end``."""
    if IS_CAUSAL:
        causal_offset = seqlen_k - seqlen_q
        last_row_end = tl.minimum(first_row + ROWS, seqlen_q)
        n_full = tl.minimum(tl.maximum(tl.maximum(first_row, 0) + causal_offset + 1, 0),
                            seqlen_k)
        n_end = tl.minimum(tl.maximum(last_row_end + causal_offset, 0), seqlen_k)
    else:
        n_full = seqlen_k
        n_end = seqlen_k
    return n_full, n_end
