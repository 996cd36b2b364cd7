"""``EngineLink`` for the single-process model: the front end and the engine share a process.

Buffers are host tensors from the backend (pinned on cuda, from torch's caching host
allocator, so repeat sizes cost no page faults); the front end fills them through numpy views
and the engine copies them to the GPU directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from attention_service.engine.core import EngineCore, Source
from attention_service.engine.executor import future_done
from attention_service.engine.jobs import ExecStats
from attention_service.link import EngineInfo
from attention_service.params import Params, RegionSpan

_INLINE_ALLOC_BYTES = 1 << 20


class LocalBuffers:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.arrays: dict[str, np.ndarray] = {n: t.numpy() for n, t in tensors.items()}

    def release(self) -> None:
        # The job holds its own references until its launch is done with them.
        self.tensors = {}
        self.arrays = {}


class LocalLink:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.info: EngineInfo = core.info

    async def allocate(self, sizes: Mapping[str, int]) -> LocalBuffers:
        def alloc() -> LocalBuffers:
            return LocalBuffers({n: self.core.backend.alloc_host(s) for n, s in sizes.items()})

        if sum(sizes.values()) <= _INLINE_ALLOC_BYTES:
            return alloc()
        # Off the event loop: a first pinned allocation of a large size takes milliseconds.
        return await asyncio.to_thread(alloc)

    async def run(
        self, params: Params, buffers: LocalBuffers, regions: Mapping[str, RegionSpan],  # type: ignore[override]
        owner: str,
    ) -> ExecStats:
        sources: dict[str, Source] = {**buffers.tensors, **regions}
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
