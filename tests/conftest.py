"""Shared test set-up: the ``gpu`` and ``slow`` markers (declared in pyproject.toml), and UCX
kept to loopback."""

from __future__ import annotations

import os

import pytest
import torch

# NIXL's UCX agents (tests' clients, servers, the metadata helper) on loopback only: an agent
# advertises every network interface it sees, and tests/deploy/test_netns_hosts.py makes and
# removes veth interfaces while other tests run. A peer's blob naming one that was gone took
# the server's metadata helper 16-20 s to read (a CI replica failed on its 20 s limit;
# reproduced on the dev box with the two test files side by side: 0.7 s with this set).
# Before any agent starts; inherited by the servers the tests start.
os.environ.setdefault("UCX_NET_DEVICES", "lo")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = torch.cuda.is_available()
    run_slow = os.environ.get("RUN_SLOW") == "1"
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow; set RUN_SLOW=1"))
