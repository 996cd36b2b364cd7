"""Request errors that carry the gRPC status to answer with."""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """A refusal of one request; ``details`` names the offending field first."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def invalid(field: str, message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")


def exhausted(field: str, message: str) -> RequestError:
    return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{field}: {message}")
