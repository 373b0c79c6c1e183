"""One supported vLLM version, named alike wherever a user or CI reads it."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def installed_version() -> str:
    text = (ROOT / "tests" / "vllm" / "install.sh").read_text()
    match = re.search(r"^VERSION=(\S+)$", text, re.M)
    assert match, "tests/vllm/install.sh names no VERSION"
    return match.group(1)


def test_chart_vllm_image_is_the_tested_version():
    values = yaml.safe_load((ROOT / "helm" / "connex" / "values.yaml").read_text())
    assert values["vllm"]["image"]["tag"] == installed_version()


def test_vllm_dockerfile_builds_the_tested_version():
    text = (ROOT / "docker" / "vllm.Dockerfile").read_text()
    match = re.search(r"^ARG VLLM_VERSION=(\S+)$", text, re.M)
    assert match and match.group(1) == installed_version()


def test_readme_names_the_tested_version():
    readme = (ROOT / "README.md").read_text()
    versions = set(re.findall(r"vLLM (\d+\.\d+\.\d+)", readme))
    assert versions == {installed_version()}, versions
