#!/usr/bin/env bash
# The test suite exactly as CI runs it (.ci/run calls this), in the active Python environment:
#
#     bash tools/dev/run_tests.sh            # every test; pytest arguments may follow
#
# 1. installs this package with its test extras: pip install -e ".[test]";
# 2. installs the Megatron-Core reference (megatron-core==0.16.1) apart from our own package, into
#    $MEGATRON_CORE_REF (default ~/.cache/megatron-core-ref), with --no-deps: both are a top-level
#    `megatron`, so the reference is only ever imported by tests in a subprocess whose PYTHONPATH
#    is that directory. Skipped when it is there already;
# 3. runs pytest on tests/ with one thread per process, on two workers (pytest-xdist): one runs the
#    multi-process tests one after another, the other the single-process test files beside them
#    (tests/conftest.py schedules them), and prints the 20 slowest tests at the end (--durations=20) so
#    that the next slow test is seen when it lands. On a machine without a GPU only the GPU tests
#    skip, each saying why.
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m pip install --quiet -e ".[test]"
python -c "from megatron.core.datasets.helpers import cpp_available; print('C++ index helper:', 'built' if cpp_available() else 'missing (numpy fallback)')"
export MEGATRON_CORE_REF="${MEGATRON_CORE_REF:-$HOME/.cache/megatron-core-ref}"
if [ ! -f "$MEGATRON_CORE_REF/megatron/core/__init__.py" ]; then
  python -m pip install --quiet --no-deps --target "$MEGATRON_CORE_REF" "megatron-core==0.16.1"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m pytest -q --durations=20 -n 2 tests "$@"
