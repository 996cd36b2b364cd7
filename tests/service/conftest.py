"""Fixtures: real servers (cpu backend, ephemeral ports) on background event loops."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .svc_helpers import ServerHandle, make_config


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    """One shared default server per test module (small output chunks to exercise slicing)."""
    handle = ServerHandle(make_config(metrics_port=0, chunk_bytes=64 * 1024))
    yield handle
    handle.close()


@pytest.fixture
def start_server() -> Iterator[Callable[..., ServerHandle]]:
    """Factory for servers with their own config or backend; all closed at teardown."""
    handles: list[ServerHandle] = []

    def start(backend: Any = None, **overrides: Any) -> ServerHandle:
        handle = ServerHandle(make_config(**overrides), backend=backend)
        handles.append(handle)
        return handle

    yield start
    for h in handles:
        h.close()


@pytest.fixture
def no_tracebacks(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The attack suites' check (issue 63): a client-caused error is logged as one line (or
    not at all), never with a traceback. Fails the test on any record that carries one."""
    yield
    records = caplog.get_records("setup") + caplog.get_records("call")  # not teardown's
    traced = [f"{r.levelname} {r.getMessage()}" for r in records
              if (r.exc_info or r.exc_text or "Traceback" in r.getMessage())
              and not _closed_loop(r)]
    assert not traced, f"tracebacks logged: {traced}"


def _closed_loop(record: logging.LogRecord) -> bool:
    """grpc's poller thread posting to the loop of a server an earlier test closed (seen once
    in CI, logged by asyncio during the next test's setup): the harness, not a server."""
    exc = record.exc_info[1] if record.exc_info else None
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
