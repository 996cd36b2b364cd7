"""``pip install ./client`` into a fresh virtualenv (no system site-packages, no torch) works.

The venv's script sends numpy float16 arrays to the real server; the result is checked here
against the float64 reference. Needs network access to PyPI (pip), about a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
attention_kernels = pytest.importorskip("attention_kernels")

CLIENT_DIR = Path(__file__).resolve().parents[2] / "client"
# What `pip install ./client` may bring (plus the venv's own pip).
ALLOWED = {
    "attention-client", "grpcio", "grpcio-health-checking", "protobuf", "numpy",
    "typing-extensions", "pip", "setuptools",
}

SCRIPT = """
import importlib.metadata, importlib.util, json, sys
import numpy as np
from attention_client import AttentionClient, AttentionError

target, inputs, outputs = sys.argv[1:4]
d = np.load(inputs)
with AttentionClient(target) as c:
    out, lse = c.attention(d["q"], d["k"], d["v"], d["cu_q"], d["cu_k"], causal=True,
                           return_lse=True)
    dec = c.decode(d["q"][:2], d["k"], d["v"], d["cu_k"])
    health = c.health()
    try:
        c.attention(np.zeros((4, 2, 300), np.float16), np.zeros((4, 2, 300), np.float16),
                    np.zeros((4, 2, 300), np.float16))  # head_dim over 256
        code = "OK"
    except AttentionError as err:
        code = err.code.name
np.savez(outputs, out=out, lse=lse, dec=dec)
print(json.dumps({
    "dists": sorted(x.metadata["Name"] for x in importlib.metadata.distributions()),
    "torch_found": importlib.util.find_spec("torch") is not None,
    "torch_loaded": "torch" in sys.modules,
    "health": health,
    "bad_head_dim": code,
}))
"""


def _env() -> dict[str, str]:
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PIP_REQUIRE_VIRTUALENV")
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.mark.timeout(900)
def test_client_alone_in_fresh_venv(server, tmp_path):
    src = tmp_path / "client"  # a copy: building must not write into the checkout
    shutil.copytree(
        CLIENT_DIR, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=_env())
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    done = subprocess.run([*pip, str(src)], capture_output=True, text=True, env=_env(),
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert subprocess.run([py, "-c", "import torch"], capture_output=True, cwd=tmp_path,
                          env=_env()).returncode != 0, "torch must not be importable in the venv"

    rng = np.random.default_rng(0)
    cu_q, cu_k = np.array([0, 3, 8], np.int32), np.array([0, 6, 15], np.int32)
    q = rng.standard_normal((8, 4, 64)).astype(np.float16)
    k = rng.standard_normal((15, 2, 64)).astype(np.float16)
    v = rng.standard_normal((15, 2, 64)).astype(np.float16)
    np.savez(tmp_path / "in.npz", q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k)
    (tmp_path / "run.py").write_text(SCRIPT)
    ran = subprocess.run(
        [py, str(tmp_path / "run.py"), server.target, str(tmp_path / "in.npz"),
         str(tmp_path / "out.npz")],
        capture_output=True, text=True, env=_env(), timeout=120, cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    report = json.loads(ran.stdout.strip().splitlines()[-1])
    dists = {name.lower().replace("_", "-") for name in report["dists"]}
    assert dists <= ALLOWED, f"unexpected packages: {dists - ALLOWED}"
    assert not report["torch_found"] and not report["torch_loaded"]
    assert report["health"] == "SERVING" and report["bad_head_dim"] == "INVALID_ARGUMENT"

    got = np.load(tmp_path / "out.npz")
    t = lambda a: torch.from_numpy(a.astype(np.float64))  # noqa: E731
    ref, ref_lse = attention_kernels.prefill_ref(
        t(q), t(k), t(v), torch.from_numpy(cu_q), torch.from_numpy(cu_k), causal=True,
        return_lse=True,
    )
    assert got["out"].dtype == np.float16 and got["out"].shape == q.shape
    err = np.linalg.norm(got["out"].astype(np.float64) - ref.numpy()) / np.linalg.norm(ref)
    assert err < 2e-3
    np.testing.assert_allclose(got["lse"], ref_lse.numpy(), rtol=1e-4, atol=1e-3)
    dec_ref = attention_kernels.decode_ref(t(q[:2]), t(k), t(v), torch.from_numpy(cu_k))
    err = np.linalg.norm(got["dec"].astype(np.float64) - dec_ref.numpy()) / np.linalg.norm(dec_ref)
    assert err < 2e-3
