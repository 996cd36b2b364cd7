"""The front end's view of the engine: ``EngineLink`` (pure Python; no torch).

The gRPC front end receives and validates a request, asks the link for host buffers, fills
them, hands ``Params`` plus buffers to ``run`` and streams the outputs back from the same
buffers. Two links implement it, so the front end code is the same in both process models:

* ``attention_service.engine.local_link.LocalLink``: the engine in the same process (pinned
  torch buffers; ``--frontends 1``);
* ``attention_service.ipc.remote_link.RemoteLink``: a front-end process talking to the engine
  process; buffers are slices of a shared-memory arena that the engine pinned, so tensor bytes
  are written once by the front end and copied to the GPU straight from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from attention_service.params import Params, RegionSpan


@dataclass(frozen=True)
class EngineInfo:
    """What the engine runs, for GetServerInfo and the metrics' device info."""

    device: str  # GPU name or "cpu"
    backend: str  # "cuda" | "cpu"
    batching: bool
    regions: bool  # shared-memory region registration allowed
    frontends: int  # front-end processes (1: single process)
    torch_version: str
    triton_version: str
    cuda_version: str
    kv_cache_bytes: int = 0  # the KV-cache pool (0: caches off)
    kv_page_bytes: int = 0
    nixl: bool = False  # NIXL regions can be registered (regions allowed, NIXL installed)
    nixl_backend: str = ""  # "UCX", with UCX_TLS when the server restricts UCX's transports
    instance: str = ""  # this engine's start, unique (ServerInfo.instance_id)


class ExecStats(NamedTuple):
    """Where one request's time went, as the engine saw it (a tuple: made per request on the
    engine's hot path, and it crosses to the front end with every answer)."""

    queue_seconds: float  # fully received -> its launch started
    h2d_seconds: float  # of the launch that served it
    kernel_seconds: float
    d2h_seconds: float
    batch_requests: int  # requests merged into that launch
    batch_tokens: int  # tokens in that launch
    flops: int = 0  # this request's work (for cached ops known only to the engine)
    cache_lengths: tuple[int, ...] = ()  # cached ops: each cache's tokens afterwards


class Buffers(Protocol):
    """Host buffers of one call: ``arrays[name]`` is a writable uint8 view per tensor name
    (q, k, v, out, lse) that the front end fills or reads. ``release`` once the call is done
    with them; the link keeps them alive until the engine is done too."""

    arrays: Mapping[str, np.ndarray]

    def release(self) -> None: ...


class EngineLink(Protocol):
    info: EngineInfo
    # Whether buffers take host memory only as they are written (an arena the engine pinned
    # once, memfd segments, pageable cpu memory): then an upload is charged against the
    # budget as its bytes arrive; else (pinned when allocated) in full at its header.
    lazy_buffers: bool

    async def allocate(self, sizes: Mapping[str, int]) -> Buffers:
        """Buffers of these byte sizes for one call."""
        ...

    async def run(
        self, params: Params, buffers: Buffers, regions: Mapping[str, RegionSpan], owner: str
    ) -> ExecStats:
        """Run one request. Tensors named in ``regions`` live in registered shared-memory
        regions of ``owner``; the others in ``buffers``. Raises RequestError for a refusal;
        cancelling the await cancels the request."""
        ...

    async def control_call(self, method: str, request: Any, owner: str) -> Any:
        """A unary control rpc for ``owner`` (RegisterRegion, UnregisterRegion, ListRegions,
        CreateCaches, ReleaseCaches, ForkCache, ListCaches): the pb request in, the pb reply
        out. Raises RequestError for a refusal."""
        ...
