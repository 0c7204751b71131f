"""The README's test command is what CI runs: both call tools/dev/run_tests.sh, which installs the
Megatron-Core reference (so that its tests run rather than skip) and then runs pytest on tests/."""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "bash tools/dev/run_tests.sh"


def test_readme_and_ci_run_the_same_script():
    readme = (ROOT / "README.md").read_text()
    assert f"&& {COMMAND}\n" in readme
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.strip().startswith("#")]
    assert ci[-1] == COMMAND


def test_the_script_installs_the_reference_apart_and_runs_every_test():
    script = (ROOT / "tools" / "dev" / "run_tests.sh").read_text()
    assert 'pip install --quiet -e ".[test]"' in script
    assert '--no-deps --target "$MEGATRON_CORE_REF" "megatron-core==0.16.1"' in script
    # Every test, on two workers scheduled by tests/conftest.py, with the 20 slowest printed at the end
    # so that a new slow test is seen.
    assert script.rstrip().splitlines()[-1] == 'python -m pytest -q --durations=20 -n 2 tests "$@"'
    for path in (ROOT / "tools" / "dev" / "run_tests.sh", ROOT / ".ci" / "run"):
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0, path
