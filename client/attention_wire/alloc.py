"""A first-fit allocator of byte ranges, for memory shared between processes (the server's
per-front-end arenas, the client's shared-memory regions). Not thread-safe: callers lock."""

from __future__ import annotations

import bisect
from collections.abc import Mapping

ALIGN = 4096  # every tensor starts on a page: aligned for any dtype and for DMA


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(sizes: Mapping[str, int]) -> tuple[dict[str, int], int]:
    """Offsets of each tensor inside one block, and the block's size."""
    offsets, at = {}, 0
    for name, n in sizes.items():
        offsets[name] = at
        at += align(n)
    return offsets, max(at, ALIGN)


class FreeList:
    """First-fit allocator of [0, size) in ALIGN units, coalescing on free."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0]  # sorted free ranges [start, end)
        self._ends: list[int] = [size]
        self.used = 0

    def alloc(self, n: int) -> int | None:
        n = align(n)
        for i, (s, e) in enumerate(zip(self._starts, self._ends, strict=True)):
            if e - s >= n:
                if e - s == n:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = s + n
                self.used += n
                return s
        return None

    def free(self, start: int, n: int) -> None:
        n = align(n)
        end = start + n
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] < end:
            raise ValueError(f"double free of [{start}, {end})")
        if i and self._ends[i - 1] > start:
            raise ValueError(f"double free of [{start}, {end})")
        merge_left = i > 0 and self._ends[i - 1] == start
        merge_right = i < len(self._starts) and self._starts[i] == end
        if merge_left and merge_right:
            self._ends[i - 1] = self._ends[i]
            del self._starts[i], self._ends[i]
        elif merge_left:
            self._ends[i - 1] = end
        elif merge_right:
            self._starts[i] = start
        else:
            self._starts.insert(i, start)
            self._ends.insert(i, end)
        self.used -= n

    @property
    def free_bytes(self) -> int:
        return self.size - self.used
