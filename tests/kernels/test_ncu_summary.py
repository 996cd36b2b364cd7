"""benchmarks/ncu_summary.py on hand-made Nsight Compute raw pages: it picks each file's
longest kernel whatever unit ncu printed its time in, and lists the stall reasons largest
first, leaving out the negligible ones."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ncu_summary  # noqa: E402

_STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
HEADER = ["ID", "Kernel Name", "gpu__time_duration.sum", "smsp__inst_executed.sum",
          "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
          _STALL.format("barrier"), _STALL.format("wait"), _STALL.format("misc")]


def _page(path: Path, time_unit: str, rows: list[list[str]]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        w.writerow(["", "", time_unit, "inst", "%", "", "", ""])
        w.writerows(rows)
    return path


def test_longest_kernel_in_us_and_stalls_largest_first(tmp_path: Path) -> None:
    ours = _page(tmp_path / "ours.raw.csv", "ms", [
        ["0", "fill_kernel", "0.002", "1,000", "1.0", "0.1", "0.1", "0"],
        ["1", "attention_kernel", "0.775", "266,319,094", "46.1", "2.136", "1.552", "0.001"],
    ])
    peer = _page(tmp_path / "peer.raw.csv", "us", [
        ["0", "cudnn_kernel", "793.3", "285,443,228", "48.1", "0.912", "0.858", "0.004"],
    ])
    text = ncu_summary.table([ours, peer])
    lines = text.splitlines()
    assert lines[0].split() == ["ours", "peer"]
    names = lines[1].split()[1:]  # not the fill kernel; long names are cut to the column
    assert names[0].startswith("attention_k") and names[1] == "cudnn_kernel", names
    duration = next(line for line in lines if line.startswith("duration us")).split()
    assert duration[2:] == ["775.0", "793.3"]  # ms and us both in us
    stalls = lines[lines.index("warps stalled per issue:") + 1:]
    assert [s.split()[0] for s in stalls] == ["barrier", "wait"]  # misc: under 0.02
    assert stalls[0].split()[1:] == ["2.136", "0.912"]
    assert "-" in next(line for line in lines if line.startswith("tensor pipe %"))  # absent
