"""asyncio client (grpc.aio): the same methods as AttentionClient, as coroutines.

Create it inside a running event loop (a grpc.aio channel belongs to the loop that first uses
it). Many calls may run concurrently on one client; they share one HTTP/2 connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attention_client._base import ClientBase
from attention_client._channel import DECODE_METHOD, INFO_METHOD, PREFILL_METHOD
from attention_client._chunks import DEFAULT_CHUNK_BYTES, encode_messages
from attention_client._errors import from_rpc_error
from attention_client._requests import DECODE, PREFILL, PreparedRequest
from attention_client._responses import server_info_dict
from attention_client._wire import parse_response
from attention_wire.pb import attention_pb2 as pb


class AsyncAttentionClient(ClientBase):
    """See AttentionClient; ``interceptors`` are ``grpc.aio`` client interceptors here."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: Any = None,
        timeout: float | None = 60.0,
        interceptors: Sequence[Any] | None = None,
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        options: Sequence[tuple[str, Any]] | None = None,
    ) -> None:
        super().__init__(
            target, token=token, tls=tls, timeout=timeout,
            max_chunk_bytes=max_chunk_bytes, options=options,
        )
        icpts = list(interceptors) if interceptors else None
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(target, options=self._options, interceptors=icpts)
        else:
            channel = grpc.aio.secure_channel(
                target, self._credentials, options=self._options, interceptors=icpts
            )
        self._channel = channel
        # Requests are pre-serialized bytes (_chunks); responses are parsed lazily (_wire).
        self._streams = {
            PREFILL: channel.stream_stream(
                PREFILL_METHOD, response_deserializer=parse_response
            ),
            DECODE: channel.stream_stream(
                DECODE_METHOD, response_deserializer=parse_response
            ),
        }
        self._info = channel.unary_unary(
            INFO_METHOD,
            request_serializer=pb.GetServerInfoRequest.SerializeToString,
            response_deserializer=pb.ServerInfo.FromString,
        )
        self._health = health_pb2_grpc.HealthStub(channel)

    async def attention(
        self,
        q: Any,
        k: Any,
        v: Any,
        cu_seqlens: Any = None,
        cu_seqlens_k: Any = None,
        *,
        causal: bool = False,
        softmax_scale: float | None = None,
        return_lse: bool = False,
    ) -> Any:
        """See AttentionClient.attention."""
        prep = self._prepare_attention(
            q, k, v, cu_seqlens, cu_seqlens_k, causal, softmax_scale, return_lse
        )
        return await self._run(prep)

    async def decode(
        self,
        q: Any,
        k: Any,
        v: Any,
        cu_seqlens_k: Any,
        *,
        softmax_scale: float | None = None,
        num_splits: int = 0,
        return_lse: bool = False,
    ) -> Any:
        """See AttentionClient.decode."""
        prep = self._prepare_decode(q, k, v, cu_seqlens_k, softmax_scale, num_splits, return_lse)
        return await self._run(prep)

    async def info(self) -> dict[str, Any]:
        try:
            reply = await self._info(
                pb.GetServerInfoRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err, "GetServerInfo") from err
        return server_info_dict(reply)

    async def health(self, service: str = "") -> str:
        try:
            reply = await self._health.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=self.timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err, "Health.Check") from err
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncAttentionClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self, prep: PreparedRequest) -> Any:
        assembler = self._assembler(prep)
        # A plain generator is fine for grpc.aio: producing a message is one memcpy.
        messages = encode_messages(prep.header, prep.tensors, self.max_chunk_bytes)
        call = self._streams[prep.method](messages, timeout=self.timeout, metadata=self._metadata)
        try:
            async for response in call:
                assembler.add(response)
            return self._complete(prep, assembler)
        except grpc.RpcError as err:
            raise from_rpc_error(err, prep.method) from err
        except BaseException:  # broken stream or abandoned call: cancel (why: client.py)
            call.cancel()
            raise
