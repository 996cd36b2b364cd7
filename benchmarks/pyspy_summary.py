"""Summarise a py-spy ``--format raw`` profile (collapsed stacks): the functions with the most
samples of their own (leaf) and inclusive of callees, as percentages of all samples.

    python benchmarks/pyspy_summary.py pyspy_engine.txt [--top 40]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path


def _name(frame: str) -> str:
    # "function (path/to/file.py:123)" -> "function (file.py)": lines vary within a function.
    func, _, where = frame.partition(" (")
    return f"{func} ({Path(where.split(':')[0]).name})" if where else func


def summarise(raw: str, top: int = 40) -> str:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_name(f) for f in stack.split(";")]
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    if not total:
        return "no samples\n"
    out = [f"{total} samples", "", "own %  function"]
    out += [f"{100 * n / total:5.1f}  {f}" for f, n in own.most_common(top)]
    out += ["", "incl % function"]
    out += [f"{100 * n / total:5.1f}  {f}" for f, n in inclusive.most_common(top)]
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", type=Path)
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args()
    sys.stdout.write(summarise(a.raw.read_text(), a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
