"""Runs tests/gpu (every test_*.py) without pytest (for a GPU machine that has PyTorch but not pytest).

A stand-in `pytest` module gives the test file what it uses (marks, parametrize, approx); each test
function runs once per parameter set. Prints PASSED/FAILED lines and a closing count.
"""
import contextlib
import importlib
import itertools
import math
import sys
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _stand_in_pytest() -> types.ModuleType:
    module = types.ModuleType("pytest")

    class Mark:
        def __getattr__(self, name):
            if name == "parametrize":
                def parametrize(names, values):
                    def decorate(function):
                        function.__dict__.setdefault("params", []).append(([n.strip() for n in names.split(",")],
                                                                           list(values)))
                        return function
                    return decorate
                return parametrize
            return lambda *args, **kwargs: (args[0] if args and callable(args[0]) else (lambda f: f))

    module.mark = Mark()
    module.approx = lambda expected, rel=1e-6, abs=0.0: types.SimpleNamespace(
        __eq__=lambda self, other: math.isclose(other, expected, rel_tol=rel, abs_tol=abs))
    module.raises = lambda *a, **k: contextlib.nullcontext()
    module.skip = lambda reason="": (_ for _ in ()).throw(RuntimeError(f"skipped: {reason}"))
    return module


def main() -> int:
    sys.modules.setdefault("pytest", _stand_in_pytest())
    modules = [importlib.import_module(f"tests.gpu.{path.stem}")
               for path in sorted((ROOT / "tests" / "gpu").glob("test_*.py"))]
    passed = failed = 0
    for tests, name in ((m, n) for m in modules for n in sorted(n for n in dir(m) if n.startswith("test_"))):
        function = getattr(tests, name)
        grids = getattr(function, "params", [])
        combos = [dict()]
        for names, values in grids:
            combos = [dict(c, **dict(zip(names, v if len(names) > 1 else (v,)))) for c, v in
                      itertools.product(combos, values)]
        for kwargs in combos:
            label = f"{name}[{', '.join(map(str, kwargs.values()))}]" if kwargs else name
            try:
                function(**kwargs)
                passed += 1
                print(f"PASSED {label}", flush=True)
            except Exception:  # reported, and the run goes on
                failed += 1
                print(f"FAILED {label}\n{traceback.format_exc()}", flush=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
