"""Container health probe: the standard gRPC health check (grpc.health.v1) against the server.

Exit status 0 when the server reports SERVING, 1 otherwise (Docker's HEALTHCHECK convention).
The server turns SERVING only after its kernels are warmed up, so "healthy" means "ready".

Usage: python healthcheck.py [HOST:PORT]   (default 127.0.0.1:$ATTENTION_PORT, port 50051)
Reads the server's own environment: ATTENTION_TLS_CERT (probe over TLS, trusting that
certificate), ATTENTION_AUTH_TOKEN (sent as a bearer token in case the server guards health).
With ATTENTION_TLS_CLIENT_CA (mutual TLS: the server wants a client certificate) the probe
presents ATTENTION_HEALTHCHECK_CLIENT_CERT / ATTENTION_HEALTHCHECK_CLIENT_KEY, by default the
server's own certificate and key (enough where one CA signs both; else name a client pair).
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = float(os.environ.get("ATTENTION_HEALTHCHECK_TIMEOUT", "4"))


def _channel(target: str) -> grpc.Channel:
    cert = os.environ.get("ATTENTION_TLS_CERT")
    if not cert:
        return grpc.insecure_channel(target)
    with open(cert, "rb") as f:
        roots = f.read()
    # The certificate names the public host, not 127.0.0.1: verify it against that name.
    name = os.environ.get("ATTENTION_HEALTHCHECK_TLS_NAME", "localhost")
    pair: dict[str, bytes] = {}
    if os.environ.get("ATTENTION_TLS_CLIENT_CA"):  # mutual TLS: present a certificate too
        chain = os.environ.get("ATTENTION_HEALTHCHECK_CLIENT_CERT") or cert
        key = (os.environ.get("ATTENTION_HEALTHCHECK_CLIENT_KEY")
               or os.environ.get("ATTENTION_TLS_KEY", ""))
        with open(chain, "rb") as f:
            pair["certificate_chain"] = f.read()
        with open(key, "rb") as f:
            pair["private_key"] = f.read()
    creds = grpc.ssl_channel_credentials(root_certificates=roots, **pair)
    return grpc.secure_channel(target, creds, options=[("grpc.ssl_target_name_override", name)])


def main(argv: list[str]) -> int:
    target = argv[1] if len(argv) > 1 else f"127.0.0.1:{os.environ.get('ATTENTION_PORT', '50051')}"
    token = os.environ.get("ATTENTION_AUTH_TOKEN")
    metadata = [("authorization", f"Bearer {token}")] if token else None
    try:
        with _channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S, metadata=metadata
            )
    except grpc.RpcError as e:
        print(f"unhealthy: {target}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
