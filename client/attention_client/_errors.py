"""The one exception type callers catch for anything the service (or the wire) got wrong."""

from __future__ import annotations

import grpc


class AttentionError(Exception):
    """A failed call: ``.code`` is the ``grpc.StatusCode``, ``.details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str, method: str = "") -> None:
        self.code = code
        self.details = details
        self.method = method
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.method} failed: " if self.method else ""
        return f"{where}{self.code.name}: {self.details}"

    def __reduce__(self):  # keep picklable despite the custom __init__
        return (type(self), (self.code, self.details, self.method))


class ProtocolError(AttentionError):
    """The response stream broke the contract (missing or duplicate rows, wrong shapes, ...)."""

    def __init__(self, details: str, method: str = "") -> None:
        super().__init__(grpc.StatusCode.DATA_LOSS, details, method)

    def __reduce__(self):
        return (type(self), (self.details, self.method))


def from_rpc_error(err: grpc.RpcError, method: str) -> AttentionError:
    """Wrap a ``grpc.RpcError`` (sync or aio): both expose ``code()`` and ``details()``."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    return AttentionError(code or grpc.StatusCode.UNKNOWN, details or "", method)
