"""Fixtures of the client tests: an in-process fake server (unit tests), the real one (e2e)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._fakes import FakeAttention, start_fake
from ._server import RunningServer, require_server, start_server


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[FakeAttention, str]]:
    server, servicer, port = start_fake()
    yield servicer, f"localhost:{port}"
    server.stop(None)


@pytest.fixture
def fake(fake_server: tuple[FakeAttention, str]) -> tuple[FakeAttention, str]:
    """The module's fake server with fresh knobs for this test."""
    from ._fakes import Knobs

    servicer, target = fake_server
    servicer.knobs = Knobs()
    return servicer, target


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    """The real server on the cpu backend (skips when attention_service is absent)."""
    require_server()
    running = start_server()
    yield running
    running.stop()
