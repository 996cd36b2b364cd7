"""README.md: the CI-relied-on commands, and the configuration table matching the contract."""

from __future__ import annotations

import re

from ._helpers import REPO, contract_config, contract_metrics

README = (REPO / "README.md").read_text()


def test_setup_section_keeps_the_two_commands() -> None:
    section = README.split("## Set-up: the two commands", 1)[1].split("\n## ", 1)[0]
    assert "make serve" in section and "make test" in section


def test_configuration_table_lists_every_flag_and_variable() -> None:
    section = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    for flags, envs in contract_config():
        for name in flags + envs:
            assert f"`{name}`" in section, name


def test_metrics_section_lists_every_metric() -> None:
    section = README.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    for name in contract_metrics():
        assert f"`{name}`" in section, name


def test_docker_files_are_said_to_be_validated_not_built() -> None:
    assert "validated, not built" in README


def test_relative_links_exist() -> None:
    for target in re.findall(r"\]\(([^)#:]+)\)", README):
        assert (REPO / target).exists(), target
