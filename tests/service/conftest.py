"""Fixtures: real servers (cpu backend, ephemeral ports) on background event loops."""

from __future__ import annotations

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
