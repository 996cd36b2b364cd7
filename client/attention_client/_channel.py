"""Channel set-up shared by the sync and async clients: options, retry policy, credentials.

Retries: gRPC itself retries UNAVAILABLE with exponential backoff (service config below), for
every method, within the call's deadline. A client-streaming call can only be replayed while
the messages sent so far fit the per-call retry buffer (``RETRY_BUFFER_BYTES``); once a request
outgrows it, or once the server has started answering, the call is committed and an
UNAVAILABLE then surfaces as AttentionError. So small requests (and every connection failure,
which happens before anything is sent) are retried; a large request cut off mid-stream is not.

Message sizes stay at gRPC's defaults (4 MiB receive): requests and responses are streamed in
chunks well under it, so no limit needs raising on either side.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import grpc

SERVICE = "attention.v1.AttentionService"
INFO_METHOD = f"/{SERVICE}/GetServerInfo"
# The client-streaming compute rpcs (PrefillRequest / DecodeRequest in, AttentionResponse out).
STREAM_RPCS = ("Prefill", "Decode", "AppendKV", "CachePrefill", "CacheDecode")
# Region rpc -> its reply message's name in attention_wire.pb.
REGION_RPCS = {
    "RegisterRegion": "RegionInfo",
    "UnregisterRegion": "UnregisterRegionResponse",
    "ListRegions": "ListRegionsResponse",
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

SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": SERVICE}, {"service": "grpc.health.v1.Health"}],
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


def channel_options(extra: Sequence[tuple[str, Any]] | None = None) -> list[tuple[str, Any]]:
    """Defaults above, with ``extra`` options overriding same-named ones."""
    merged = dict(CHANNEL_OPTIONS)
    merged.update(dict(extra or ()))
    return list(merged.items())


def credentials(tls: Any) -> grpc.ChannelCredentials | None:
    """None/False: plaintext. True: system roots. bytes: PEM roots. str/path: PEM file."""
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    if isinstance(tls, grpc.ChannelCredentials):
        return tls
    if isinstance(tls, bytes | bytearray):
        return grpc.ssl_channel_credentials(root_certificates=bytes(tls))
    if isinstance(tls, str | os.PathLike):
        with open(tls, "rb") as f:
            return grpc.ssl_channel_credentials(root_certificates=f.read())
    raise ValueError(
        f"tls must be None, True, PEM bytes or a PEM file path, got {type(tls).__name__}"
    )


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    t = float(timeout)
    if not t > 0:
        raise ValueError(f"timeout must be positive seconds or None, got {timeout!r}")
    return t
