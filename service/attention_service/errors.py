"""Request errors that carry the gRPC status to answer with (a leaf: grpc only)."""

from __future__ import annotations

import grpc


class StartupError(RuntimeError):
    """The server cannot start as configured (its port taken, a TLS file missing, no GPU):
    ``attention-server`` prints the message on one line and exits 2."""


class Cancelled(Exception):
    """The call went away (cancel or deadline) before its compute finished."""


class RequestError(Exception):
    """A refusal of one request; ``details`` names the offending field first."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details

    def __reduce__(self):  # crosses process boundaries (engine -> front end) by pickle
        return (type(self), (self.code, self.details))

    @classmethod
    def internal(cls, exc: BaseException) -> RequestError:
        """A bug's answer to the caller (the traceback stays in the server's log)."""
        return cls(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


class StreamEnded(RequestError):
    """The request stream ended before the request was complete (INVALID_ARGUMENT), which is
    also how a client's cancel or deadline looks from the reading side."""


def invalid(field: str, message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")


def exhausted(field: str, message: str) -> RequestError:
    return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{field}: {message}")


def not_found(field: str, message: str) -> RequestError:
    return RequestError(grpc.StatusCode.NOT_FOUND, f"{field}: {message}")


def unavailable(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.UNAVAILABLE, message)
