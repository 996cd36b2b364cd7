"""benchmarks/bench_roundtrip.py end to end on the cpu backend, with tiny settings."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]
NIXL = importlib.util.find_spec("nixl_cu13") is not None  # the NIXL rows run where it is


def test_bench_roundtrip_measures_every_path(tmp_path: Path) -> None:
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "bench_roundtrip.py"), "--device", "cpu",
        "--tokens", "128", "--heads", "4", "--head-dim", "32", "--frontends", "2",
        "--clients", "2", "--agg-tokens", "64", "--agg-seconds", "0.2", "--iters", "2",
        "--min-seconds", "0.05", "--ceiling-mib", "8",
        "--agg-channels", "1", "--stripes", "1,2", "--agg-spread", "1",
        "--out", str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "roundtrip_cpu.json").read_text())
    assert [s["frontends"] for s in report["servers"]] == [1, 2]
    assert report["ceilings"]["host_memcpy_GBps"] > 0 and report["ceilings"]["raw_grpc_GBps"] > 0
    for server in report["servers"]:
        # Servers not pinned (--server-cpus left out) keep every CPU the script had.
        assert server["cpus"] == sorted(os.sched_getaffinity(0))
        rt = server["round_trip_ms"]
        assert {"grpc host", "grpc host x2", "shm in region", "shm staged", "shm out=",
                "shm out= unary"} <= set(rt)
        nixl = ("nixl in region", "nixl staged", "nixl out=") if NIXL else ()
        assert set(nixl) <= set(rt)
        assert all(v > 0 for v in rt.values())
        # At least --iters calls per path; the fast ones more, up to --min-seconds of them.
        timed = server["calls_timed"]
        assert set(timed) == set(rt) and min(timed.values()) >= 2
        assert max(timed.values()) > 2  # a cpu call of 128 tokens takes well under 25 ms
        # The region paths moved no tensor byte through gRPC; the gRPC path did.
        assert server["stats"]["grpc host"]["bytes_in"] > 0
        for path in ("shm in region", "shm staged", "shm out=", "shm out= unary", *nixl):
            assert server["stats"][path]["bytes_in"] == 0
            assert server["stats"][path]["region_bytes_in"] > 0
        # Each stripe count, spread (unspread: the pinned run's); a striped client has a
        # connection per stripe.
        assert [(a["clients"], a["channels"], a["stripes"], a["spread"])
                for a in server["aggregate"]] == [(2, 1, 1, True), (2, 2, 2, True)]
        for agg in server["aggregate"]:
            assert agg["calls"] > 0 and agg["GBps"] > 0
            assert 0 < agg["client_cores_mean"] <= agg["client_cores_max"]
            assert sum(agg["calls_per_client"]) == agg["calls"]
            # Each client's connections, each on a front end the server named.
            assert [len(fes) for fes in agg["frontends_per_client"]] == [agg["channels"]] * 2
            assert {fe for fes in agg["frontends_per_client"] for fe in fes} <= set(
                range(server["frontends"]))


def _run_bench(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """benchmarks/``script`` with ``args`` on the cpu backend; it must exit 0."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--device", "cpu", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _tree_of_this_checkout(tmp_path: Path) -> Path:
    """A source tree laid out as ``git archive`` gives one: this checkout's own packages."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for part in ("kernels", "service", "client"):
        (tree / part).symlink_to(ROOT / part)
    return tree


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable CPUs")
def test_bench_roundtrip_measures_a_baseline_tree_on_pinned_cpus(tmp_path: Path) -> None:
    """A baseline tree's server is measured before and after this tree's, and compared like
    for like; pinned servers (their front ends too), clients and the baseline's servers each
    see only their CPUs (servers left unpinned: test_bench_roundtrip_measures_every_path).
    One run checks both (two runs of the script before). One aggregate client: the pinning
    and the like-for-like comparison need no more (two clients: the every-path run)."""
    servers_pinned = True
    server_cpu, client_cpu = sorted(os.sched_getaffinity(0))[:2]
    tree = _tree_of_this_checkout(tmp_path)
    out = tmp_path / "out"
    proc = _run_bench(
        "bench_roundtrip.py", "--tokens", "64", "--heads", "2", "--head-dim", "16",
        "--frontends", "2", "--clients", "1", "--agg-tokens", "32", "--agg-seconds", "0.2",
        "--iters", "1", "--min-seconds", "0", "--ceiling-mib", "8", "--baseline-tree", str(tree),
        "--client-cpus", str(client_cpu),
        *(["--server-cpus", str(server_cpu)] if servers_pinned else []), "--out", str(out),
    )
    report = json.loads((out / "roundtrip_cpu.json").read_text())
    # Every server process (the group's front ends too) and every client saw only its CPUs;
    # servers not pinned keep every CPU the script had, not the clients' set.
    expected = [server_cpu] if servers_pinned else sorted(os.sched_getaffinity(0))
    for entry in [*report["servers"], *report["baseline"]]:
        assert entry["cpus"] == expected
        for agg in entry["aggregate"]:
            assert agg["client_cpus"] == [client_cpu] and agg["GBps"] > 0
            assert not agg["spread"]  # the unspread aggregate (the every-path run spreads)
    assert [s["frontends"] for s in report["servers"]] == [1, 2]
    # The baseline: first and last, its own tree, compared per server like for like.
    assert [b["turn"] for b in report["baseline"]] == ["first", "last"]
    for entry in report["baseline"]:
        assert entry["tree"] == str(tree)
        [agg] = entry["aggregate"]
        assert agg["clients"] == 1 and agg["calls"] > 0 and agg["GBps"] > 0
    assert "x the baseline" in proc.stdout
    assert "runs against the baseline's 2: median" in proc.stdout
    base = [b["aggregate"][0]["GBps"] for b in report["baseline"]]
    rows = report["against_baseline"]
    assert [row["frontends"] for row in rows] == [1, 2]
    for row, server in zip(rows, report["servers"], strict=True):
        runs = [a["GBps"] for a in server["aggregate"]]
        assert row["runs"] == 1 and row["baseline_runs"] == 2
        assert row["best_ratio"] == pytest.approx(max(runs) / max(base))
        assert row["median_ratio"] == pytest.approx(runs[0] / ((base[0] + base[1]) / 2))
