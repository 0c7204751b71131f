"""Optional tools some tests need, and the skip, naming the command that installs the tool, when one
is absent. A fresh checkout with only `pip install -e .` passes or skips; it never errors for want
of a package (`pip install -e '.[test]'` installs them all).
"""
import os
import shutil
import sys

import pytest

TEST_EXTRAS = "pip install -e '.[test]'"

# Megatron-Core, the reference implementation, lives apart from our own `megatron` package (both are
# top-level `megatron`): it is only ever run in a subprocess with PYTHONPATH set to this directory.
MEGATRON_CORE_REF = os.environ.get("MEGATRON_CORE_REF", os.path.expanduser("~/.cache/megatron-core-ref"))
MEGATRON_CORE_INSTALL = (f"`pip install --no-deps --target {MEGATRON_CORE_REF} megatron-core==0.16.1` "
                         "(or set MEGATRON_CORE_REF)")


def require_module(name: str, install: str = TEST_EXTRAS):
    """The imported module, or a skip of the calling test (or module) naming the install command."""
    return pytest.importorskip(name, reason=f"needs {name}: {install}")


# Megatron-LM's training code (megatron/training) is not in Megatron-Core's wheel: tests that compare
# with it read its source from a checkout of NVIDIA/Megatron-LM, in a subprocess.
MEGATRON_LM_REF = os.environ.get("MEGATRON_LM_REF", os.path.expanduser("~/.cache/megatron-lm-ref"))
MEGATRON_LM_INSTALL = f"`git clone https://github.com/NVIDIA/Megatron-LM {MEGATRON_LM_REF}` (or set MEGATRON_LM_REF)"


def require_megatron_lm(relative_file: str) -> str:
    """The path of `relative_file` in the Megatron-LM checkout; skips when it is not there."""
    path = os.path.join(MEGATRON_LM_REF, relative_file)
    if not os.path.isfile(path):
        pytest.skip(f"Megatron-LM source not found at {path}: run {MEGATRON_LM_INSTALL}")
    return path


def require_executable(name: str, install: str = TEST_EXTRAS) -> str:
    """A PATH for a subprocess that runs `name`: this interpreter's bin directory first (where pip
    puts `torchrun`, even when the virtual environment is not activated), then PATH. Skips when
    `name` is in neither."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    if shutil.which(name, path=path) is None:
        pytest.skip(f"needs {name} on PATH: {install}")
    return path


def require_megatron_core(relative_file: str = "megatron/core/__init__.py") -> str:
    """The Megatron-Core reference directory; skips when `relative_file` is not in it."""
    if not os.path.isfile(os.path.join(MEGATRON_CORE_REF, relative_file)):
        pytest.skip(f"Megatron-Core reference not found in {MEGATRON_CORE_REF}: run {MEGATRON_CORE_INSTALL}")
    return MEGATRON_CORE_REF


def skip_unless_importable_by_megatron_core(stderr: str) -> None:
    """After a reference subprocess failed: a skip when Megatron-Core could not be imported there."""
    if "ModuleNotFoundError" in stderr:
        last_line = stderr.strip().splitlines()[-1]
        pytest.skip(f"Megatron-Core in {MEGATRON_CORE_REF} cannot be imported here: {last_line}")
