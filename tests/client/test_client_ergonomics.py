"""Per-call settings (timeout, metadata, wait_for_ready), the exception hierarchy, error
messages in the caller's argument names, and mutual TLS; against the in-process fake server."""

from __future__ import annotations

import asyncio
import inspect
import pickle
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

import attention_client
from attention_client import (
    AsyncAttentionClient,
    AsyncKvCache,
    AttentionAuthError,
    AttentionClient,
    AttentionError,
    AttentionInputError,
    AttentionNotFoundError,
    AttentionResourceError,
    AttentionTimeoutError,
    AttentionUnavailableError,
    KvCache,
    ProtocolError,
)
from attention_client import _argnames as argnames
from attention_client._errors import from_rpc_error, translate

from ._fakes import start_fake

CLIENT_DIR = Path(attention_client.__file__).parent


def _q(*shape: int) -> np.ndarray:
    return np.arange(np.prod(shape), dtype=np.float16).reshape(shape)


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


# ---- every public call takes the three settings -----------------------------------------------

_NO_RPC = {"close", "kv_cache"}  # close: best effort with the client's settings; kv_cache: no rpc


@pytest.mark.parametrize("cls", [AttentionClient, AsyncAttentionClient, KvCache, AsyncKvCache])
def test_every_public_call_takes_timeout_metadata_wait_for_ready(cls):
    methods = [
        name for name, fn in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") and name not in _NO_RPC
    ]
    assert len(methods) >= 7, methods
    for name in methods:
        params = inspect.signature(getattr(cls, name)).parameters
        for arg in ("timeout", "metadata", "wait_for_ready"):
            assert arg in params, f"{cls.__name__}.{name} lacks {arg}="
            assert params[arg].kind is inspect.Parameter.KEYWORD_ONLY, (name, arg)
        assert params["timeout"].default is attention_client.DEFAULT, name
    if cls in (AttentionClient, AsyncAttentionClient):
        params = inspect.signature(cls).parameters
        for arg in ("metadata", "wait_for_ready", "client_cert", "client_key"):
            assert arg in params, arg


# ---- timeout -------------------------------------------------------------------------------


def test_per_call_timeout_overrides_the_clients(fake):
    servicer, target = fake
    servicer.knobs.sleep = 0.4
    q = _q(4, 2, 8)
    with AttentionClient(target, timeout=30) as client:
        start = time.monotonic()
        with pytest.raises(AttentionTimeoutError) as exc:
            client.attention(q, q, q, timeout=0.1)
        assert time.monotonic() - start < 0.35
        with pytest.raises(AttentionTimeoutError):
            client.info(timeout=0.1)
    err = exc.value
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.method == "Prefill"
    assert isinstance(err, AttentionError) and isinstance(err, TimeoutError)
    assert not isinstance(err, ValueError)
    with AttentionClient(target, timeout=0.1) as client:  # None per call: no deadline at all
        assert np.array_equal(client.attention(q, q, q, timeout=None), q)


def test_async_per_call_timeout(fake):
    servicer, target = fake
    servicer.knobs.sleep = 0.4
    q = _q(4, 2, 8)

    async def main():
        async with AsyncAttentionClient(target, timeout=30) as client:
            with pytest.raises(AttentionTimeoutError) as exc:
                await client.decode(q[:2], q, q, [0, 2, 4], timeout=0.1)
            with pytest.raises(AttentionTimeoutError):
                await client.info(timeout=0.1)
            return exc.value

    assert asyncio.run(main()).code == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("bad", [0, -1, "5", True, float("nan")])
def test_bad_timeout_is_an_input_error(fake, bad):
    _, target = fake
    q = _q(2, 1, 8)
    with AttentionClient(target) as client, pytest.raises(AttentionInputError, match="timeout"):
        client.attention(q, q, q, timeout=bad)


# ---- metadata ------------------------------------------------------------------------------


def test_metadata_reaches_the_server_merged_with_the_clients(fake):
    servicer, target = fake
    q = _q(2, 1, 8)
    seen = servicer.knobs.metadata
    with AttentionClient(target, token="s3cret", metadata={"x-tenant": "a"}) as client:
        client.attention(q, q, q, metadata=[("x-request-id", "42"), ("X-Trace", "t")])
        assert seen[-1]["authorization"] == "Bearer s3cret" and seen[-1]["x-tenant"] == "a"
        assert seen[-1]["x-request-id"] == "42" and seen[-1]["x-trace"] == "t"  # lowercased
        client.info(metadata={"x-tenant": "b", "authorization": "Bearer other"})
        assert seen[-1]["x-tenant"] == "b" and seen[-1]["authorization"] == "Bearer other"
        client.decode(q, q, q, [0, 1, 2], metadata={"trace-bin": b"\x00\x01"})
        assert seen[-1]["trace-bin"] == b"\x00\x01" and seen[-1]["x-tenant"] == "a"
        client.info()  # per-call metadata does not stick
        assert "x-request-id" not in seen[-1] and seen[-1]["authorization"] == "Bearer s3cret"


def test_async_metadata(fake):
    servicer, target = fake
    q = _q(2, 1, 8)

    async def main():
        async with AsyncAttentionClient(target, token="t", metadata=[("x-a", "1")]) as client:
            await client.attention(q, q, q, metadata={"x-b": "2"})
            await client.info(metadata={"x-c": "3"})

    asyncio.run(main())
    prefill, info = servicer.knobs.metadata[-2:]
    assert prefill["authorization"] == "Bearer t"
    assert prefill["x-a"] == "1" and prefill["x-b"] == "2"
    assert info["x-a"] == "1" and info["x-c"] == "3" and "x-b" not in info


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ({"x a": "1"}, "key 'x a'"),
        ({"x-a": "line\nbreak"}, "printable ASCII"),
        ({"x-a": b"bytes"}, "-bin"),
        ({"x-a-bin": 3}, "must be bytes"),
        ("x-a=1", "mapping or a sequence"),
        ([("x-a",)], r"metadata\[0\]"),
    ],
)
def test_bad_metadata_is_an_input_error(fake, metadata, match):
    _, target = fake
    with AttentionClient(target) as client, pytest.raises(AttentionInputError, match=match):
        client.info(metadata=metadata)
    with pytest.raises(ValueError, match=match):
        AttentionClient(target, metadata=metadata)


# ---- wait_for_ready ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_wait_for_ready_waits_for_a_server_that_starts_late():
    port = _free_port()
    started: list = []

    def start_later() -> None:
        time.sleep(0.5)
        started.append(start_fake(port=port)[0])

    thread = threading.Thread(target=start_later)
    q = _q(3, 1, 8)
    try:
        with AttentionClient(f"localhost:{port}", timeout=20) as client:
            thread.start()
            assert client.health(wait_for_ready=True) == "SERVING"
            assert np.array_equal(client.attention(q, q, q, wait_for_ready=True), q)
    finally:
        thread.join()
        for server in started:
            server.stop(None)


def test_wait_for_ready_with_no_server_ends_at_the_deadline():
    """Not UNAVAILABLE after gRPC's retries: the call waits until its timeout."""
    port = _free_port()
    q = _q(3, 1, 8)
    with AttentionClient(f"localhost:{port}", wait_for_ready=True) as client:
        start = time.monotonic()
        with pytest.raises(AttentionTimeoutError):
            client.attention(q, q, q, timeout=0.5)
        assert 0.45 < time.monotonic() - start < 5

    async def main():
        async with AsyncAttentionClient(f"localhost:{port}", timeout=0.3) as client:
            with pytest.raises(AttentionTimeoutError):
                await client.info(wait_for_ready=True)

    asyncio.run(main())


class _Capture(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """What each call asked gRPC for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float | None, dict, bool | None]] = []

    def _note(self, details) -> None:  # type: ignore[no-untyped-def]
        self.calls.append((details.method.rsplit("/", 1)[-1], details.timeout,
                           dict(details.metadata or ()), details.wait_for_ready))

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        self._note(details)
        return continuation(details, request)

    def intercept_stream_stream(self, continuation, details, request_iterator):  # type: ignore[no-untyped-def]
        self._note(details)
        return continuation(details, request_iterator)


def test_settings_reach_every_kind_of_rpc(fake):
    """Compute, cache, region, info and health calls each pass the per-call settings on (the
    fake answers the cache and region rpcs UNIMPLEMENTED; the call still went out). The fake
    has no call streams and no unary twins either: the first compute call tries PrefillSteps,
    then PrefillUnary, gets UNIMPLEMENTED from each and goes on as a stream, and the client
    streams from then on. A call stream carries no gRPC deadline (it outlives its calls; the
    call's own deadline cancels it)."""
    _, target = fake
    capture = _Capture()
    q = _q(2, 1, 8)
    per_call = {"timeout": 7, "metadata": {"x-call": "1"}, "wait_for_ready": True}
    with AttentionClient(target, timeout=3, wait_for_ready=False, interceptors=[capture],
                         metadata={"x-client": "c"}) as client:
        client.attention(q, q, q, **per_call)
        client.decode(q, q, q, [0, 1, 2], **per_call)
        client.info(**per_call)
        calls = [
            lambda: client.list_caches(**per_call),
            lambda: client.release_caches(["a"], **per_call),
            lambda: client.kv_pool_info(**per_call),
            lambda: client.decode_step(q, ["a", "b"], q, q, **per_call),
            lambda: client.list_regions(**per_call),
            lambda: client.register_shm(4096, **per_call),
            lambda: client.kv_cache(1, 8, "float16").append("a", q, q, **per_call),
            lambda: client.kv_cache(1, 8, "float16").fork("a", "b", **per_call),
        ]
        for call in calls:
            with pytest.raises(AttentionError) as exc:
                call()
            assert exc.value.code == grpc.StatusCode.UNIMPLEMENTED
        client.info()  # the client's own settings
    # First, at construction, ``spread``'s look at the connection: the client's metadata, its
    # own short deadline, fail fast (the fake is not crowded: one look).
    spread, timeout, metadata, wait = capture.calls.pop(0)
    assert spread == "GetServerInfo" and 1 < timeout <= 2 and wait is False
    assert metadata == {"x-client": "c"}
    methods = [c[0] for c in capture.calls]
    assert methods == [
        "PrefillSteps", "PrefillUnary", "Prefill", "Decode", "GetServerInfo", "ListCaches",
        "ReleaseCaches", "ListCaches", "CacheDecode", "ListRegions", "RegisterRegion",
        "CreateCaches", "ForkCache", "GetServerInfo",
    ]
    assert capture.calls[0][1] is None
    for method, timeout, metadata, wait in capture.calls[:-1]:
        assert method == "PrefillSteps" or 6 < timeout <= 7, method
        assert wait is True, method
        # A cache handle's calls carry its session key too (for a proxy's affinity).
        session = metadata.pop("x-attention-session", None)
        assert (session is not None) == (method in ("CreateCaches", "ForkCache")), method
        assert metadata == {"x-client": "c", "x-call": "1"}, method
    _, timeout, metadata, wait = capture.calls[-1]
    assert 2 < timeout <= 3 and wait is False and metadata == {"x-client": "c"}


def test_one_timeout_covers_every_rpc_of_a_call():
    """A handle's first append creates the cache, then appends; decode_step may look layouts
    up first: the deadline runs from the start of the call, over all of its rpcs."""
    with AttentionClient("localhost:1") as client:
        settings = client._settings(timeout=5)
        time.sleep(0.2)
        assert 4.7 < settings.kwargs()["timeout"] <= 4.81
        assert client._settings(timeout=None).kwargs()["timeout"] is None


# ---- one exception type for input mistakes ----------------------------------------------------


@pytest.mark.parametrize(
    "mistake",
    [
        lambda c: c.attention(_q(2, 8), _q(2, 1, 8), _q(2, 1, 8)),  # rank
        lambda c: c.attention(_q(2, 1, 8), _q(2, 1, 8), _q(2, 1, 8), cu_seqlens=[[0, 2]]),
        lambda c: c.decode(_q(2, 1, 8), _q(2, 1, 8), _q(2, 1, 8), [0, 2]),
        lambda c: c.attention(_q(2, 1, 8), _q(2, 1, 8), _q(2, 1, 8), softmax_scale="x"),
        lambda c: c.decode(_q(1, 1, 8), _q(2, 1, 8), _q(2, 1, 8), [0, 2], num_splits=1.5),
        lambda c: c.kv_cache(0, 8, "float16"),
        lambda c: c.kv_cache(1, 8, "float16").append([], _q(2, 1, 8), _q(2, 1, 8)),
        lambda c: c.release_caches(),
        lambda c: c.register_shm(4096, name="no spaces"),
        lambda c: c.info(wait_for_ready="yes"),
    ],
)
def test_input_mistakes_are_both_value_errors_and_attention_errors(mistake):
    with AttentionClient("localhost:1") as client, pytest.raises(AttentionInputError) as exc:
        mistake(client)
    err = exc.value
    assert isinstance(err, ValueError) and isinstance(err, AttentionError)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.method == ""
    assert err.server_details is None and str(err) == err.details  # the message alone


@pytest.mark.parametrize(
    "kwargs",
    [
        {"timeout": -1}, {"channels": 0}, {"max_chunk_bytes": 1}, {"tls": 3.5},
        {"client_cert": b"x", "client_key": b"y"}, {"client_cert": b"x", "tls": True},
        {"tls": True, "client_cert": "/no/such.pem", "client_key": "/no/such.key"},
        {"wait_for_ready": 1}, {"metadata": {"k": object()}},
    ],
)
def test_constructor_mistakes_are_input_errors(kwargs):
    with pytest.raises(AttentionInputError):
        AttentionClient("localhost:1", **kwargs)
    try:  # what code written against plain ValueError does still works
        AsyncAttentionClient("localhost:1", **kwargs)
    except ValueError as e:
        assert isinstance(e, AttentionError)
    else:
        pytest.fail("no error")


def test_no_bare_value_error_left_in_the_client():
    """Client-side mistakes raise AttentionInputError; a new check must not bring back a bare
    ValueError (except AttentionError would miss it)."""
    offenders = [
        f"{path.name}:{i}" for path in CLIENT_DIR.glob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "raise ValueError" in line or "raise TypeError" in line
    ]
    assert not offenders, offenders


# ---- status codes -> subclasses ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, AttentionInputError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, AttentionTimeoutError),
        (grpc.StatusCode.UNAVAILABLE, AttentionUnavailableError),
        (grpc.StatusCode.UNAUTHENTICATED, AttentionAuthError),
        (grpc.StatusCode.PERMISSION_DENIED, AttentionAuthError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, AttentionResourceError),
        (grpc.StatusCode.NOT_FOUND, AttentionNotFoundError),
        (grpc.StatusCode.ABORTED, AttentionError),
        (grpc.StatusCode.INTERNAL, AttentionError),
    ],
)
def test_status_codes_map_to_subclasses(code, cls):
    err = from_rpc_error(_RpcError(code, "header.q: boom"), "Prefill", argnames.attention())
    assert type(err) is cls and err.code == code and err.method == "Prefill"
    assert err.details == "q: boom" and err.server_details == "header.q: boom"
    assert str(err) == f"Prefill failed: {code.name}: q: boom"
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is cls and str(again) == str(err)
    assert again.server_details == err.server_details
    proto = pickle.loads(pickle.dumps(ProtocolError("rows missing", "Decode")))
    assert type(proto) is ProtocolError and str(proto) == "Decode failed: DATA_LOSS: rows missing"


def test_server_invalid_argument_is_an_input_error_in_argument_names(fake):
    servicer, target = fake
    servicer.knobs.abort = (grpc.StatusCode.INVALID_ARGUMENT,
                            "header.cu_seqlens_q: must end at the token count 4, got 3")
    q = _q(4, 1, 8)
    with AttentionClient(target) as client:
        with pytest.raises(ValueError) as exc:  # old code catching ValueError still does
            client.attention(q, q, q, [0, 1, 4])
        err = exc.value
        assert isinstance(err, AttentionInputError)
        assert str(err) == (
            "Prefill failed: INVALID_ARGUMENT: cu_seqlens: must end at the token count 4, got 3"
        )
        assert err.server_details == "header.cu_seqlens_q: must end at the token count 4, got 3"
        servicer.knobs.abort = (grpc.StatusCode.INVALID_ARGUMENT,
                                "header.k.shape[1]: num_heads (3) must be a multiple of 2")
        with pytest.raises(AttentionInputError, match=r"^Decode failed: INVALID_ARGUMENT: k\.s"):
            client.decode(q, q, q, [0, 1, 2, 3, 4])


# ---- wire field names -> argument names ---------------------------------------------------------


_ATT, _ATT4 = argnames.attention(), argnames.attention(four_d=True)


@pytest.mark.parametrize(
    ("names", "wire", "user"),
    [
        (_ATT, "header.cu_seqlens_q: must start at 0", "cu_seqlens: must start at 0"),
        (_ATT, "header.cu_seqlens_k: empty (so equal to cu_seqlens_q, ending at 9)",
         "cu_seqlens_k: empty (so equal to cu_seqlens, ending at 9)"),
        (_ATT, "header.q.shape[2]: head_dim 12 unsupported", "q.shape[2]: head_dim 12 unsupported"),
        (_ATT4, "header.k.shape[1]: num_heads (3) ...", "k.shape[2]: num_heads (3) ..."),
        (_ATT4, "header.q.shape[0]: sequences: 9", "q.shape[0] * q.shape[1]: sequences: 9"),
        (_ATT, "header.softmax_scale: must be finite", "softmax_scale: must be finite"),
        (argnames.decode(), "header.num_splits: must be >= 0", "num_splits: must be >= 0"),
        (argnames.cache_decode(), "header.v.shape: [1, 2, 8] differs from k's shape [1, 1, 8]",
         "v_new.shape: [1, 2, 8] differs from k_new's shape [1, 1, 8]"),
        (argnames.cache_decode("cache_ids"), "header.cache.cache_ids[1]: no cache 'x'",
         "cache_ids[1]: no cache 'x'"),
        (argnames.cache_append(), "header.cu_seqlens_k: must start at 0",
         "cu_seqlens: must start at 0"),
        (argnames.cache_append(), "cache_ids[0]: cache 'a' exists", "ids[0]: cache 'a' exists"),
        (argnames.cache_append(), "layout.head_dim: 12 unsupported", "head_dim: 12 unsupported"),
        (argnames.cache_prefill(), "header.cu_seqlens_q: must start at 0",
         "cu_seqlens_q: must start at 0"),
        (argnames.REGISTER, "byte_size: must be positive", "nbytes: must be positive"),
        # left alone: paths not in the mapping, bytes-level fields, ordinary words, no mapping
        (_ATT, "chunks[q].offset: 5 is out of order", None),
        (_ATT, "header.regions.out.byte_size: 4 bytes", None),
        (_ATT, "header: request tensors take 9 bytes", None),
        (None, "header.cu_seqlens_q: must start at 0", None),
    ],
)
def test_wire_field_names_become_argument_names(names, wire, user):
    assert translate(wire, names) == (wire if user is None else user)


def test_client_side_messages_name_the_arguments():
    with AttentionClient("localhost:1") as client:
        with pytest.raises(AttentionInputError, match="^cu_seqlens must hold integers"):
            client.attention(_q(2, 1, 8), _q(2, 1, 8), _q(2, 1, 8), cu_seqlens=[0.0, 2.0])
        with pytest.raises(AttentionInputError, match="^cu_seqlens_k must have batch"):
            client.decode(_q(1, 1, 8), _q(2, 1, 8), _q(2, 1, 8), [0, 1, 2])
        with client.kv_cache(1, 8, "float16") as cache:
            with pytest.raises(AttentionInputError, match="^k_new and v_new must both"):
                cache.decode(_q(1, 1, 8), "a", _q(1, 1, 8))
            with pytest.raises(AttentionInputError, match=r"^ids\[1\] 'a' appears twice"):
                cache.append(["a", "a"], _q(2, 1, 8), _q(2, 1, 8), [0, 1, 2])
        with pytest.raises(AttentionInputError, match="^cache_ids names 2 caches"):
            client.decode_step(_q(1, 1, 8), ["a", "b"], _q(1, 1, 8), _q(1, 1, 8))


# ---- mutual TLS -----------------------------------------------------------------------------


def _cert(tmp: Path, name: str) -> tuple[Path, Path]:
    key, cert = tmp / f"{name}.key", tmp / f"{name}.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}",
         "-addext", f"subjectAltName=DNS:{name}"],
        check=True, capture_output=True,
    )
    return key, cert


def test_mutual_tls_with_a_client_certificate(tmp_path):
    server_key, server_cert = _cert(tmp_path, "localhost")
    client_key, client_cert = _cert(tmp_path, "client")
    creds = grpc.ssl_server_credentials(
        [(server_key.read_bytes(), server_cert.read_bytes())],
        root_certificates=client_cert.read_bytes(), require_client_auth=True,
    )
    server, _, port = start_fake(creds)
    target, q = f"localhost:{port}", _q(3, 1, 8)
    try:
        with AttentionClient(target, tls=str(server_cert), client_cert=str(client_cert),
                             client_key=client_key) as client:
            assert np.array_equal(client.attention(q, q, q), q)
        with AttentionClient(target, tls=server_cert.read_bytes(),
                             client_cert=client_cert.read_bytes(),
                             client_key=client_key.read_bytes()) as client:
            assert client.info()["device"] == "fake"
        with AttentionClient(target, tls=str(server_cert), timeout=3) as no_cert, pytest.raises(
            AttentionUnavailableError
        ):
            no_cert.attention(q, q, q)
    finally:
        server.stop(None)


@pytest.mark.parametrize(("target", "words"), [
    ("localhost", "needs a port: 'HOST:PORT', e.g. 'localhost:50051'"),
    ("http://localhost:50051", "URL scheme (http://): give 'HOST:PORT', e.g. 'localhost:50051'"),
    ("https://gpu-box:443/", "tls= argument"),
    ("::1", "IPv6 address goes in brackets"),
    ("gpu-box:grpc", "numeric port"),
    ("", "must be 'HOST:PORT'"),
])
def test_a_target_gRPC_would_misread_is_refused_at_once(target: str, words: str) -> None:
    """A scheme would be looked up as a host name and a missing port dialled as 443: both
    fail later with gRPC's words; here they fail at construction, saying what to write."""
    for cls in (AttentionClient, AsyncAttentionClient):
        with pytest.raises(AttentionInputError, match=re.escape(words)):
            cls(target)


@pytest.mark.parametrize("target", ["127.0.0.1:50051", "[::1]:50051", "dns:///localhost:5",
                                    "unix:/tmp/attention.sock"])
def test_host_port_and_grpc_resolver_targets_are_taken(target: str) -> None:
    with AttentionClient(target, spread=False) as c:
        assert c.target == target


def test_an_unreachable_server_is_named_in_the_error() -> None:
    reachable = r"not reachable at 127\.0\.0\.1:1 \(is it running there\?\)"
    with (AttentionClient("127.0.0.1:1", spread=False, timeout=2) as c,
          pytest.raises(AttentionUnavailableError, match=reachable)):
        c.info()
