"""CPU placement of the process group (``--engine-cpus`` / ``--frontend-cpus``): the settings'
parsing and resolution, their errors named by flag, and a real group whose every thread runs
where it was placed, a restarted front end included."""

from __future__ import annotations

import os
import signal

import pytest

from attention_service.config import load_config
from attention_service.cpus import (
    AUTO_ENGINE_CPUS,
    AUTO_MIN_CPUS,
    Placement,
    format_cpu_list,
    parse_cpu_list,
    placement,
)

from ..group_helpers import Group
from ..svc_helpers import wait_until

SIXTEEN = frozenset(range(16))


@pytest.mark.parametrize(("text", "cpus"), [
    ("0", {0}), ("0-2", {0, 1, 2}), ("0-2,5", {0, 1, 2, 5}), (" 3 , 1-2 ", {1, 2, 3}),
    ("4-4", {4}),
])
def test_cpu_lists_parse(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "1-", "1,,2", "0-2;5", "1.5"])
def test_bad_cpu_lists_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpu_list(text)


@pytest.mark.parametrize("cpus", [{0}, {0, 1, 2, 5}, {1, 3, 5}, set(range(8, 16)), {7, 9}])
def test_cpu_lists_format_and_parse_back(cpus: set[int]) -> None:
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


def test_auto_gives_the_engine_the_lowest_cpus_and_the_front_ends_the_rest() -> None:
    allowed = frozenset(range(4, 20))  # a cpuset that does not start at 0
    p = placement("auto", "", allowed, 16, 64)
    assert p.engine == frozenset(range(4, 4 + AUTO_ENGINE_CPUS))
    assert p.frontends == allowed - p.engine
    assert p.describe() == "engine on CPUs 4-6, front ends on CPUs 7-19"


@pytest.mark.parametrize(("allowed", "usable", "host"), [
    (frozenset(range(AUTO_MIN_CPUS - 1)), AUTO_MIN_CPUS - 1, 64),
    (SIXTEEN, AUTO_MIN_CPUS - 1, 64),  # a CPU quota below the affinity
    (frozenset({0, 1}), 2, 64),
    # The whole host: another server there would pick the same CPUs.
    (SIXTEEN, 16, 16),
    (frozenset(range(64)), 64, 64),
])
def test_auto_places_only_inside_a_set_of_its_own(allowed: frozenset[int], usable: int,
                                                  host: int) -> None:
    assert placement("auto", "", allowed, usable, host) == Placement(None, None)
    assert placement("auto", "", allowed, usable, host).describe() == "not placed"


def test_one_process_is_placed_only_by_an_explicit_list() -> None:
    assert placement("auto", "", SIXTEEN, 16, 64, group=False) == Placement(None, None)
    assert placement("0-1", "5", SIXTEEN, 16, 64, group=False) == Placement(frozenset({0, 1}), None)


def test_explicit_lists() -> None:
    assert placement("none", "", SIXTEEN, 16, 16) == Placement(None, None)
    assert placement("none", "2-3", SIXTEEN, 16, 16) == Placement(None, frozenset({2, 3}))
    assert placement("1", "2-3", SIXTEEN, 16, 16) == Placement(frozenset({1}), frozenset({2, 3}))
    # The engine given everything: the front ends share it rather than keep nothing.
    assert placement("0-15", "", SIXTEEN, 16, 16) == Placement(SIXTEEN, SIXTEEN)


@pytest.mark.parametrize(("engine", "frontends", "flag"), [
    ("0-16", "", "--engine-cpus: CPU 16 is not"), ("0", "14-17", "--frontend-cpus: CPU 16-17"),
])
def test_cpus_outside_the_allowed_set_are_refused_by_flag(engine: str, frontends: str,
                                                          flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        placement(engine, frontends, SIXTEEN, 16, 16)


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--engine-cpus", "x"], {}, r"--engine-cpus \(ATTENTION_ENGINE_CPUS\) must be 'auto'"),
    ([], {"ATTENTION_FRONTEND_CPUS": "2-1"}, r"--frontend-cpus \(ATTENTION_FRONTEND_CPUS\)"),
])
def test_bad_settings_name_their_flag(argv: list[str], env: dict[str, str],
                                      message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(argv, env)


def test_settings_load() -> None:
    assert load_config([], {}).engine_cpus == "auto"
    c = load_config(["--engine-cpus", "NONE"], {"ATTENTION_FRONTEND_CPUS": "1-3"})
    assert (c.engine_cpus, c.frontend_cpus) == ("none", "1-3")


def _threads_cpus(pid: int) -> set[str]:
    """The CPU lists of every thread of ``pid``."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                found |= {line.split(":", 1)[1].strip() for line in f
                          if line.startswith("Cpus_allowed_list")}
        except OSError:  # a thread that ended meanwhile
            pass
    return found


@pytest.mark.timeout(180)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to split")
def test_a_placed_group_runs_every_thread_where_it_was_placed() -> None:
    engine_cpu, frontend_cpu = sorted(os.sched_getaffinity(0))[:2]
    g = Group(2, "--engine-cpus", str(engine_cpu), "--frontend-cpus", str(frontend_cpu))
    try:
        g.wait_for(rf"engine on CPUs {engine_cpu}, front ends on CPUs {frontend_cpu}\)")
        # The engine places itself once warm (serving): every thread, those started since too.
        assert wait_until(lambda: _threads_cpus(g.proc.pid) == {str(engine_cpu)}), \
            _threads_cpus(g.proc.pid)
        for pid in g.frontend_pids().values():
            assert _threads_cpus(pid) == {str(frontend_cpu)}
        # A front end restarted by the (placed) engine goes back to the front ends' CPUs.
        os.kill(g.frontend_pids()[0], signal.SIGKILL)
        g.wait_for(r"front end 0 listening \(pid \d+\), restarted", timeout=60)
        g.wait_until_serving()
        assert _threads_cpus(g.frontend_pids()[0]) == {str(frontend_cpu)}
        assert _threads_cpus(g.proc.pid) == {str(engine_cpu)}
    finally:
        assert g.stop() == 0


def test_a_list_outside_the_allowed_cpus_stops_the_server_with_one_line() -> None:
    import subprocess
    import sys

    outside = max(os.sched_getaffinity(0)) + 1
    r = subprocess.run([sys.executable, "-m", "attention_service", "--device", "cpu",
                        "--frontends", "2", "--engine-cpus", str(outside)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"attention-server: --engine-cpus: CPU {outside} is not among "
                                f"the CPUs this process may use "
                                f"({format_cpu_list(os.sched_getaffinity(0))})")
