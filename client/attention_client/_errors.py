"""The exceptions of the client: one base type, ``AttentionError``, for everything a call can
get wrong, with a subclass per kind of failure callers handle differently.

    AttentionError                      .code (grpc.StatusCode), .details, .method
    +-- AttentionInputError (+ValueError)    INVALID_ARGUMENT: a bad argument, seen by the
    |                                        client before sending or refused by the server
    +-- AttentionTimeoutError (+TimeoutError) DEADLINE_EXCEEDED: the call's timeout passed
    +-- AttentionUnavailableError            UNAVAILABLE: no connection, or the server drains
    +-- AttentionAuthError                   UNAUTHENTICATED, PERMISSION_DENIED
    +-- AttentionResourceError               RESOURCE_EXHAUSTED: over a limit, queue or pool full
    +-- AttentionNotFoundError               NOT_FOUND: an unknown cache id or region
    |   +-- CacheLostError                   a handle's own cache is gone (restart, replica)
    +-- ProtocolError                        DATA_LOSS: the response broke the contract

Any other status (ALREADY_EXISTS, ABORTED, FAILED_PRECONDITION, CANCELLED, INTERNAL, ...) is a
plain ``AttentionError``. ``except ValueError`` still catches input mistakes (they were plain
``ValueError`` before), ``except AttentionError`` catches every failure.

The server names wire fields in its messages (``header.cu_seqlens_q: must start at 0``);
``from_rpc_error`` rewrites them into the argument names of the call that was made
(``cu_seqlens: must start at 0``) and keeps the server's text in ``.server_details``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import grpc


class AttentionError(Exception):
    """A failed call: ``.code`` is the ``grpc.StatusCode``, ``.details`` the message (in the
    call's argument names), ``.server_details`` the server's own message (None when the client
    raised it), ``.method`` the rpc ("" for a mistake found before sending)."""

    def __init__(
        self, code: grpc.StatusCode, details: str, method: str = "",
        server_details: str | None = None,
    ) -> None:
        self.code = code
        self.details = details
        self.method = method
        self.server_details = server_details
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.method} failed: " if self.method else ""
        return f"{where}{self.code.name}: {self.details}"

    def __reduce__(self):  # keep picklable despite the custom __init__
        return (_rebuild, (type(self), self.code, self.details, self.method, self.server_details))


def _rebuild(
    cls: type[AttentionError], code: grpc.StatusCode, details: str, method: str,
    server_details: str | None,
) -> AttentionError:
    err = cls.__new__(cls)
    AttentionError.__init__(err, code, details, method, server_details)
    return err


class AttentionInputError(AttentionError, ValueError):
    """A bad argument (INVALID_ARGUMENT): raised by the client before anything is sent
    (``.method`` "", ``.server_details`` None), or the server's refusal of a request. The
    message starts with the argument's name. Also a ``ValueError``."""

    def __init__(
        self, details: str, method: str = "", server_details: str | None = None,
        code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
    ) -> None:
        super().__init__(code, details, method, server_details)

    def __str__(self) -> str:
        # Found by the client: the message alone, as the ValueError it used to be.
        return super().__str__() if self.method else self.details


class AttentionTimeoutError(AttentionError, TimeoutError):
    """DEADLINE_EXCEEDED: the call did not finish within its timeout. Also a
    ``TimeoutError``."""


class AttentionUnavailableError(AttentionError):
    """UNAVAILABLE: the server could not be reached (after gRPC's retries), or is draining."""


class AttentionAuthError(AttentionError):
    """UNAUTHENTICATED (missing or wrong token) or PERMISSION_DENIED."""


class AttentionResourceError(AttentionError):
    """RESOURCE_EXHAUSTED: over a size limit, the queue or the KV-cache pool full, device out
    of memory. Retrying later (or smaller) may succeed."""


class AttentionNotFoundError(AttentionError):
    """NOT_FOUND: a cache id or region the server does not know (for this caller)."""


class CacheLostError(AttentionNotFoundError):
    """NOT_FOUND for a cache its handle created and did not release: the server (or, behind
    a proxy, the replica that held it) no longer has it: it restarted, left, or the cache
    expired. ``.details`` names the id; create the cache again."""


class ProtocolError(AttentionError):
    """The response stream broke the contract (missing or duplicate rows, wrong shapes, ...)."""

    def __init__(self, details: str, method: str = "") -> None:
        super().__init__(grpc.StatusCode.DATA_LOSS, details, method)


_BY_CODE: dict[grpc.StatusCode, type[AttentionError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: AttentionInputError,
    grpc.StatusCode.DEADLINE_EXCEEDED: AttentionTimeoutError,
    grpc.StatusCode.UNAVAILABLE: AttentionUnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: AttentionAuthError,
    grpc.StatusCode.PERMISSION_DENIED: AttentionAuthError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: AttentionResourceError,
    grpc.StatusCode.NOT_FOUND: AttentionNotFoundError,
}


# Codes of a call whose answer never came: it may have happened on the server (a cache
# created, a step's token stored).
OUTCOME_UNKNOWN = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                             grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN})


def error_class(code: grpc.StatusCode) -> type[AttentionError]:
    """The AttentionError subclass a status code maps to."""
    return _BY_CODE.get(code, AttentionError)


def make_error(
    code: grpc.StatusCode, details: str, method: str = "", server_details: str | None = None
) -> AttentionError:
    cls = error_class(code)
    err = cls.__new__(cls)
    AttentionError.__init__(err, code, details, method, server_details)
    return err


# ---- wire field names -> the caller's argument names --------------------------------------


def translate(details: str, names: Mapping[str, str] | None) -> str:
    """Rewrite the wire field paths in a server message into the caller's argument names.

    ``names`` maps a wire field (without the ``header.`` prefix: ``cu_seqlens_q``, ``q``,
    ``cache.cache_ids``, ``q.shape[1]``) to what the caller passed. A field with a ``.shape[i]``
    entry of its own is rewritten by it (the 4-D form, whose dims the client packs); else
    ``wire.shape[i]`` becomes ``user.shape[i]``. Paths not in ``names`` are left alone.
    """
    if not names or not details:
        return details
    keys = sorted({k.split(".shape[")[0] for k in names}, key=len, reverse=True)
    pattern = re.compile(
        r"(?<![\w.\[])(?:header\.)?(" + "|".join(re.escape(k) for k in keys) + r")"
        r"(?![\w])(\.shape\[\d+\])?"
    )

    def rewrite(m: re.Match[str]) -> str:
        field, shape = m.group(1), m.group(2) or ""
        if shape and field + shape in names:
            return names[field + shape]
        user = names.get(field)
        if user is None:  # only shape entries of its own, none of them this one
            return m.group(0)
        return user + shape

    return pattern.sub(rewrite, details)


def from_rpc_error(
    err: grpc.RpcError, method: str, names: Mapping[str, str] | None = None
) -> AttentionError:
    """Wrap a ``grpc.RpcError`` (sync or aio: both expose ``code()`` and ``details()``) in the
    subclass of its status, its message in the argument names of ``names``."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    code, details = code or grpc.StatusCode.UNKNOWN, details or ""
    message = translate(details, names)
    if code is grpc.StatusCode.UNAVAILABLE and "failed to connect to all addresses" in details:
        # gRPC's words, after its retries; the address it tried is the useful part.
        tried = _TRIED.search(details)
        where = f" at {tried.group(1)}" if tried else ""
        message = f"the server is not reachable{where} (is it running there?): {details}"
    return make_error(code, message, method, details)


# The address in gRPC's "last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect ...".
_TRIED = re.compile(r"(?:ipv4|ipv6|unix|unix-abstract):(\S+?): ")
