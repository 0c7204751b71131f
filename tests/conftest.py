"""Tests marked `gpu` need a CUDA device; without one they are skipped with the reason.

How tests share the machine's cores (`tools/dev/run_tests.sh` runs pytest-xdist with two
workers): every test that starts several processes (tests/distributed, tests/functional) is in one
scope, run one after another by one worker, so no two multi-rank runs compete for the cores and
their timing checks see the machine they were written for; each file of single-process tests is a
scope of its own (its module and session fixtures are built once), and the other worker runs those
beside the multi-process tests, on the core they leave idle.
"""
import pytest
import torch

MULTI_PROCESS = ("tests/distributed/", "tests/functional/")


def scope_of(nodeid: str) -> str:
    """The scope a test is scheduled in: "multi-process", or its file."""
    return "multi-process" if nodeid.startswith(MULTI_PROCESS) else nodeid.split("::")[0]


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class MultiProcessTestsInOneScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return MultiProcessTestsInOneScope(config, log)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on one with: bash bench/gpu_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
