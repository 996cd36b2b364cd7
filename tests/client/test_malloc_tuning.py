"""Large message buffers stay in the heap of a server process (attention_wire.malloc_tuning):
freed and allocated again, their pages are not faulted in again. Clients opt in."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from attention_wire import malloc_tuning

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# 16 messages of 1 MiB in flight, then all freed, 40 times: the page faults of the last 40.
_FAULTS = """
import resource
{imports}
def rounds(n):
    for _ in range(n):
        held = [b"x" * (1 << 20) for _ in range(16)]
        del held
rounds(3)
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds(40)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""
_EVERY_PAGE = 40 * 16 * (1 << 20) // 4096


def _faults(imports: str, **env: str) -> int:
    clean = {k: v for k, v in os.environ.items()
             if k != malloc_tuning.ENV and not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _FAULTS.format(imports=imports)],
                         env=clean | env, capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_untuned_baseline_faults_every_page() -> None:
    """What the tuning removes (if glibc kept these pages itself, the tests below could not
    fail)."""
    assert _faults("") > _EVERY_PAGE // 2


def test_a_server_process_keeps_message_buffers_in_its_heap() -> None:
    assert _faults("import attention_service") < _EVERY_PAGE // 50


def test_the_operator_can_turn_it_off() -> None:
    assert _faults("import attention_service", ATTENTION_MALLOC_TUNING="0") > _EVERY_PAGE // 2


def test_a_client_process_is_left_alone_unless_it_asks() -> None:
    assert _faults("import attention_client") > _EVERY_PAGE // 2
    assert _faults("import attention_client", ATTENTION_MALLOC_TUNING="1") < _EVERY_PAGE // 50


def test_a_malloc_setting_of_the_user_is_left_alone() -> None:
    # The user asks glibc to trim at 1 MiB: that stays, so freed messages still go back.
    faults = _faults("import attention_service", MALLOC_TRIM_THRESHOLD_=str(1 << 20),
                     ATTENTION_MALLOC_TUNING="1")
    assert faults > _EVERY_PAGE // 2


@pytest.mark.parametrize(("value", "default", "want"), [
    (None, True, True), (None, False, False), ("0", True, False), ("1", False, True),
    ("", False, False), (" 0 ", True, False),
])
def test_wanted(monkeypatch: pytest.MonkeyPatch, value: str | None, default: bool,
                want: bool) -> None:
    for name in (malloc_tuning.ENV, "GLIBC_TUNABLES", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    if value is not None:
        monkeypatch.setenv(malloc_tuning.ENV, value)
    assert malloc_tuning.wanted(default) is want
