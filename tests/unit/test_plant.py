"""tools/dev/plant.py: the mutation list parses, and a planted bug is reported caught or survived
(a two-line module and its test in a throw-away git checkout; a few seconds)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "dev" / "plant.py"


def load_plant():
    spec = importlib.util.spec_from_file_location("plant", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_list_parses_and_every_mutation_applies_once():
    plant = load_plant()
    mutations = plant.parse(plant.DEFAULT_LIST)
    assert len(mutations) >= 30
    for mutation in mutations:
        mutated = plant.locate(mutation, plant.ROOT)
        assert mutated != (Path(plant.ROOT) / mutation.file).read_text()
        assert mutation.tests and mutation.why, mutation.name


def test_list_format_errors_name_the_line(tmp_path):
    plant = load_plant()
    listing = tmp_path / "list.txt"
    listing.write_text("# comment\nname: a\nfile: x.py\nfind:     return 1\noccurrence: 2\nreplace: return 2\n"
                       "tests: 'test_x.py::test_a[p q]' test_y.py\n\nname: b\nfile: x.py\nfnd: y\n")
    with pytest.raises(SystemExit, match=r"list.txt:11: expected 'KEY: value'"):
        plant.parse(str(listing))
    listing.write_text(listing.read_text().replace("fnd: y\n", "find: y\nreplace: z\ntests: t\n"))
    first, _ = plant.parse(str(listing))
    assert (first.find, first.occurrence, first.tests) == ("    return 1", 2, ["test_x.py::test_a[p q]", "test_y.py"])


def test_a_caught_and_a_surviving_mutation(tmp_path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (checkout / "test_calc.py").write_text("from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    listing = tmp_path / "mutations.txt"
    listing.write_text("name: subtracts\nfile: calc.py\nfind: return a + b\nreplace: return a - b\n"
                       "tests: test_calc.py\n\n"
                       "name: commutes\nfile: calc.py\nfind: return a + b\nreplace: return b + a\ntests: test_calc.py\n"
                       "why: equivalent\n")
    result = subprocess.run([sys.executable, str(SCRIPT), str(listing), "--root", str(checkout)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr  # one survivor
    lines = result.stdout.splitlines()
    assert any(line.startswith("caught") and "subtracts" in line and "calc.py:2" in line for line in lines), lines
    assert any(line.startswith("SURVIVED") and "commutes" in line for line in lines), lines
    assert "score: caught 1 / planted 2" in lines
    assert "survived: commutes (calc.py:2): equivalent" in lines
    assert (checkout / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
