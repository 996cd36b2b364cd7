"""A side-by-side table of Nsight Compute raw pages (``ncu --import R --page raw --csv``):
per file, the longest kernel's time, instruction count, issue and pipe utilisation, and warp
stall reasons (warps stalled per issued instruction, the largest first).

    python benchmarks/ncu_summary.py ours.csv cudnn.csv [--out summary.txt]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

ROWS = [  # (label, metric)
    ("duration us", "gpu__time_duration.sum"),
    ("SM clock cycles", "sm__cycles_elapsed.avg"),
    ("instructions (warp)", "smsp__inst_executed.sum"),
    ("issue active %", "sm__issue_active.avg.pct_of_peak_sustained_elapsed"),
    ("tensor pipe %", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
    ("XU pipe (exp2) %", "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"),
    ("FMA pipe %", "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("ALU pipe %", "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"),
    ("DRAM read (ncu unit)", "dram__bytes_read.sum"),
    ("DRAM throughput %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L2 hit rate %", "lts__t_sector_hit_rate.pct"),
    ("warps active %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("registers / thread", "launch__registers_per_thread"),
    ("threads / block", "launch__block_size"),
    ("grid", "launch__grid_size"),
]
_STALL = "smsp__average_warps_issue_stalled_"
_STALL_END = "_per_issue_active.ratio"
_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def main_kernel(path: Path) -> dict[str, str]:
    """The row of the longest kernel in one raw page."""
    with path.open() as f:
        rows = [r for r in csv.reader(f) if r]
    header, units, data = rows[0], rows[1], rows[2:]
    records = [dict(zip(header, r, strict=False)) for r in data]
    records = [r for r in records if _number(r.get("gpu__time_duration.sum", "")) is not None]
    if not records:
        raise SystemExit(f"{path}: no kernel rows")
    # Durations come in the unit ncu picked per file (ns, us, ms): all in us here.
    scale = _TO_US.get(dict(zip(header, units, strict=False)).get("gpu__time_duration.sum"), 1.0)
    for r in records:
        r["gpu__time_duration.sum"] = str(_number(r["gpu__time_duration.sum"]) * scale)
    return max(records, key=lambda r: float(r["gpu__time_duration.sum"]))


def table(paths: list[Path]) -> str:
    kernels = [main_kernel(p) for p in paths]
    names = [p.stem.removesuffix(".raw") for p in paths]
    width = 2 + max(14, *(len(n) for n in names))
    lines = [f"{'':28s}" + "".join(f"{n:>{width}s}" for n in names),
             f"{'kernel':28s}" + "".join(f"{k.get('Kernel Name', '')[:width - 2]:>{width}s}"
                                         for k in kernels)]
    for label, metric in ROWS:
        vals = [_number(k.get(metric, "")) for k in kernels]
        lines.append(f"{label:28s}" + "".join(
            f"{'-' if v is None else f'{v:,.1f}':>{width}s}" for v in vals))
    stalls = sorted({m for k in kernels for m in k if m.startswith(_STALL)
                     and m.endswith(_STALL_END)},
                    key=lambda m: -max(_number(k.get(m, "")) or 0.0 for k in kernels))
    lines.append("warps stalled per issue:")
    for m in stalls:
        vals = [_number(k.get(m, "")) for k in kernels]
        if max(v or 0.0 for v in vals) < 0.02:
            continue
        label = "  " + m.removeprefix(_STALL).removesuffix(_STALL_END)
        lines.append(f"{label:28s}" + "".join(
            f"{'-' if v is None else f'{v:.3f}':>{width}s}" for v in vals))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", nargs="+", type=Path)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    text = table(a.csv)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
