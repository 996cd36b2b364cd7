"""Channel set-up shared by the sync and async clients: options, retry policy, credentials;
the placing of connections (``spread``: ``crowded``, ``spread_tries``, ``LostLanes``); and the
rpcs of a connection (``lane_rpcs``: compute and step streams; ``small_rpcs``).

Retries: gRPC itself retries UNAVAILABLE with exponential backoff (service config below),
within the call's deadline, for the unary methods. The chunked upload rpcs (Prefill, Decode,
AppendKV, CachePrefill, CacheDecode: ``STREAM_RPCS``) and the kept-open step streams
(``STEP_RPCS``) are not in that policy: grpcio 1.85 replaying such a stream (one whose
messages fit the per-call retry buffer, ``RETRY_BUFFER_BYTES``) after the server answered
UNAVAILABLE and went away hung past the call's deadline, for good (a drained or crashed
server; ``test_a_stream_cut_off_by_a_server_that_goes_away_fails_in_time``,
``test_a_call_stream_refused_by_a_server_that_goes_away_fails_in_time``). Uploads fail with
AttentionUnavailableError instead, as a request too large to replay always did; a stateless
call refused on a step stream goes again as a unary call, retried there (``_call_streams``);
a ``decode_steps`` step, which may have stored its tokens, fails.

Message sizes stay at gRPC's defaults (4 MiB receive): requests and responses are streamed in
chunks well under it, so no limit needs raising on either side.

Per call (``CallSettings``): one deadline over all of a public call's rpcs, the client's
metadata with the call's merged over it, and ``wait_for_ready``; ``DEFAULT`` marks a
``timeout`` left out (the client's), since ``None`` means no deadline.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import re
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from attention_client._errors import AttentionInputError
from attention_wire import unary_method
from attention_wire.messages import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    parse_response,
    parse_result,
)
from attention_wire.pb import attention_pb2 as pb

SERVICE = "attention.v1.AttentionService"
INFO_METHOD = f"/{SERVICE}/GetServerInfo"
# The client-streaming compute rpcs (PrefillRequest / DecodeRequest in, AttentionResponse out).
STREAM_RPCS = ("Prefill", "Decode", "AppendKV", "CachePrefill", "CacheDecode")
# The stream rpc of each op that has one (its calls as single messages on a kept-open stream).
STEP_METHODS = {
    "CacheDecode": "CacheDecodeSteps", "Prefill": "PrefillSteps", "Decode": "DecodeSteps",
}
# The ops whose single-message calls the clients' stream pools carry: the stateless ones.
POOLED = ("Prefill", "Decode")


# Region rpc -> its reply message's name in attention_wire.pb.
REGION_RPCS = {
    "RegisterRegion": "RegionInfo",
    "UnregisterRegion": "UnregisterRegionResponse",
    "ListRegions": "ListRegionsResponse",
    "ConnectNixl": "ConnectNixlResponse",
}
# Unary KV-cache rpc -> its reply message's name.
CACHE_RPCS = {
    "CreateCaches": "CreateCachesResponse",
    "ReleaseCaches": "ReleaseCachesResponse",
    "ForkCache": "CacheInfo",
    "ListCaches": "ListCachesResponse",
}

RETRY_POLICY = {
    "maxAttempts": 5,  # gRPC caps this at 5
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
# gRPC core (Python) has only this per-call buffer (default 256 KiB); the channel-wide
# "grpc.retry_buffer_size" is a grpc-js option. 8 MiB covers every small request.
RETRY_BUFFER_BYTES = 8 * 1024 * 1024

# The kept-open streams of whole calls (``_call_streams``).
STEP_RPCS = ("PrefillSteps", "DecodeSteps", "CacheDecodeSteps")
# Every method but the chunked uploads and the step streams, each named (a method config
# naming the service alone would cover those too: see the module doc).
RETRIED_METHODS = tuple(
    m.name for m in pb.DESCRIPTOR.services_by_name["AttentionService"].methods
    if m.name not in STREAM_RPCS + STEP_RPCS
)
SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": SERVICE, "method": m} for m in RETRIED_METHODS]
                + [{"service": "grpc.health.v1.Health", "method": "Check"}],
                "retryPolicy": RETRY_POLICY,
            }
        ]
    }
)

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.enable_retries", 1),
    ("grpc.service_config", SERVICE_CONFIG),
    ("grpc.per_rpc_retry_buffer_size", RETRY_BUFFER_BYTES),
    # Keepalive pings detect a dead peer during a long call. Servers by default refuse pings
    # more often than every 5 minutes (and hang up on repeat offenders), so match that.
    ("grpc.keepalive_time_ms", 300_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 0),
    # The server may answer in frames as large as its messages (16 KiB by default): raw gRPC
    # of 96 MiB up / 32 MiB down went 1.43 -> 1.66 GB/s with both ends set (tune_transfer.py).
    ("grpc.http2.max_frame_size", (1 << 24) - 1),
]


# gRPC's own target forms (its name resolvers): taken as they are.
_RESOLVER_PREFIXES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")
_HOST_PORT = re.compile(r"^(\[[^\]]+\]|[^:\[\]/\s]+):(\d{1,5})$")


def check_target(target: Any) -> str:
    """``HOST:PORT`` (``[v6]:PORT`` too) or one of gRPC's resolver forms (``dns:///h:p``,
    ``unix:/path``); AttentionInputError for the common slips: a URL scheme (gRPC would look
    ``http://h:p`` up as a host name) or no port (gRPC would quietly dial 443)."""
    if not isinstance(target, str) or not target.strip():
        raise AttentionInputError(f"target must be 'HOST:PORT', got {target!r}")
    target = target.strip()
    if target.startswith(_RESOLVER_PREFIXES):
        return target
    scheme = re.match(r"^([a-zA-Z][\w+.-]*)://", target)
    if scheme:
        rest = target[scheme.end():].rstrip("/")
        raise AttentionInputError(
            f"target {target!r} has a URL scheme ({scheme.group(1)}://): give 'HOST:PORT', "
            f"e.g. {rest!r} (TLS is the client's tls= argument, not https://)")
    if not _HOST_PORT.match(target):
        if ":" not in target.strip("[]") or target.endswith("]"):
            why = f"needs a port: 'HOST:PORT', e.g. '{target}:50051' (the server's default)"
        elif target.count(":") > 1 and not target.startswith("["):
            why = "is not 'HOST:PORT' (an IPv6 address goes in brackets: '[::1]:50051')"
        else:
            why = "is not 'HOST:PORT' with a numeric port"
        raise AttentionInputError(f"target {target!r} {why}")
    return target


LOAD_BALANCING = ("pick_first", "round_robin")


def check_targets(target: Any) -> tuple[str, ...]:
    """One target (``check_target``) or a non-empty list of distinct ``HOST:PORT`` replicas."""
    if isinstance(target, list | tuple):
        if not target:
            raise AttentionInputError("target: an empty list names no server")
        targets = tuple(check_target(t) for t in target)
        for t in targets:
            if len(targets) > 1 and t.startswith(_RESOLVER_PREFIXES):
                raise AttentionInputError(
                    f"target {t!r}: a list of replicas holds 'HOST:PORT' entries; for a DNS "
                    "name of several replicas give 'dns:///NAME:PORT' alone with "
                    "load_balancing='round_robin'")
        if len(set(targets)) != len(targets):
            raise AttentionInputError(f"target lists a replica twice: {list(targets)}")
        return targets
    return (check_target(target),)


def balanced_target(targets: Sequence[str]) -> str:
    """gRPC's target for round-robin over ``targets``: a ``dns:`` target as it is (gRPC
    resolves it, again as connections fail); a list of ``HOST:PORT`` resolved here, once, into
    one ``ipv4:`` (or ``ipv6:``) address list (a name of several addresses gives each).
    AttentionInputError for a name that does not resolve."""
    if len(targets) == 1 and targets[0].startswith(_RESOLVER_PREFIXES):
        return targets[0]
    v4: list[str] = []
    v6: list[str] = []
    for t in targets:
        host, _, port = t.rpartition(":")
        try:
            infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise AttentionInputError(f"target {t!r} does not resolve: {exc}") from None
        for family, _, _, _, addr in infos:
            if family == socket.AF_INET and f"{addr[0]}:{port}" not in v4:
                v4.append(f"{addr[0]}:{port}")
            elif family == socket.AF_INET6 and f"[{addr[0]}]:{port}" not in v6:
                v6.append(f"[{addr[0]}]:{port}")
    # One address family per target string (gRPC's ipv4:/ipv6: resolvers): IPv4 when any.
    return "ipv4:" + ",".join(v4) if v4 else "ipv6:" + ",".join(v6)


def channel_options(extra: Sequence[tuple[str, Any]] | None = None) -> list[tuple[str, Any]]:
    """Defaults above, with ``extra`` options overriding same-named ones."""
    merged = dict(CHANNEL_OPTIONS)
    merged.update(dict(extra or ()))
    return list(merged.items())


def _pem(value: Any, name: str) -> bytes:
    """PEM given as bytes, or as a file path (str or os.PathLike)."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, str | os.PathLike):
        try:
            with open(value, "rb") as f:
                return f.read()
        except OSError as exc:
            raise AttentionInputError(f"{name}: cannot read {os.fspath(value)!r}: {exc}") from exc
    raise AttentionInputError(
        f"{name} must be PEM bytes or a PEM file path, got {type(value).__name__}"
    )


def credentials(
    tls: Any, client_cert: Any = None, client_key: Any = None
) -> grpc.ChannelCredentials | None:
    """None/False: plaintext. True: system roots. bytes: PEM roots. str/path: PEM file.
    A ``grpc.ChannelCredentials`` is used as it is. ``client_cert`` and ``client_key`` (PEM
    bytes or file paths, both or neither) add a client certificate: mutual TLS."""
    if (client_cert is None) != (client_key is None):
        raise AttentionInputError("client_cert and client_key must be given together")
    mtls = client_cert is not None
    if tls is None or tls is False:
        if mtls:
            raise AttentionInputError(
                "client_cert/client_key need tls: True (system roots) or the server's root "
                "certificate"
            )
        return None
    if isinstance(tls, grpc.ChannelCredentials):
        if mtls:
            raise AttentionInputError(
                "client_cert/client_key cannot be added to ready-made grpc.ChannelCredentials: "
                "build them into those credentials, or pass tls as True, PEM bytes or a path"
            )
        return tls
    if tls is True:
        roots = None
    elif isinstance(tls, bytes | bytearray | str | os.PathLike):
        roots = _pem(tls, "tls")
    else:
        raise AttentionInputError(
            "tls must be None, True, PEM bytes, a PEM file path or grpc.ChannelCredentials, "
            f"got {type(tls).__name__}"
        )
    if not mtls:
        return grpc.ssl_channel_credentials(root_certificates=roots)
    return grpc.ssl_channel_credentials(
        root_certificates=roots, private_key=_pem(client_key, "client_key"),
        certificate_chain=_pem(client_cert, "client_cert"),
    )


# ---- per-call settings -------------------------------------------------------------------


class _Default:
    """The value of a per-call argument left out: the client's setting applies."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()

Metadata = tuple[tuple[str, str | bytes], ...]

_METADATA_KEY = re.compile(r"^[0-9a-z_.-]+$")


def as_metadata(metadata: Any, name: str = "metadata") -> Metadata:
    """Extra gRPC metadata as given (a mapping, or a sequence of (key, value) pairs) ->
    checked pairs. Keys are lowercased; text values must be printable ASCII, ``-bin`` keys take
    bytes. AttentionInputError for what gRPC itself would refuse (as INTERNAL)."""
    if metadata is None:
        return ()
    if isinstance(metadata, Mapping):
        items = list(metadata.items())
    elif isinstance(metadata, str | bytes) or not hasattr(metadata, "__iter__"):
        raise AttentionInputError(
            f"{name} must be a mapping or a sequence of (key, value) pairs, got "
            f"{type(metadata).__name__}"
        )
    else:
        items = list(metadata)
    out: list[tuple[str, str | bytes]] = []
    for i, item in enumerate(items):
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise AttentionInputError(f"{name}[{i}] must be a (key, value) pair, got {item!r}")
        key, value = item
        if not isinstance(key, str) or not _METADATA_KEY.match(key.lower()):
            raise AttentionInputError(
                f"{name} key {key!r} must be a str of letters, digits, '-', '_' and '.'"
            )
        key = key.lower()
        if key.endswith("-bin"):
            if not isinstance(value, bytes | str):
                raise AttentionInputError(
                    f"{name}[{key!r}] must be bytes, got {type(value).__name__}"
                )
        elif not isinstance(value, str) or not all(" " <= c <= "~" for c in value):
            raise AttentionInputError(
                f"{name}[{key!r}] must be a str of printable ASCII (binary values need a key "
                f"ending in '-bin'), got {value!r}"
            )
        out.append((key, value))
    return tuple(out)


def merge_metadata(base: Metadata, extra: Metadata) -> Metadata:
    """``base`` with ``extra`` added; a key ``extra`` names replaces all of ``base``'s."""
    if not extra:
        return base
    replaced = {k for k, _ in extra}
    return tuple(kv for kv in base if kv[0] not in replaced) + extra


def call_metadata(token: str | None, metadata: Any = None) -> Metadata:
    """The client's own metadata: its token as ``authorization``, then ``metadata``."""
    auth: Metadata = (("authorization", f"Bearer {token}"),) if token else ()
    return merge_metadata(auth, as_metadata(metadata))


def check_chunk_bytes(max_chunk_bytes: int) -> int:
    n = int(max_chunk_bytes)
    if not MIN_CHUNK_BYTES <= n <= MAX_CHUNK_BYTES:
        raise AttentionInputError(
            f"max_chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {n}"
        )
    return n


def check_timeout(timeout: float | None, name: str = "timeout") -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise AttentionInputError(
            f"{name} must be positive seconds or None, got {type(timeout).__name__}"
        )
    t = float(timeout)
    if not t > 0:
        raise AttentionInputError(f"{name} must be positive seconds or None, got {timeout!r}")
    return t


def check_wait_for_ready(value: Any, name: str = "wait_for_ready") -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise AttentionInputError(f"{name} must be True, False or None, got {value!r}")


@dataclass(frozen=True)
class CallSettings:
    """What one public call sends with each of its rpcs: a deadline shared by all of them
    (a cache call may create caches first), metadata, wait_for_ready, and the wire field ->
    argument name mapping its errors are reported in."""

    deadline: float | None  # time.monotonic() seconds
    metadata: Metadata
    wait_for_ready: bool | None
    names: Mapping[str, str] | None = None

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of a grpc call (sync or aio)."""
        timeout = None
        if self.deadline is not None:
            timeout = max(self.deadline - time.monotonic(), 0.0)
        return {
            "timeout": timeout, "metadata": self.metadata, "wait_for_ready": self.wait_for_ready
        }

    def named(self, names: Mapping[str, str] | None) -> CallSettings:
        return dataclasses.replace(self, names=names)


# ---- the connections: placing them (``spread``), and their rpcs ----

# ``spread``: connections looked at per channel, per front end of the server (the last one is
# kept whatever its front end). Placed one after another, the last of N clients over N front
# ends must find the one front end left free, a 1/N chance a try: 4 tries in all left all 8 of
# 8 front ends used in 23% of simulated starts (7 of 8 on average, as measured on the H200
# host), 4 per front end in 98% (tools/tuning/sim_spread.py). A try is a new connection and a
# count (5-20 ms), so it is capped; and all the looks of a client's placing take at most
# SPREAD_TIMEOUT_S together: a client made while its server is down waits at most this long.
SPREAD_TRIES_PER_FRONTEND = 4
SPREAD_MIN_TRIES = 4
SPREAD_MAX_TRIES = 64
SPREAD_TIMEOUT_S = 2.0
NEVER_IDLE_MS = 2**31 - 1  # grpc.client_idle_timeout_ms: INT_MAX turns the idle timer off


def crowded(info: pb.ServerInfo) -> bool:
    """Whether the connection that answered ``info`` (GetServerInfo with ``connections``) is
    on a front end that holds more than one connection more than the least-loaded one."""
    return info.frontends > 1 and (
        info.frontend_connections > info.fewest_frontend_connections + 1)


def spread_tries(info: pb.ServerInfo) -> int:
    """How many connections ``spread`` looks at per channel on the server that sent ``info``."""
    return max(SPREAD_MIN_TRIES,
               min(SPREAD_MAX_TRIES, SPREAD_TRIES_PER_FRONTEND * info.frontends))


class LostLanes:
    """Which of a client's connections were lost since ``spread`` placed them. gRPC reconnects
    a lost connection on its own (a server or front end restarted, the network dropped it),
    and the kernel hashes the new one to any front end: after a server restart every client
    reconnects at once, as unevenly as if none had spread. The clients feed this each lane's
    connectivity (``seen``) and place a lost lane again before its next compute call."""

    def __init__(self, lanes: int) -> None:
        self._ready = [False] * lanes  # connected since (re)placed
        self._lost = [False] * lanes

    def seen(self, lane: int, state: grpc.ChannelConnectivity) -> None:
        """Lane ``lane``'s channel is in ``state`` now."""
        if state is grpc.ChannelConnectivity.READY:
            self._ready[lane] = True
        elif state is not grpc.ChannelConnectivity.SHUTDOWN and self._ready[lane]:
            self._ready[lane] = False  # it had a connection, and has none now
            self._lost[lane] = True

    def lost(self, lane: int) -> bool:
        return self._lost[lane]

    def placed(self, lane: int, new_channel: bool = False) -> None:
        """Lane ``lane`` was looked at (and on a new channel when ``new_channel``)."""
        self._lost[lane] = False
        if new_channel:
            self._ready[lane] = False


def lane_rpcs(channel: Any) -> dict[str, Any]:
    """A connection's compute rpcs (a ``grpc`` or ``grpc.aio`` channel: the same calls make
    both), by method name: the stream and unary twin of each, the step streams, and
    GetServerInfo (``spread`` asks each connection). Requests are pre-serialized bytes
    (``attention_wire.messages``); responses are parsed lazily (``attention_wire.messages``)."""
    return {
        method: channel.stream_stream(
            f"/{SERVICE}/{method}", response_deserializer=parse_response
        )
        for method in STREAM_RPCS
    } | {
        unary_method(method): channel.unary_unary(
            f"/{SERVICE}/{unary_method(method)}", response_deserializer=parse_result
        )
        for method in STREAM_RPCS
    } | {
        method: channel.stream_stream(f"/{SERVICE}/{method}")
        for method in STEP_METHODS.values()
    } | {
        INFO_METHOD: channel.unary_unary(
            INFO_METHOD, request_serializer=pb.GetServerInfoRequest.SerializeToString,
            response_deserializer=pb.ServerInfo.FromString,
        ),
    }


def small_rpcs(channel: Any) -> dict[str, Any]:
    """The small rpcs, which go over lane 0's channel (``ClientCore._unary_rpc``): regions,
    caches, GetServerInfo and the health check, by name."""
    rpcs = {
        method: channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=_serialize,
                                    response_deserializer=getattr(pb, reply).FromString)
        for method, reply in (REGION_RPCS | CACHE_RPCS).items()
    }
    rpcs["GetServerInfo"] = channel.unary_unary(
        INFO_METHOD, request_serializer=_serialize, response_deserializer=pb.ServerInfo.FromString)
    rpcs["Health.Check"] = channel.unary_unary(
        "/grpc.health.v1.Health/Check", request_serializer=_serialize,
        response_deserializer=health_pb2.HealthCheckResponse.FromString)
    return rpcs


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()
