"""Kernels compiled for sm_90a on any machine (Triton compiles without a GPU and ships ptxas),
for tests of what a launch compiles to: async copies, element loads and stores, spills.

``run(script)`` runs a script in a process of its own without ``TRITON_INTERPRET`` (the
interpreter replaces the compiler); the script calls ``build`` and prints one JSON line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import pytest


def build(fn: Any, const: dict[str, Any], ptrs: dict[str, str], ints: dict[str, int],
          warps: int, stages: int) -> dict[str, int]:
    """``fn`` (a ``triton.jit`` function) with constexprs ``const``, pointers typed by ``ptrs``
    (16-byte aligned), integers divisible by 16 where ``ints`` gives them such a value (as
    Triton specializes a launch's), float ``qk_scale``: counts in its PTX and ptxas's spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in const:
            sig[arg] = "constexpr"
        elif arg in ptrs:
            sig[arg], attrs[(i,)] = ptrs[arg], [["tt.divisibility", 16]]
        else:
            sig[arg] = "fp32" if arg == "qk_scale" else "i32"
            if ints.get(arg, 1) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        info = subprocess.run([_ptxas(), "-v", "--gpu-name=sm_90a", src, "-o", src + ".cubin"],
                              capture_output=True, text=True, check=True).stderr
    return {"async_copies": ptx.count("cp.async.cg"),
            "element_loads": ptx.count("ld.global.b16"),
            "element_stores": ptx.count("st.global.b16"),
            "spill_bytes": sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", info))}


def _ptxas() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def run(script: str, *args: str, timeout: float = 280) -> Any:
    """``script``'s JSON line, run with ``args``; skips the test where Triton has no ptxas."""
    if not os.path.exists(_ptxas()):
        pytest.skip("no ptxas in this triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                          text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
