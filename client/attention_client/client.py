"""Blocking client of the remote attention service."""

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


class AttentionClient(ClientBase):
    """Remote varlen attention over gRPC.

    ``q, k, v`` are numpy arrays (float16, float32, ml_dtypes.bfloat16) or torch tensors on any
    device; results come back in the same flavour, dtype and device as ``q``. Failures raise
    ``AttentionError`` (``.code``, ``.details``); bad arguments raise ``ValueError``.

    ``tls``: None (plaintext), True (system roots), or a root certificate as PEM bytes or a
    file path. ``token`` goes as ``authorization: Bearer <token>``. ``timeout`` is each call's
    deadline in seconds (None: none). ``options`` are extra gRPC channel options.
    """

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
        if self._credentials is None:
            channel = grpc.insecure_channel(target, options=self._options)
        else:
            channel = grpc.secure_channel(target, self._credentials, options=self._options)
        self._base_channel = channel
        if interceptors:
            channel = grpc.intercept_channel(channel, *interceptors)
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

    def attention(
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
        """Prefill attention; returns ``out`` or ``(out, lse)``.

        Without ``cu_seqlens``: q ``[N, H, D]`` is one sequence (lse ``[H, N]``) and
        ``[B, N, H, D]`` a batch of equal-length ones (lse ``[B, H, N]``). With ``cu_seqlens``
        (int32 ``[B + 1]``; ``cu_seqlens_k`` defaults to it) q, k, v are packed
        ``[total, H, D]`` and lse is ``[H, total_q]``. out always has q's shape.
        """
        prep = self._prepare_attention(
            q, k, v, cu_seqlens, cu_seqlens_k, causal, softmax_scale, return_lse
        )
        return self._run(prep)

    def decode(
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
        """One query token per sequence: q ``[B, H, D]``, packed k/v; lse ``[B, H]``."""
        prep = self._prepare_decode(q, k, v, cu_seqlens_k, softmax_scale, num_splits, return_lse)
        return self._run(prep)

    def info(self) -> dict[str, Any]:
        """GetServerInfo as a dict (device, backend, dtypes, head_dims, limits, versions)."""
        try:
            reply = self._info(
                pb.GetServerInfoRequest(), timeout=self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err, "GetServerInfo") from err
        return server_info_dict(reply)

    def health(self, service: str = "") -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... ("" = the whole server)."""
        try:
            reply = self._health.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=self.timeout,
                metadata=self._metadata,
            )
        except grpc.RpcError as err:
            raise from_rpc_error(err, "Health.Check") from err
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self._base_channel.close()

    def __enter__(self) -> AttentionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, prep: PreparedRequest) -> Any:
        assembler = self._assembler(prep)
        messages = encode_messages(prep.header, prep.tensors, self.max_chunk_bytes)
        call = self._streams[prep.method](messages, timeout=self.timeout, metadata=self._metadata)
        try:
            for response in call:
                assembler.add(response)
            return self._complete(prep, assembler)
        except grpc.RpcError as err:
            raise from_rpc_error(err, prep.method) from err
        except BaseException:
            # A broken stream (AttentionError), or the caller abandoned the call (a killed
            # greenlet, KeyboardInterrupt, task cancellation): cancel it, so the server stops its
            # work and sees CANCELLED. Otherwise gRPC may half-close the upload it was sending,
            # and the server answers a truncated request with INVALID_ARGUMENT (seen in Locust
            # runs, whose users are killed mid-call at the end).
            call.cancel()
            raise

