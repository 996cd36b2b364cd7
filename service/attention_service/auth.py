"""Optional bearer-token auth as a grpc.aio server interceptor (health checks stay open)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from attention_service.metrics import Metrics

# Probes (load balancers, Kubernetes) must reach health without credentials.
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
SERVICE_PREFIX = "/attention.v1.AttentionService/"


def _denying_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED.

    Same cardinality and (de)serializers, so the transport reads the call as it was declared.
    """

    async def deny(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str, metrics: Metrics | None = None) -> None:
        self._expected = f"Bearer {token}".encode()
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        presented = None
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else value
                break
        if presented is not None and hmac.compare_digest(presented, self._expected):
            return handler
        if self._metrics is not None and method.startswith(SERVICE_PREFIX):
            rpc = method[len(SERVICE_PREFIX):]
            self._metrics.observe_request(rpc, "UNAUTHENTICATED", 0.0)
        reason = "missing" if presented is None else "invalid"
        return _denying_handler(
            handler, f"authorization: {reason} bearer token (send 'authorization: Bearer <token>')"
        )
