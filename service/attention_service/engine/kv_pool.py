"""The paged KV pool: one block of device memory cut into fixed-size pages.

Every layout (dtype, kv heads, head dim) shares the same pages, so the pool never fragments:
any free page serves any cache, and the byte accounting is exact (pages x page bytes). A page
holds ``page_tokens`` tokens of one layout, keys first, then values::

    page p:  K[0..page_tokens) [H_kv, D]  |  V[0..page_tokens) [H_kv, D]  |  unused tail

which the kernels see as ``k_pages, v_pages [pages, page_tokens, H_kv, D]`` strided views of
the same bytes (``flash_attn_with_kvcache``'s paged layout; a head dim that is not a multiple of
16 has its rows padded to one, ``Layout.head_stride``). Pages are reference-counted: a
fork shares the full pages of its prefix, which no cache ever writes again (appends only
write past a cache's length).

Every page in use belongs to one caller (its owner: a token with auth on). Forks stay in their
owner's namespace, so a shared page never has two owners, and a caller's pages are counted
once however many of its caches share them; ``alloc`` holds each caller to ``caller_pages``
(0: no limit) so one token cannot fill the pool for every other.

Not thread-safe by itself: ``kv_caches.CacheRegistry`` calls it under its lock.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import torch

from attention_service.engine.dtypes import TORCH_DTYPES
from attention_service.errors import exhausted
from attention_service.params import ELEMENT_BYTES

# Owners that start with this are the server's own (warm-up): no token can be one, and the
# per-caller quota does not hold them (warm-up needs two pages however small the quota).
SERVER_OWNER_PREFIX = "\x00"


class Layout(NamedTuple):
    dtype: int  # pb.DType of the queries run against it
    num_kv_heads: int
    head_dim: int
    kv_dtype: int = 0  # pb.DType the keys and values are stored in (0: dtype)

    @property
    def stored_dtype(self) -> int:
        return self.kv_dtype or self.dtype

    @property
    def head_stride(self) -> int:
        """Elements from one kv head's row to the next in a page: the head dim, rounded up to
        a multiple of 16 when it is not one, so the kernels' row loads vectorize (Triton
        specializes strides divisible by 16; the kernels mark rows of 4, 8 and 16 bytes
        themselves, ``attention_kernels._launch.row_align``, but not the rest). Pages of D 72
        hold 80-wide rows."""
        return -(-self.head_dim // 16) * 16

    @property
    def token_bytes(self) -> int:
        """Key plus value bytes of one token (rows padded to ``head_stride``)."""
        return 2 * self.num_kv_heads * self.head_stride * ELEMENT_BYTES[self.stored_dtype]


class LayoutView(NamedTuple):
    k_pages: torch.Tensor  # [pages, page_tokens, H_kv, D]
    v_pages: torch.Tensor
    page_tokens: int


class KvPool:
    def __init__(self, storage: torch.Tensor, page_bytes: int, caller_pages: int = 0) -> None:
        """``storage``: uint8, on the engine's device; ``page_bytes`` a multiple of 256 (so
        every page starts aligned for every dtype and for 128-byte loads); ``caller_pages``:
        the most pages one owner may hold (0: no limit)."""
        self.storage = storage
        self.page_bytes = page_bytes
        self.pages_total = storage.numel() // page_bytes
        self.caller_pages = caller_pages
        self._free = list(range(self.pages_total - 1, -1, -1))  # pop() hands out low pages first
        self._refs = [0] * self.pages_total
        self._owner: list[str] = [""] * self.pages_total  # meaningful while refs > 0
        self._held: dict[str, int] = {}  # pages in use per owner (absent: none)
        self._views: dict[Layout, LayoutView] = {}

    @property
    def nbytes(self) -> int:
        return self.pages_total * self.page_bytes

    @property
    def pages_free(self) -> int:
        return len(self._free)

    @property
    def pages_used(self) -> int:
        return self.pages_total - len(self._free)

    def held(self, owner: str) -> int:
        """Pages ``owner``'s caches hold (a page its caches share counts once)."""
        return self._held.get(owner, 0)

    def over_quota(self, owner: str, count: int) -> bool:
        """Whether ``count`` more pages would pass ``owner``'s quota (the server's own
        owners have none)."""
        return bool(self.caller_pages and count
                    and self._held.get(owner, 0) + count > self.caller_pages
                    and not owner.startswith(SERVER_OWNER_PREFIX))

    def page_tokens(self, layout: Layout) -> int:
        """Tokens of ``layout`` per page (0: one token does not fit a page)."""
        return self.page_bytes // layout.token_bytes

    def view(self, layout: Layout) -> LayoutView:
        """The kernels' view of the pool for ``layout`` (made once per layout)."""
        got = self._views.get(layout)
        if got is not None:
            return got
        dtype = TORCH_DTYPES[layout.stored_dtype]
        tokens = self.page_tokens(layout)
        if tokens < 1:
            raise ValueError(f"{layout} does not fit a {self.page_bytes}-byte page")
        typed = self.storage[: self.nbytes].view(dtype)
        row = layout.num_kv_heads * layout.head_stride
        shape = (self.pages_total, tokens, layout.num_kv_heads, layout.head_dim)
        strides = (self.page_bytes // dtype.itemsize, row, layout.head_stride, 1)
        k = typed.as_strided(shape, strides, 0)
        v = typed.as_strided(shape, strides, tokens * row)
        got = self._views[layout] = LayoutView(k, v, tokens)
        return got

    def alloc(self, count: int, field: str, owner: str = "") -> list[int]:
        """``count`` fresh pages (reference 1) for ``owner``, or RESOURCE_EXHAUSTED naming
        ``field`` and nothing taken."""
        held = self._held.get(owner, 0)
        if self.over_quota(owner, count):
            raise exhausted(
                field,
                f"this caller's KV-cache quota is full: it holds {held} pages of "
                f"{self.page_bytes} bytes and this needs {count} more, over its limit of "
                f"{self.caller_pages} (release caches, or raise --kv-cache-bytes-per-caller)",
            )
        if count > len(self._free):
            raise exhausted(
                field,
                f"the KV-cache pool is full: this needs {count} more pages of "
                f"{self.page_bytes} bytes, {len(self._free)} of {self.pages_total} are free "
                "(release caches, or raise --kv-cache-bytes)",
            )
        if not count:
            return []
        pages = self._free[-count:][::-1]  # as pop() would hand them out: low pages first
        del self._free[-count:]
        refs, owners = self._refs, self._owner
        for p in pages:
            refs[p] = 1
            owners[p] = owner
        self._held[owner] = held + count
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page nobody references is free again."""
        refs, owners, held = self._refs, self._owner, self._held
        freed: list[int] = []
        for p in pages:
            left = refs[p] - 1
            assert left >= 0, f"page {p} freed twice"
            refs[p] = left
            if not left:
                freed.append(p)
        if not freed:
            return
        # Last in, first out, in the order they were given: an ``alloc`` of as many pages next
        # hands back these pages in this order. A decode step that stores nothing reserves a
        # page per sequence at a page boundary and frees them at its end; the next such step
        # then gets the same block table (a B=64 step at 2,048 cached tokens rewrote its 64
        # staged table rows every step when the order alternated, decode_steps.Staging.fill).
        self._free.extend(reversed(freed))
        # Pages freed per owner: nearly always one (a call's pages, a cache's), counted without
        # a dict update a page (a B=64 step's 64 pages: ~8 -> ~3 us, dev box).
        whose = [owners[p] for p in freed]
        first = whose[0]
        gone = ({first: len(whose)} if whose.count(first) == len(whose)
                else collections.Counter(whose))
        for owner, n in gone.items():
            if held[owner] > n:
                held[owner] -= n
            else:
                del held[owner]

    def refs(self, page: int) -> int:
        return self._refs[page]

    def copy_page(self, src: int, dst: int) -> None:
        """Page ``src``'s bytes into page ``dst``, done when this returns."""
        b = self.page_bytes
        self.storage[dst * b : (dst + 1) * b].copy_(self.storage[src * b : (src + 1) * b])
        if self.storage.is_cuda:
            torch.cuda.current_stream(self.storage.device).synchronize()
