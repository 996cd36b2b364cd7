"""grpc's stock health and reflection services, registered so that malformed request bytes
get INVALID_ARGUMENT naming the request instead of grpcio's UNKNOWN ("Unexpected
DecodeError") and a traceback in the server's log for every such call.

The stock ``add_*_to_server`` functions are run against a recorder; each recorded handler is
registered again with a deserializer that turns a parse failure into a marker, and a
behavior that aborts on the marker before the stock servicer sees it. The servicers and
their answers are grpc's own.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

HEALTH = "grpc.health.v1.Health"
REFLECTION = reflection.SERVICE_NAME


class _Malformed:
    """What the lenient deserializer returns for bytes that do not parse."""

    def __init__(self, exc: Exception) -> None:
        self.reason = str(exc)


class _Recorder:
    """Stands in for the server while a stock ``add_*_to_server`` registers its handlers."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers come by name below

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.services[service] = handlers


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except DecodeError as exc:
            return _Malformed(exc)

    return deserialize


async def _refuse(context: grpc.aio.ServicerContext, method: str, bad: _Malformed) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"request: not a valid {method} request message: {bad.reason}")


def _guarded(method: str, h: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``h`` with a lenient deserializer and a behavior that refuses what did not parse."""
    inner = h.unary_unary or h.unary_stream or h.stream_stream or h.stream_unary

    async def checked_one(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await _refuse(context, method, request)
        return request

    async def checked_all(requests: AsyncIterator[Any],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in requests:
            yield await checked_one(request, context)

    async def prepared(request: Any, context: grpc.aio.ServicerContext) -> Any:
        """The request checked, or the request stream checked as it is read."""
        if h.request_streaming:
            return checked_all(request, context)
        return await checked_one(request, context)

    # grpc.aio tells generator behaviors (they yield replies) from coroutines (they return
    # the reply or write it) by the function's kind: keep the stock servicer's kind.
    if inspect.isasyncgenfunction(inner):

        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async for reply in inner(await prepared(request, context), context):
                yield reply
    else:

        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[misc]
            return await inner(await prepared(request, context), context)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(h.request_streaming, h.response_streaming)]
    return make(behavior, request_deserializer=_lenient(h.request_deserializer),
                response_serializer=h.response_serializer)


def add_stock_services(server: grpc.aio.Server, service_names: tuple[str, ...]
                       ) -> health.aio.HealthServicer:
    """Health (returned, for its status) and reflection over ``service_names`` (the stock
    servicers), with malformed requests refused as INVALID_ARGUMENT."""
    health_servicer = health.aio.HealthServicer()
    recorder = _Recorder()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, recorder)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        reflection.aio.ReflectionServicer(service_names), recorder)
    if set(recorder.services) != {HEALTH, REFLECTION}:  # a grpcio that registers otherwise
        raise RuntimeError(f"health/reflection registration changed: got {recorder.services}")
    for service, handlers in recorder.services.items():
        guarded = {name: _guarded(f"{service}/{name}", h) for name, h in handlers.items()}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, guarded),))
    return health_servicer
