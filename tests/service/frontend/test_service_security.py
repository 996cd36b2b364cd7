"""Bearer-token auth (health stays open) and TLS with a self-signed certificate."""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest

from attention_wire.pb import attention_pb2 as pb
from attention_wire.pb import attention_pb2_grpc as pb_grpc

from ..svc_helpers import health_status, small_prefill

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_tracebacks")]
TOKEN = "s3cret-token"


def _prefill(stub, metadata=None):  # type: ignore[no-untyped-def]
    return list(stub.Prefill(iter(small_prefill()), timeout=10, metadata=metadata))


@pytest.fixture(scope="module")
def auth_server():  # type: ignore[no-untyped-def]
    from ..svc_helpers import ServerHandle, make_config

    handle = ServerHandle(make_config(auth_token=TOKEN, metrics_port=0, access_log=True))
    yield handle
    handle.close()


@pytest.mark.parametrize(
    "metadata",
    [None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)],
     [("x-token", f"Bearer {TOKEN}")]],
    ids=["none", "wrong_token", "no_bearer_prefix", "other_key"],
)
def test_auth_refuses_calls_without_the_token(auth_server, metadata) -> None:  # type: ignore[no-untyped-def]
    stub = auth_server.stub()
    with pytest.raises(grpc.RpcError) as info:
        _prefill(stub, metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5, metadata=metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_refused_call_is_logged_without_the_token(auth_server, caplog) -> None:  # type: ignore[no-untyped-def]
    """One log line per call, refused ones too; the token presented never appears."""
    caplog.set_level(logging.INFO, logger="attention_service")
    with pytest.raises(grpc.RpcError):
        _prefill(auth_server.stub(), [("authorization", "Bearer not-the-secret-xyz")])
    lines = [r.getMessage() for r in caplog.records
             if "code=UNAUTHENTICATED" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("rpc=Prefill ") and "peer=" in lines[0]
    assert "invalid bearer token" in lines[0]
    assert "not-the-secret-xyz" not in caplog.text and TOKEN not in caplog.text


def test_call_lines_name_the_caller_and_request_id(auth_server, caplog) -> None:  # type: ignore[no-untyped-def]
    """With auth on, a call's line says who called (the principal: a digest of the token,
    never the token) and the client's x-request-id; messages are quoted for logfmt."""
    import hashlib

    caplog.set_level(logging.INFO, logger="attention_service")
    md = [("authorization", f"Bearer {TOKEN}"), ("x-request-id", "req 42")]
    _prefill(auth_server.stub(), md)
    stub = auth_server.stub()
    with pytest.raises(grpc.RpcError):  # a refusal whose details hold spaces and quotes
        stub.ListCaches(pb.ListCachesRequest(cache_ids=["nope"]), timeout=5, metadata=md)
    principal = "token-" + hashlib.sha256(TOKEN.encode()).hexdigest()[:16]
    lines = [r.getMessage() for r in caplog.records if "request_id=" in r.getMessage()]
    ok = [ln for ln in lines if ln.startswith("rpc=Prefill code=OK ")]
    assert len(ok) == 1 and f"caller={principal}" in ok[0], lines
    assert 'request_id="req 42"' in ok[0]
    refused = [ln for ln in lines if ln.startswith("rpc=ListCaches ")]
    assert len(refused) == 1 and ' details="' in refused[0], lines
    assert TOKEN not in caplog.text


def test_auth_accepts_the_token(auth_server) -> None:  # type: ignore[no-untyped-def]
    stub = auth_server.stub()
    md = [("authorization", f"Bearer {TOKEN}")]
    assert _prefill(stub, md)[-1].HasField("stats")
    assert stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5, metadata=md).backend == "cpu"
    families = auth_server.scrape()
    refused = sum(
        s.value for s in families["attention_requests"].samples
        if s.name == "attention_requests_total" and s.labels["code"] == "UNAUTHENTICATED"
    )
    assert refused >= 1


def test_health_is_open_without_token(auth_server) -> None:  # type: ignore[no-untyped-def]
    assert health_status(auth_server.channel()) == "SERVING"


def test_no_token_configured_means_open(server) -> None:  # type: ignore[no-untyped-def]
    assert _prefill(server.stub())[-1].HasField("stats")
    assert _prefill(server.stub(), [("authorization", "Bearer anything")])[-1].HasField("stats")


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    key, cert = tmp / "key.pem", tmp / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=30,
    )
    return cert, key


def test_tls(start_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cert, key = _self_signed(tmp_path)
    srv = start_server(tls_cert=str(cert), tls_key=str(key), auth_token=TOKEN)
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    channel = srv.channel(creds)
    assert health_status(channel) == "SERVING"
    stub = pb_grpc.AttentionServiceStub(channel)
    assert _prefill(stub, [("authorization", f"Bearer {TOKEN}")])[-1].HasField("stats")
    # A plaintext client cannot talk to a TLS server.
    with pytest.raises(grpc.RpcError) as info:
        health_status(srv.channel())
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_certificate_the_client_ca_signed(  # type: ignore[no-untyped-def]
    start_server, tmp_path
) -> None:
    from attention_client import AttentionClient, AttentionUnavailableError

    cert, key = _self_signed(tmp_path)
    ca_dir, other_dir = tmp_path / "ca", tmp_path / "other"
    ca_dir.mkdir()
    other_dir.mkdir()
    client_cert, client_key = _self_signed(ca_dir)  # self-signed: its own CA
    stranger_cert, stranger_key = _self_signed(other_dir)
    srv = start_server(tls_cert=str(cert), tls_key=str(key), tls_client_ca=str(client_cert))
    target = f"localhost:{srv.port}"
    q = np.random.default_rng(0).standard_normal((5, 2, 8)).astype(np.float32)
    with AttentionClient(target, tls=str(cert), client_cert=str(client_cert),
                         client_key=str(client_key), timeout=10) as client:
        assert client.attention(q, q, q).shape == q.shape
    for extra in ({}, {"client_cert": str(stranger_cert), "client_key": str(stranger_key)}):
        with AttentionClient(target, tls=str(cert), timeout=5, **extra) as client, \
                pytest.raises(AttentionUnavailableError):
            client.attention(q, q, q)
    # The container's health probe, given the server's environment: it must present a
    # certificate the client CA signed (here not the server's own, which another CA signed).
    env = {"ATTENTION_PORT": str(srv.port), "ATTENTION_TLS_CERT": str(cert),
           "ATTENTION_TLS_KEY": str(key), "ATTENTION_TLS_CLIENT_CA": str(client_cert)}
    assert _health_probe(**env, ATTENTION_HEALTHCHECK_CLIENT_CERT=str(client_cert),
                         ATTENTION_HEALTHCHECK_CLIENT_KEY=str(client_key)).returncode == 0
    assert _health_probe(**env).returncode == 1  # the server's own pair: not the CA's
    del env["ATTENTION_TLS_CLIENT_CA"]
    assert _health_probe(**env).returncode == 1  # no certificate at all


def _health_probe(**env: str):  # type: ignore[no-untyped-def]
    import os
    import subprocess
    import sys
    from pathlib import Path

    probe = Path(__file__).resolve().parents[3] / "deploy" / "healthcheck.py"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ATTENTION_")}
    return subprocess.run([sys.executable, str(probe)], capture_output=True, text=True,
                          env={**clean, **env, "ATTENTION_HEALTHCHECK_TIMEOUT": "5"},
                          timeout=60)


def test_a_refused_call_is_timed_not_recorded_as_zero(start_server) -> None:  # type: ignore[no-untyped-def]
    from ..svc_helpers import sample

    srv = start_server(auth_token=TOKEN, metrics_port=0)
    with pytest.raises(grpc.RpcError) as info:
        _prefill(srv.stub())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    metrics = srv.scrape()
    labels = {"rpc": "Prefill", "code": "UNAUTHENTICATED"}
    assert sample(metrics, "attention_request_duration_seconds",
                  "attention_request_duration_seconds_count", **labels) == 1
    assert sample(metrics, "attention_request_duration_seconds",
                  "attention_request_duration_seconds_sum", **labels) > 0


def test_refused_twins_and_step_streams_count_under_their_rpc(start_server) -> None:  # type: ignore[no-untyped-def]
    """A refused PrefillUnary or PrefillSteps call counts as rpc="Prefill", as the calls
    let in do; a query on rpc="Prefill" sees every refusal."""
    from ..svc_helpers import sample

    srv = start_server(auth_token=TOKEN, metrics_port=0)
    channel = srv.channel()
    for method, call in (
        ("PrefillUnary", lambda m: channel.unary_unary(m)(b"", timeout=5)),
        ("PrefillSteps", lambda m: list(channel.stream_stream(m)(iter([b""]), timeout=5))),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call(f"/attention.v1.AttentionService/{method}")
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    metrics = srv.scrape()
    assert sample(metrics, "attention_requests", "attention_requests_total",
                  rpc="Prefill", code="UNAUTHENTICATED") == 2
    for raw in ("PrefillUnary", "PrefillSteps"):
        assert sample(metrics, "attention_requests", "attention_requests_total",
                      rpc=raw, code="UNAUTHENTICATED") == 0

