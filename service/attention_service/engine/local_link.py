"""``EngineLink`` for the single-process model: the front end and the engine share a process.

A call's buffers are one host block from the backend (pinned on cuda, from torch's caching
host allocator, so repeat sizes cost no page faults), laid out and handed to the engine as
byte spans of a ``ByteBase`` just as a front-end process's arena block is: the front end fills
them through numpy views, and the engine packs a decode step's bytes through numpy too (no
torch call per tensor: as torch tensors, a step's staging fill and output scatter took ~200 us
of engine time at one client, ~80 us as spans; H100, benchmarks/trace_step.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from attention_service.engine.core import EngineCore, Source
from attention_service.engine.executor import future_done
from attention_service.engine.jobs import ByteBase, ExecStats
from attention_service.link import EngineInfo
from attention_service.params import Params, RegionSpan
from attention_wire.alloc import layout

_INLINE_ALLOC_BYTES = 1 << 20
_SEEN_SIZES = 4096  # block sizes remembered as cheap (a bound on the set, not a cache)


class LocalBuffers:
    def __init__(self, base: ByteBase, offsets: dict[str, int], sizes: Mapping[str, int],
                 elsewhere: Mapping[str, tuple[ByteBase, int]] = MappingProxyType({})) -> None:
        """Tensor ``n`` at ``offsets[n]`` of ``base``, or at ``elsewhere[n]`` (a block and
        offset of its own: the step socket's inputs where they arrived)."""
        self.spans: dict[str, tuple[ByteBase, int]] = {
            **{n: (base, at) for n, at in offsets.items()}, **elsewhere}
        self.arrays: dict[str, np.ndarray] = {
            n: b.np[at : at + sizes[n]] for n, (b, at) in self.spans.items()}  # type: ignore[index]

    def release(self) -> None:
        # The job holds its own references until its launch is done with them.
        self.spans = {}
        self.arrays = {}


class LocalLink:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.info: EngineInfo = core.info
        self.lazy_buffers = core.info.backend != "cuda"  # cuda: pinned when allocated
        # Sizes allocated before: torch's caching host allocator hands them back at once.
        # Only a new large size goes through a thread (the hop alone cost a 64-sequence
        # decode step ~250 us of its front end, 2-core dev box).
        self._seen: set[int] = set()

    async def allocate(self, sizes: Mapping[str, int]) -> LocalBuffers:
        offsets, total = layout(sizes)  # as in a front end's arena

        def alloc() -> LocalBuffers:
            block = self.core.backend.alloc_host(total)
            return LocalBuffers(ByteBase(block, pinned=not self.lazy_buffers), offsets, sizes)

        if total <= _INLINE_ALLOC_BYTES or total in self._seen:
            return alloc()
        # Off the event loop: a first pinned allocation of a large size takes milliseconds.
        buffers = await asyncio.to_thread(alloc)
        if len(self._seen) >= _SEEN_SIZES:
            self._seen.clear()
        self._seen.add(total)
        return buffers

    async def run(
        self, params: Params, buffers: LocalBuffers, regions: Mapping[str, RegionSpan],  # type: ignore[override]
        owner: str,
    ) -> ExecStats:
        sources: dict[str, Source] = {**buffers.spans, **regions}
        fut, done = future_done()
        job = self.core.submit(params, sources, owner, done)
        try:
            return await fut
        except asyncio.CancelledError:
            self.core.cancel(job)
            raise

    async def control_call(self, method: str, request: Any, owner: str) -> Any:
        # Off the event loop: mapping and page-locking a large region takes a while, and a
        # fork copies a page on the device.
        return await asyncio.to_thread(self.core.control_call, method, request, owner)
