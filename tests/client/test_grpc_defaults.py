"""grpc's I/O settings are applied before grpc loads, and only when the user left them alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attention_wire import grpc_defaults


def _fresh(code: str, env_value: str | None) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter (GRPC_EXPERIMENTS set to ``env_value``, or unset);
    it prints a JSON object."""
    env = {k: v for k, v in os.environ.items() if k != grpc_defaults.ENV}
    if env_value is not None:
        env[grpc_defaults.ENV] = env_value
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


_REPORT = ("import json, os, sys; print(json.dumps({'env': os.environ.get('GRPC_EXPERIMENTS'), "
           "'grpc': 'grpc' in sys.modules}))")


@pytest.mark.parametrize("package", ["attention_client", "attention_service.server"])
def test_importing_the_package_sets_the_legacy_io_before_grpc_loads(package: str) -> None:
    got = _fresh(f"import {package}; {_REPORT}", None)
    assert got == {"env": grpc_defaults.LEGACY_IO, "grpc": True}, got


@pytest.mark.parametrize("value", ["", "event_engine_client"])
def test_a_setting_of_the_user_is_left_alone(value: str) -> None:
    got = _fresh(f"import attention_client; {_REPORT}", value)
    assert got["env"] == value, got


def test_nothing_is_set_once_grpc_is_loaded() -> None:
    """grpc read its settings at import: setting them later would only reach child
    processes, so apply leaves the environment as it is."""
    got = _fresh(f"import grpc; import attention_client; {_REPORT}", None)
    assert got["env"] is None, got
