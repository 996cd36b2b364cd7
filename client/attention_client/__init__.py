"""Client of the remote attention service: ``AttentionClient`` (blocking) and
``AsyncAttentionClient`` (asyncio). Needs only grpcio, protobuf and numpy; torch tensors and
ml_dtypes bfloat16 arrays are accepted when those packages are installed.

    with AttentionClient("localhost:50051") as client:
        out = client.attention(q, k, v, causal=True)
        with client.kv_cache(num_kv_heads=8, head_dim=128, dtype="bfloat16") as cache:
            cache.append("seq0", k_prompt, v_prompt)
            out = cache.decode(q_step, "seq0", k_step, v_step)
            with client.decode_steps() as steps:  # a decode loop on one stream
                out = steps.step(q_step, ["seq0"], k_step, v_step)

Every failure is an ``AttentionError``; bad arguments are ``AttentionInputError``, also a
``ValueError`` (the hierarchy: ``attention_client._errors``).
"""

from attention_wire import grpc_defaults

grpc_defaults.apply()  # before grpc loads (see attention_wire.grpc_defaults)

from attention_client._caches import AsyncKvCache, KvCache  # noqa: E402
from attention_client._channel import DEFAULT  # noqa: E402
from attention_client._errors import (  # noqa: E402
    AttentionAuthError,
    AttentionError,
    AttentionInputError,
    AttentionNotFoundError,
    AttentionResourceError,
    AttentionTimeoutError,
    AttentionUnavailableError,
    CacheLostError,
    ProtocolError,
)
from attention_client._regions import SharedRegion  # noqa: E402
from attention_client._steps import AsyncDecodeSteps, DecodeSteps  # noqa: E402
from attention_client.aio import AsyncAttentionClient  # noqa: E402
from attention_client.client import AttentionClient  # noqa: E402

__all__ = [
    "DEFAULT", "AsyncAttentionClient", "AsyncDecodeSteps", "AsyncKvCache", "AttentionAuthError",
    "AttentionClient", "AttentionError", "AttentionInputError", "AttentionNotFoundError",
    "AttentionResourceError", "AttentionTimeoutError", "AttentionUnavailableError",
    "CacheLostError", "DecodeSteps", "KvCache", "ProtocolError", "SharedRegion",
]
__version__ = "0.1.0"
