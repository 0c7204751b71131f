"""Builds the optional C++ index helper and sets the license metadata; everything else is declared
in pyproject.toml.

The extension is optional by design: if no C++ compiler or pybind11 is available the build
still succeeds and the datasets fall back to their numpy twin (with a warning at run time).
"""
import setuptools
from setuptools import setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """Build extensions, but never fail the install because one of them could not compile."""

    def run(self):
        try:
            super().run()
        except Exception as error:  # compiler missing, headers missing, ...
            print(f"WARNING: optional C++ extension not built ({error}); using the numpy fallback")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as error:
            print(f"WARNING: optional extension {ext.name} not built ({error}); using the numpy fallback")


def extensions():
    try:
        from pybind11.setup_helpers import Pybind11Extension
    except ImportError:
        return []
    return [
        Pybind11Extension(
            "megatron.core.datasets._helpers",
            ["megatron/core/datasets/helpers.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        )
    ]


def license_metadata() -> dict:
    """Apache-2.0 as an SPDX expression where setuptools reads one (77 and later), else as text."""
    major = int(setuptools.__version__.split(".")[0])
    return {"license_expression": "Apache-2.0"} if major >= 77 else {"license": "Apache-2.0"}


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt}, **license_metadata())
