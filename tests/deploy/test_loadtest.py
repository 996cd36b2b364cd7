"""A short headless Locust run of loadtest/locustfile.py against the real server (cpu backend).

Locust monkey-patches the standard library with gevent on import, so it only ever runs in a
subprocess here, never inside the pytest process.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ._helpers import CI, REPO, free_ports
from .conftest import Server

if importlib.util.find_spec("locust") is None:
    message = "locust not installed: pip install -r requirements-dev.txt"
    if CI:
        raise ImportError(message)  # CI must run the load test, not skip it
    pytest.skip(message, allow_module_level=True)

# Small shapes: the cpu backend is the torch reference on 2 cores.
SMALL = {
    "LOADTEST_HEADS": "4",
    "LOADTEST_KV_HEADS": "2",
    "LOADTEST_HEAD_DIM": "64",
    "LOADTEST_PREFILL_LEN": "8:96",
    "LOADTEST_PREFILL_BATCH": "3",
    "LOADTEST_DECODE_CONTEXT": "16:256",
    "LOADTEST_DECODE_BATCH": "4",
    "LOADTEST_SESSION_STEPS": "4",
    "LOADTEST_TIMEOUT": "30",
}


def _locust(
    host: str, run_time: str, csv_prefix: Path, *extra: str, **env: str
) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LOADTEST_", "LOCUST_"))}
    if "--processes" in extra:  # its master and workers on a port of their own, not 5557:
        port = str(free_ports())  # two such runs side by side collided (a CI replica)
        extra = (*extra, "--master-bind-port", port, "--master-port", port)
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(REPO / "loadtest" / "locustfile.py"),
        "--headless",
        "-u",
        "4",
        "-r",
        "4",
        "-t",
        run_time,
        "--host",
        host,
        "--csv",
        str(csv_prefix),
        "--only-summary",
        "--stop-timeout",
        "10",
        *extra,
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, cwd=REPO, env={**clean, **SMALL, **env}
    )


def _rows(csv_prefix: Path) -> dict[str, dict[str, str]]:
    with open(f"{csv_prefix}_stats.csv", newline="") as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def test_locust_run_has_no_failures(server: Server, tmp_path: Path) -> None:
    prefix = tmp_path / "run"
    # 8 s as the FP8 and multiprocess runs: 4 users without waits make hundreds of calls, a
    # session (AppendKV, CacheDecode steps, ReleaseCaches) one in six of their tasks.
    res = _locust(server.target, "8s", prefix)
    log = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 0, log
    rows = _rows(prefix)
    total = rows["Aggregated"]
    assert int(total["Request Count"]) > 0 and int(total["Failure Count"]) == 0, log
    # Every task ran (a decode session: append, steps, release), and every call succeeded.
    for name in ("Prefill", "Decode", "AppendKV", "CacheDecode", "ReleaseCaches"):
        assert name in rows, (name, log)
        assert int(rows[name]["Request Count"]) > 0 and int(rows[name]["Failure Count"]) == 0
    assert float(rows["Prefill"]["Average Content Size"]) > 0  # response bytes were counted


def test_locust_fp8_run_has_no_failures(server: Server, tmp_path: Path) -> None:
    """LOADTEST_KV_DTYPE=float8_e4m3fn: e4m3 k/v with scales in Prefill/Decode, FP8 caches fed
    bf16 prompts and e4m3 steps; every call succeeds."""
    prefix = tmp_path / "fp8"
    res = _locust(server.target, "8s", prefix, LOADTEST_DTYPE="bfloat16",
                  LOADTEST_KV_DTYPE="float8_e4m3fn")
    log = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 0, log
    assert "kv_dtype=float8_e4m3fn" in res.stdout + res.stderr  # the run said what it sent
    rows = _rows(prefix)
    for name in ("Prefill", "Decode", "AppendKV", "CacheDecode"):
        assert name in rows, (name, log)
        assert int(rows[name]["Request Count"]) > 0 and int(rows[name]["Failure Count"]) == 0


def test_locust_fails_the_process_on_failed_requests(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on: every call fails UNAVAILABLE
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    prefix = tmp_path / "dead"
    # 6 s, as in the multiprocess test below: under a full CI run on 2 cores no call to the dead
    # port had ended within 3 s once (the exit code failed, but no failure was counted).
    res = _locust(dead, "6s", prefix, LOADTEST_WAIT="0.2:0.2", LOADTEST_TIMEOUT="2")
    assert res.returncode != 0, res.stderr[-3000:]
    assert int(_rows(prefix)["Aggregated"]["Failure Count"]) > 0


def test_locust_multiprocess_run_has_no_failures(server: Server, tmp_path: Path) -> None:
    """``--processes 2`` (a master plus forked workers; gRPC on gevent survives the fork): the
    master gates on the workers' pooled totals, and the workers themselves exit 0."""
    prefix = tmp_path / "multi"
    res = _locust(server.target, "8s", prefix, "--processes", "2")
    log = res.stdout[-3000:] + res.stderr[-3000:]
    assert res.returncode == 0, log
    assert "no request completed" not in log  # what a worker logged before it stood aside
    total = _rows(prefix)["Aggregated"]
    assert int(total["Request Count"]) > 0 and int(total["Failure Count"]) == 0, log


def test_locust_multiprocess_fails_on_failed_requests(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    prefix = tmp_path / "multi_dead"
    # 6 s: a call to a dead port fails after grpc's retries (within the 2 s deadline); in 3 s
    # on a loaded 2-core box no call of either process had ended (the gate then says "no
    # request completed": a pass for the exit code, but no failures to count).
    res = _locust(dead, "6s", prefix, "--processes", "2", LOADTEST_WAIT="0.2:0.2",
                  LOADTEST_TIMEOUT="2")
    assert res.returncode != 0, res.stderr[-3000:]
    assert "requests failed" in res.stdout + res.stderr  # the gate said why, not a crash
    assert int(_rows(prefix)["Aggregated"]["Failure Count"]) > 0


TOKEN_TLS_CASES = [
    ({"LOADTEST_TOKEN": "tokA,tokB", "LOADTEST_TLS": "true"}, "'tokA' True"),
    ({"LOADTEST_TOKEN": "", "LOADTEST_TLS": "0"}, "None None"),
    ({"LOADTEST_TLS": "off"}, "None None"),
    ({"LOADTEST_TLS": "1"}, "None True"),
    ({"LOADTEST_TLS": "/certs/ca.pem"}, "None '/certs/ca.pem'"),
]

# Each case's environment, then the locustfile run afresh (runpy: new globals, the module-level
# parsing of LOADTEST_TOKEN / LOADTEST_TLS again) in one process for all cases: locust, gevent
# and grpc load once (about 1.7 s of CPU each), not once per case.
_TOKEN_TLS_CODE = """
import json, os, runpy, sys
for env in json.loads(sys.argv[1]):
    for k in [k for k in os.environ if k.startswith("LOADTEST_")]:
        del os.environ[k]
    os.environ.update(env)
    g = runpy.run_path("loadtest/locustfile.py")
    print("CASE", repr(g["TOKEN"]), repr(g["TLS"]), flush=True)
"""


@pytest.fixture(scope="module")
def token_tls_read() -> list[str]:
    """What the locustfile read (``repr(TOKEN) repr(TLS)``) for each of TOKEN_TLS_CASES."""
    import json

    clean = {k: v for k, v in os.environ.items() if not k.startswith("LOADTEST_")}
    res = subprocess.run(
        [sys.executable, "-c", _TOKEN_TLS_CODE, json.dumps([env for env, _ in TOKEN_TLS_CASES])],
        capture_output=True, text=True, cwd=REPO, env=clean, timeout=120)
    assert res.returncode == 0, res.stderr
    read = [line[len("CASE "):] for line in res.stdout.splitlines() if line.startswith("CASE ")]
    assert len(read) == len(TOKEN_TLS_CASES), res.stdout
    return read


@pytest.mark.parametrize(("case", "env", "want"),
                         [(i, env, want) for i, (env, want) in enumerate(TOKEN_TLS_CASES)],
                         ids=[f"env{i}-{want}" for i, (_, want) in enumerate(TOKEN_TLS_CASES)])
def test_locustfile_reads_token_lists_and_tls_words(token_tls_read: list[str], case: int,
                                                    env: dict[str, str], want: str) -> None:
    """The server takes a comma-separated token list (compose passes it as LOADTEST_TOKEN):
    a user sends the first; LOADTEST_TLS takes true/false words, not only 1/0 and a path."""
    assert token_tls_read[case] == want, (env, token_tls_read[case])
