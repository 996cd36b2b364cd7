"""copy_segments: one launch copies many (src, dst, length) segments, host memory included."""

from __future__ import annotations

import pytest
import torch

from attention_kernels.copy_segments import (
    BLOCK,
    MAX_UNITS,
    can_use_host_pointers,
    copy_segments,
    copy_segments_ref,
    unit_of,
    warm,
)
from tests.kernels.conftest import ON_GPU


def _layout(sizes: list[int], align: int, gap: int) -> list[int]:
    """Byte offsets of ``sizes`` laid out one after another, each at a multiple of ``align``
    and ``gap`` bytes apart (so a copy past a segment's end shows)."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += -(-(n + gap) // align) * align
    return offsets


def _case(sizes: list[int], align: int, src_dev: str, dst_dev: str):
    gen = torch.Generator().manual_seed(sum(sizes) + align)
    src_at, dst_at = _layout(sizes, align, 3 * align), _layout(sizes[::-1], align, align)[::-1]
    src_len = (src_at[-1] + sizes[-1] + 64) if sizes else 64
    dst_len = max((a + n for a, n in zip(dst_at, sizes, strict=True)), default=0) + 64
    src = torch.randint(0, 256, (src_len,), dtype=torch.uint8, generator=gen)
    pin = ON_GPU
    src = src.pin_memory() if src_dev == "host" and pin else src
    src = src.cuda() if src_dev == "cuda" else src
    dst = torch.full((dst_len,), 0xA5, dtype=torch.uint8)  # poison
    dst = dst.pin_memory() if dst_dev == "host" and pin else dst
    dst = dst.cuda() if dst_dev == "cuda" else dst
    return src, dst, src_at, dst_at


def _run(sizes: list[int], align: int, src_dev: str = "host", dst_dev: str = "host",
         extra_offset: int = 0) -> None:
    if ON_GPU and "host" in (src_dev, dst_dev) and not can_use_host_pointers(
            torch.cuda.current_device()):
        pytest.skip("this device cannot use host pointers of page-locked memory")
    src, dst, src_at, dst_at = _case(sizes, align, src_dev, dst_dev)
    src_at = [a + extra_offset for a in src_at]
    unit = unit_of(src.data_ptr(), dst.data_ptr(), *src_at, *dst_at, *sizes)
    rows = [[src.data_ptr() + s, dst.data_ptr() + d, n // unit, 0]
            for s, d, n in zip(src_at, dst_at, sizes, strict=True)]
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
    expected = dst.cpu().clone()
    for s, d, n in zip(src_at, dst_at, sizes, strict=True):
        expected[d : d + n] = src.cpu()[s : s + n]
    run_dev = "cuda" if ON_GPU else "cpu"
    copy_segments(table.to(run_dev), unit, max((n // unit for n in sizes), default=0))
    if ON_GPU:
        torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), expected)  # every segment copied, nothing else touched


@pytest.mark.parametrize("align", [1, 2, 4, 8, 64])
def test_segments_of_odd_sizes_are_copied_exactly(align: int) -> None:
    # 0 and 1 byte, around the block size in every unit, a segment over two blocks.
    sizes = [0, align, 3 * align, 8 * BLOCK + align, 2 * align * BLOCK, 5 * align, align]
    _run(sizes, align)


def test_a_slice_of_rows_starts_aligned_and_copies_only_its_rows() -> None:
    dev = "cuda" if ON_GPU else "cpu"
    src = torch.arange(96, dtype=torch.uint8, device=dev)
    dst = torch.zeros(96, dtype=torch.uint8, device=dev)
    rows = [[src.data_ptr() + 8 * i, dst.data_ptr() + 8 * i, 1, 0] for i in range(12)]
    table = torch.tensor(rows, dtype=torch.int64, device=dev)
    for first in (1, 3, 5):  # odd row counts in: every slice still 16-byte aligned
        assert table[first:].data_ptr() % 16 == 0
    copy_segments(table[5:], 8, 1)
    if ON_GPU:
        torch.cuda.synchronize()
    assert not dst[:40].any() and torch.equal(dst[40:], src[40:])


def test_the_unit_falls_to_one_byte_for_an_odd_address() -> None:
    _run([16, 24, 40], 8, extra_offset=1)
    assert unit_of(8, 16, 24) == 8 and unit_of(8, 12) == 4 and unit_of(2, 6) == 2
    assert unit_of(8, 3) == 1 and unit_of() == 8


def test_no_segments_and_bad_tables_are_handled() -> None:
    copy_segments(torch.empty((0, 4), dtype=torch.int64), 8, 0)  # nothing to do
    with pytest.raises(ValueError, match="int64"):
        copy_segments(torch.zeros((2, 3), dtype=torch.int64), 8, 1)
    with pytest.raises(ValueError, match="contiguous"):
        copy_segments(torch.zeros((2, 8), dtype=torch.int64)[:, ::2], 8, 1)
    with pytest.raises(ValueError, match="unit"):
        copy_segments(torch.zeros((1, 4), dtype=torch.int64), 3, 1)
    with pytest.raises(ValueError, match="over"):
        copy_segments(torch.zeros((1, 4), dtype=torch.int64), 8, MAX_UNITS + 1)


def test_warm_compiles_and_checks_every_unit() -> None:
    warm("cuda" if ON_GPU else "cpu")


def test_the_host_reference_copies_the_same_way() -> None:
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    table = torch.tensor([[src.data_ptr() + 8, dst.data_ptr(), 2, 0],
                          [src.data_ptr(), dst.data_ptr() + 32, 1, 0]], dtype=torch.int64)
    copy_segments_ref(table, 8)
    assert dst[:16].tolist() == list(range(8, 24)) and dst[32:40].tolist() == list(range(8))
    assert not dst[16:32].any() and not dst[40:].any()


@pytest.mark.skipif(not ON_GPU, reason="device memory and host pointers need a GPU")
@pytest.mark.parametrize(("src_dev", "dst_dev"), [("host", "cuda"), ("cuda", "host"),
                                                   ("cuda", "cuda")])
def test_pinned_host_memory_is_read_and_written_in_place(src_dev: str, dst_dev: str) -> None:
    if not can_use_host_pointers(torch.cuda.current_device()):
        pytest.skip("this device cannot use host pointers of page-locked memory")
    _run([0, 2, 1000, 8 * BLOCK * 8 + 16, 48], 16, src_dev, dst_dev)
