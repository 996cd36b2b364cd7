"""Which of our files and data shapes one call crosses: issue 62's measure of the request path.

Starts ``attention-server --frontends 2`` (a process group: front end, IPC, engine), warms it up
with a few calls, then records every Python function call in every process of the group and in
this client while exactly one ``client.attention(q, k, v)`` runs (a Prefill of two sequences
of lengths not seen before), and prints:

* the files of ours (client, wire, service, kernels) whose functions ran, by package;
* the data shapes: the classes of ours constructed (``__init__``, ``__new__``, a NamedTuple's
  ``_make``), by package (builtins are not counted: dicts, tuples, bytes);
  each split into the way in (first seen up to the first call into the kernels) and the way
  back;
* how often the service reads the op kind (``op is`` / ``op ==`` / ``.decode_like`` ...),
  counted over the source, and how many of those name a kind (``op is Op.X``).

    python tools/request_path.py [--device cpu|cuda] [--json OUT] [--functions]

Recording uses a ``sitecustomize`` put on every process's PYTHONPATH: a profiler
(``sys.setprofile`` and ``threading.setprofile``) that turns on and off when a flag file
appears and goes. Background work that falls inside the call's window (the engine's poller,
the front end's loop) counts too: it is work the call waits on.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("attention_client", "attention_wire", "attention_service", "attention_kernels")

# Put on every process's PYTHONPATH as sitecustomize.py. Records (file, defining class of each
# constructor; each function too with REQUEST_PATH_FUNCTIONS set) while <dir>/on exists; writes
# <dir>/<pid>.json when it goes.
_SITE = r'''
import json, os, sys, threading, time
_DIR = os.environ.get("REQUEST_PATH_DIR")
_WITH_FUNCS = bool(os.environ.get("REQUEST_PATH_FUNCTIONS"))  # --functions
if _DIR:
    _ON = [False]
    _FILES, _SHAPES, _FUNCS = {}, {}, {}
    _MARK = ("attention_client", "attention_wire", "attention_service", "attention_kernels")

    def _owner(frame):
        code = frame.f_code
        name = code.co_name
        local = frame.f_locals
        if name == "__init__" and "self" in local:
            return type(local["self"])
        if name in ("__new__", "_make") or (name == "<lambda>" and "_cls" in local):
            cls = local.get("cls", local.get("_cls"))
            return cls if isinstance(cls, type) else None
        return None

    # Each file's and shape's first time in the window (wall clock: the processes share it),
    # and the attention's: the first call into the kernels (cpu: the engine's ``attend``).
    def _prof(frame, event, arg):
        if event != "call" or not _ON[0]:
            return
        fname = frame.f_code.co_filename
        if any(m in fname for m in _MARK) and "site-packages/grpc" not in fname:
            if fname not in _FILES:
                _FILES[fname] = time.time()
            if _WITH_FUNCS:
                fn = fname + "::" + frame.f_code.co_qualname
                if fn not in _FUNCS:
                    _FUNCS[fn] = time.time()
            if "KERNEL" not in _SHAPES and ("attention_kernels/" in fname or (
                    fname.endswith("cpu_attention.py") and frame.f_code.co_name == "attend")):
                _SHAPES["KERNEL"] = time.time()
        cls = _owner(frame)
        if cls is not None and cls.__module__.split(".")[0] in _MARK:
            key = cls.__module__ + "." + cls.__qualname__
            if key not in _SHAPES:
                _SHAPES[key] = time.time()

    def _watch():
        flag = os.path.join(_DIR, "on")
        while True:
            on = os.path.exists(flag)
            if on and not _ON[0]:
                _FILES.clear(); _SHAPES.clear(); _FUNCS.clear()
                _ON[0] = True
            elif not on and _ON[0]:
                _ON[0] = False
                with open(os.path.join(_DIR, f"{os.getpid()}.json"), "w") as f:
                    json.dump({"argv": sys.argv, "files": _FILES, "shapes": _SHAPES,
                               "functions": _FUNCS}, f)
            time.sleep(0.0005)

    sys.setprofile(_prof)
    threading.setprofile(_prof)
    threading.Thread(target=_watch, daemon=True, name="request-path-watch").start()
'''

# The service's branches on the op kind, as source text (issue 62 counted 58 in 13 files).
_OP_BRANCH = re.compile(
    r"(?<!for )\bop (is|==|is not|!=|in|not in) |\.decode_like\b|\.cached\b|\bop\.rpc ==")


def op_branches() -> dict[str, int]:
    counts = {}
    for path in sorted((ROOT / "service" / "attention_service").rglob("*.py")):
        n = sum(1 for line in path.read_text().splitlines()
                if _OP_BRANCH.search(line) and not line.lstrip().startswith("#"))
        if n:
            counts[str(path.relative_to(ROOT))] = n
    return counts


def _identity_tests() -> int:
    """``op is Op.X`` / ``op == Op.X`` tests: a kind named where a rule should be read."""
    rx = re.compile(r"\bop (is|==|is not|!=) Op\.")
    return sum(1 for path in (ROOT / "service" / "attention_service").rglob("*.py")
               for line in path.read_text().splitlines() if rx.search(line))


def _package(path: str) -> str:
    for pkg in PACKAGES:
        if f"/{pkg}/" in path:
            return pkg
    return "?"


def _short(path: str) -> str:
    pkg = _package(path)
    return pkg + path.split(f"/{pkg}", 1)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--json", type=Path, help="write the counts here too")
    ap.add_argument("--functions", action="store_true",
                    help="also list, per file on the way in, the functions of it that ran")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="request-path-"))
    (work / "sitecustomize.py").write_text(_SITE)
    env = {**os.environ, "REQUEST_PATH_DIR": str(work),
           "PYTHONPATH": os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")])}
    env.pop("REQUEST_PATH_FUNCTIONS", None)
    os.environ.pop("REQUEST_PATH_FUNCTIONS", None)
    if args.functions:  # every process records the functions that ran, not only the files
        env["REQUEST_PATH_FUNCTIONS"] = "1"
    os.environ.update(env)
    # This process (the client) runs the same module under its own name: a sitecustomize
    # imported at start-up (an image may have one) would shadow an ``import sitecustomize``.
    spec = importlib.util.spec_from_file_location("request_path_site", work / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))

    sys.path.insert(0, str(ROOT / "tests" / "service"))
    import numpy as np
    from group_helpers import Group

    from attention_client import AttentionClient

    group = Group(2, device=args.device, env=env, timeout=300)  # cuda: kernels compile first
    try:
        rng = np.random.default_rng(0)
        q = rng.standard_normal((48, 4, 64)).astype(np.float16)
        cu = np.array([0, 17, 48], dtype=np.int32)
        with AttentionClient(group.target, spread=False) as client:
            for _ in range(5):  # warm: connections, memos, the engine's first launches
                client.attention(q, q, q, cu_seqlens=cu)
            (work / "on").touch()
            time.sleep(0.05)
            # New lengths: the header is checked and its Params cross to the engine anew, as
            # for any call of a new shape (a repeated one takes memos past some of this).
            client.attention(q, q, q, cu_seqlens=np.array([0, 20, 48], dtype=np.int32))
            (work / "on").unlink()
            deadline = time.monotonic() + 10
            pids = {group.proc.pid, *group.frontend_pids().values(), os.getpid()}
            while time.monotonic() < deadline and not all(
                    (work / f"{p}.json").exists() for p in pids):
                time.sleep(0.05)
    finally:
        group.stop()
    files: dict[str, float] = {}  # first seen, over every process
    shapes: dict[str, float] = {}
    funcs: dict[str, float] = {}
    for dump in work.glob("*.json"):
        rec = json.loads(dump.read_text())
        for f, t in rec["files"].items():
            files[_short(f)] = min(t, files.get(_short(f), t))
        for name, t in rec["shapes"].items():
            shapes[name] = min(t, shapes.get(name, t))
        for fn, t in (rec["functions"] if args.functions else {}).items():
            key = _short(fn.split("::")[0]) + "::" + fn.split("::")[1]
            funcs[key] = min(t, funcs.get(key, t))
    kernel = shapes.pop("KERNEL", float("inf"))
    counts: dict[str, object] = {"device": args.device}
    for what, seen, sep in (("files", files, "/"), ("data shapes", shapes, ".")):
        way_in = sorted(n for n, t in seen.items() if t <= kernel)
        back = sorted(n for n, t in seen.items() if t > kernel)
        counts[what] = {"in": way_in, "back": back}
        print(f"{what} of ours in one call: {len(way_in)} on the way in (up to the kernel), "
              f"{len(back)} more on the way back")
        for label, names in (("in", way_in), ("back", back)):
            for pkg in PACKAGES:
                mine = [n.split(sep, 1)[1] for n in names if n.startswith(pkg + sep)]
                if mine:
                    print(f"  {label:4} {pkg} ({len(mine)}): " + ", ".join(mine))
    if args.functions:
        print("functions that ran on the way in, by file:")
        for f in counts["files"]["in"]:  # type: ignore[index]
            mine = sorted(fn.split("::")[1] for fn, t in funcs.items()
                          if fn.startswith(f + "::") and t <= kernel)
            print(f"  {f} ({len(mine)}): " + ", ".join(mine))
    branches = op_branches()
    counts["op_branches"] = branches
    print(f"branches on the op kind in the service: {sum(branches.values())} in "
          f"{len(branches)} files (identity tests: {_identity_tests()})")
    if args.json:
        args.json.write_text(json.dumps(counts, indent=1) + "\n")


if __name__ == "__main__":
    main()
