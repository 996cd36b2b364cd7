"""Writing a cached batch's new tokens into the paged pool and building its block table: the
steps both launch paths (cpu and cuda, and the cuda decode steps) share."""

from __future__ import annotations

import numpy as np
import torch

from attention_kernels.fp8 import quantize_kv
from attention_service.engine.jobs import BatchPlan

# Each page list's int32 array, by the list's id (the entry holds the list, so its id is not
# reused while it is here). Block-table rows are the caches' own page lists, never changed in
# place (kv_caches) and the same objects step after step, so a row is converted once: numpy
# converts ~25 ns an int, and a merged launch of 8 hosts' B=64 steps (428 rows of 129 pages)
# took ~1.5 ms to write on the dev box (~130 us of the dispatcher's GIL time a step in a
# py-spy profile, H200 host); from the arrays, ~170 us. Dropped whole past _MAX_ROW_INTS, each
# row counted as its pages plus _ROW_OVERHEAD (an entry's tuple and array header, ~350 bytes):
# at most ~2M pages' arrays and the lists they keep (~50-100 MB if no cache holds them any
# more); 8 hosts x 2 layers x 64 caches of 129 pages take ~200K.
_row_arrays: dict[int, tuple[list[int], np.ndarray]] = {}
_row_ints = 0
_MAX_ROW_INTS = 1 << 21
_ROW_OVERHEAD = 64


def row_array(row: list[int]) -> np.ndarray:
    """``row`` (a page list never changed in place) as int32, converted on first sight."""
    global _row_ints
    got = _row_arrays.get(id(row))
    if got is not None and got[0] is row:
        return got[1]
    array = np.array(row, dtype=np.int32)
    cost = len(row) + _ROW_OVERHEAD
    if _row_ints + cost > _MAX_ROW_INTS:
        _row_arrays.clear()
        _row_ints = 0
    _row_arrays[id(row)] = (row, array)
    _row_ints += cost  # racy across threads: only the bound drifts, never an array
    return array


def write_row(table: np.ndarray, i: int, row: list[int]) -> None:
    """``table[i]`` starts with ``row`` (the columns past it are never read)."""
    table[i, : len(row)] = row_array(row)


def new_page_cells(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Where a decode step's fresh pages go in a table of ``rows``: (row, column) indices,
    the column one past each row."""
    return (np.arange(len(rows)),
            np.fromiter(map(len, rows), dtype=np.intp, count=len(rows)))


def write_new_pages(table: np.ndarray, cells: tuple[np.ndarray, np.ndarray],
                    new_pages: list[int]) -> None:
    """A decode step's fresh pages (``CacheWork.new_pages``; -1: none) at ``cells``
    (``new_page_cells`` of the table's rows: a staging keeps them while its rows stay; from
    lists, this write took ~16 us of a B=64 step's reader, py-spy, H200), in one numpy write
    (a step on a page boundary has one per sequence)."""
    added = np.array(new_pages, dtype=np.int32)
    r, c = cells
    fresh = added >= 0
    if fresh.all():
        table[r, c] = added
    else:
        table[r[fresh], c[fresh]] = added[fresh]


def block_table(plan: BatchPlan, out: torch.Tensor | None = None) -> torch.Tensor:
    """A cached batch's block table as int32 ``[batch, max pages]`` (short rows padded with
    page 0, which the kernels never read past a sequence's length), written into ``out``."""
    rows = plan.block_table
    table = out if out is not None else torch.zeros((len(rows), plan.table_width),
                                                    dtype=torch.int32)
    view = table.numpy()
    for i, r in enumerate(rows):
        write_row(view, i, r)
    if plan.new_pages is not None:
        write_new_pages(view, new_page_cells(rows), plan.new_pages)
    return table


def store_new_tokens(plan: BatchPlan, k: torch.Tensor, v: torch.Tensor,
                     slots: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Write a cached batch's new k/v rows (packed) into their reserved pool slots. New
    tokens sent in the queries' dtype for an FP8 cache are quantized with its scales here."""
    if not plan.slot_pages:
        return
    work = plan.jobs[0].cache  # one layout per batch: every job's views are the same
    assert work is not None
    if k.dtype != work.k_pages.dtype:
        k_scale, v_scale = plan.new_token_scales(k.device)
        k = quantize_kv(k, k_scale)[0]  # type: ignore[arg-type]
        v = quantize_kv(v, v_scale)[0]  # type: ignore[arg-type]
    scatter_rows(work.k_pages, slots, k)
    scatter_rows(work.v_pages, slots, v)


def scatter_rows(pages: torch.Tensor, slots: tuple[torch.Tensor, torch.Tensor],
                 rows: torch.Tensor) -> None:
    """``pages[slots] = rows``. One-byte (FP8) rows go as their bits through uint8 views: the
    same bytes, and an index_put_ that every device supports for uint8 (not every one has a
    float8 kernel for it)."""
    if pages.element_size() == 1:
        pages, rows = pages.view(torch.uint8), rows.view(torch.uint8)
    pages.index_put_(slots, rows)
