"""Fixtures of the client tests: an in-process fake server (unit tests)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._fakes import FakeAttention, start_fake


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
