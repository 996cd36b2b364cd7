"""Client of the remote attention service: ``AttentionClient`` (blocking) and
``AsyncAttentionClient`` (asyncio). Needs only grpcio, protobuf and numpy; torch tensors and
ml_dtypes bfloat16 arrays are accepted when those packages are installed.

    with AttentionClient("localhost:50051") as client:
        out = client.attention(q, k, v, causal=True)
"""

from attention_client._errors import AttentionError, ProtocolError
from attention_client._regions import SharedRegion
from attention_client.aio import AsyncAttentionClient
from attention_client.client import AttentionClient

__all__ = [
    "AsyncAttentionClient", "AttentionClient", "AttentionError", "ProtocolError",
    "SharedRegion",
]
__version__ = "0.1.0"
