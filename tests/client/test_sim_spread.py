"""tools/tuning/sim_spread.py: the client's own spread rule, replayed on simulated front ends."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "tuning"))
import sim_spread  # noqa: E402

from attention_client._channel import spread_tries  # noqa: E402


def _full_share(place, n: int, clients: int, tries, trials: int = 300) -> float:
    rng = random.Random(1)
    full = 0
    for _ in range(trials):
        counts, looks = place(n, clients, tries, rng)
        assert sum(counts) == clients  # every client ends somewhere, once
        assert looks >= clients
        full += sum(1 for c in counts if c) == min(n, clients)
    return full / trials


@pytest.mark.parametrize("place", [sim_spread.place_one_by_one, sim_spread.place_at_once])
def test_the_clients_tries_fill_every_front_end_where_four_did_not(place) -> None:
    assert _full_share(place, 8, 8, spread_tries) >= 0.93  # 0.98 in 20000 trials
    assert _full_share(place, 8, 8, lambda info: 4) <= 0.40  # 0.23 in 20000 trials
    # never more than the rule allows: 8 clients over 16 front ends use 8 of them
    assert _full_share(place, 16, 8, spread_tries) >= 0.93


def test_sim_spread_prints_its_table() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "tuning" / "sim_spread.py"), "--cases", "4x4",
         "--trials", "200"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert len(rows) == 4  # two orders x (client rule, fixed 4)
    assert all(0.0 <= float(r[-3]) <= 1.0 and float(r[-1]) >= 1.0 for r in rows)
