"""Optional bearer-token auth as a grpc.aio server interceptor (health checks stay open), and
the principal of a call: who owns the regions it registers or names.

``--auth-token`` takes one token or several, comma-separated; each token is its own principal
(a region registered with one token is invisible to the others). Without auth every caller is
the anonymous principal "".
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from attention_service.metrics import Metrics, metric_rpc

log = logging.getLogger("attention_service")

# Probes (load balancers, Kubernetes) must reach health without credentials.
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
SERVICE_PREFIX = "/attention.v1.AttentionService/"


def _denying_handler(message: str, rpc: str, t0: float) -> grpc.RpcMethodHandler:
    """A handler that answers UNAUTHENTICATED without reading the request: registered as
    streaming with raw bytes in, it never waits for, receives or parses a request message,
    whatever the rpc's declared kind (the status ends the call either way). Logged like any
    call (one line; the token presented is never written)."""

    async def deny(_requests: Any, context: grpc.aio.ServicerContext) -> None:
        log.info("rpc=%s code=UNAUTHENTICATED duration_ms=%.3f peer=%s details=%r", rpc,
                 (time.perf_counter() - t0) * 1e3, context.peer(), message)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.stream_stream_rpc_method_handler(
        deny, request_deserializer=None, response_serializer=None
    )


def _presented(metadata: Sequence[tuple[str, Any]] | None) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value.encode() if isinstance(value, str) else bytes(value)
    return None


class Principals:
    """Accepted tokens and the principal id of each (a digest, never the token itself)."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self._ids = {
            f"Bearer {t}".encode(): "token-" + hashlib.sha256(t.encode()).hexdigest()[:16]
            for t in tokens
        }

    @property
    def enabled(self) -> bool:
        return bool(self._ids)

    def match(self, presented: bytes | None) -> str | None:
        """The principal of an authorization value, or None if it is not accepted."""
        if presented is None:
            return None
        found = None
        for expected, pid in self._ids.items():  # constant-time compare against every token
            if hmac.compare_digest(presented, expected):
                found = pid
        return found

    def of(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's principal ("" without auth). The interceptor already refused callers
        without an accepted token, so this always finds one when auth is on."""
        if not self._ids:
            return ""
        pid = self.match(_presented(context.invocation_metadata()))
        if pid is None:  # unreachable behind the interceptor; never fall back to anonymous
            raise PermissionError("unauthenticated call reached a handler")
        return pid


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, principals: Principals, metrics: Metrics | None = None) -> None:
        self._principals = principals
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        t0 = time.perf_counter()
        handler = await continuation(details)
        method = details.method or ""
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        presented = _presented(details.invocation_metadata)
        if self._principals.match(presented) is not None:
            return handler
        # Under the label the call would have counted under had it been let in.
        ours = method.startswith(SERVICE_PREFIX)
        rpc = metric_rpc(method[len(SERVICE_PREFIX):]) if ours else method
        if self._metrics is not None and ours:
            # Timed from the call's arrival to its refusal (no payload is read for it).
            self._metrics.observe_request(rpc, "UNAUTHENTICATED", time.perf_counter() - t0)
        reason = "missing" if presented is None else "invalid"
        return _denying_handler(
            f"authorization: {reason} bearer token (send 'authorization: Bearer <token>')",
            rpc, t0,
        )
