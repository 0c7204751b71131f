"""The floors of docs/design.md, checked over every module's imports (with `ast`, function-level
imports included): a module may import its own floor and the floors below it, never one above.
An upward import fails the test, naming the file, the line and both floors."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Bottom to top. A module's floor is that of the longest prefix of its dotted name listed here.
FLOORS = [
    ("megatron.core.utils", "megatron.core.parallel_layout", "megatron.core.parallel_state", "megatron.core.tokenizers", "megatron.core.datasets"),
    ("megatron.core.distributed",),
    ("megatron.core.tensor_parallel", "megatron.core.optimizer", "megatron.core.pipeline_parallel",
     "megatron.core.context_parallel"),
    ("megatron.core.transformer",),
    ("megatron.core.models",),
    ("megatron.core.checkpointing",),
    ("megatron.training",),
    ("pretrain_gpt", "tools", "bench"),
]
# What tools may use of the application: its public entry points (flags to a config, the checks and
# errors of that config, the flag tables, the tokenizer the flags name, the planner), never
# pretrain_gpt or the loop's internals. Benchmarks drive the loop itself and may use all of it.
TOOLS = "tools"
TOOLS_MAY_IMPORT = ("megatron.core", "megatron.training.arguments", "megatron.training.validation",
                    "megatron.training.errors", "megatron.training.megatron_lm",
                    "megatron.training.data.build_tokenizer", "megatron.training.planning", "tools")


def floor_of(module: str):
    """(floor index, prefix) of a dotted module name, or None for modules outside the floors."""
    best = None
    for index, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (index, prefix)
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(tree: ast.AST, package: str):
    """(line, dotted name) of every import in `tree` (relative imports resolved against `package`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if floor_of(f"{base}.{alias.name}") else base


def sources():
    return sorted(p for pattern in ("megatron/**/*.py", "tools/**/*.py", "bench/*.py", "pretrain_gpt.py")
                  for p in ROOT.glob(pattern))


def upward_imports() -> list:
    found = []
    for path in sources():
        name = module_name(path)
        own = floor_of(name)
        if own is None:
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for line, imported in imported_modules(ast.parse(path.read_text(), str(path)), package):
            target = floor_of(imported)
            if target is not None and target[0] > own[0]:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {imported} ({target[1]}, floor {target[0]}) "
                             f"from floor {own[0]} ({own[1]})")
    return found

# The rooms of megatron/training that stand below the loop (docs/design.md, "Rooms of the
# application"): what each may import of the application.
ROOMS = {
    "megatron.training.errors": (),
    "megatron.training.state": ("megatron.training.errors",),
    "megatron.training.checkpointing": ("megatron.training.errors", "megatron.training.state"),
    "megatron.training.reliability": ("megatron.training.errors", "megatron.training.state",
                                      "megatron.training.reliability", "megatron.training.arguments",
                                      "megatron.training.config", "megatron.training.memory"),
    "megatron.training.reporting": ("megatron.training.errors", "megatron.training.state",
                                    "megatron.training.reporting", "megatron.training.planning.architecture"),
}


def _within(name: str, prefixes) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def test_the_rooms_below_the_loop_do_not_call_it():
    found = []
    for path in sources():
        name = module_name(path)
        room = next((r for r in ROOMS if _within(name, (r,))), None)
        if room is None:
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found += [f"{path.relative_to(ROOT)}:{line} imports {imported} (room {room})"
                  for line, imported in imported_modules(ast.parse(path.read_text(), str(path)), package)
                  if _within(imported, ("megatron.training",)) and not _within(imported, ROOMS[room])]
    assert found == [], "\n".join(found)


def test_the_loop_reaches_reliability_through_the_supervisor():
    """The loop calls the Supervisor, which holds the reliability parts; it imports none of them."""
    path = ROOT / "megatron" / "training" / "training.py"
    found = [f"megatron/training/training.py:{line} imports {imported}"
             for line, imported in imported_modules(ast.parse(path.read_text()), "megatron.training")
             if _within(imported, ("megatron.training.reliability",))
             and not _within(imported, ("megatron.training.reliability.supervisor",))]
    assert found == [], "\n".join(found)


def imports_outside_public_entry_points(relative: str, source: str) -> list:
    """The imports of the tool at `relative` (its text: `source`) that reach past the application's
    public entry points."""
    package = module_name(ROOT / relative).rpartition(".")[0]
    return [f"{relative}:{line} imports {imported}" for line, imported in imported_modules(ast.parse(source), package)
            if floor_of(imported) is not None
            and not any(imported == allowed or imported.startswith(allowed + ".") for allowed in TOOLS_MAY_IMPORT)]


def test_tools_use_only_the_public_entry_points():
    found = [line for path in sources() if module_name(path).startswith(TOOLS + ".")
             for line in imports_outside_public_entry_points(str(path.relative_to(ROOT)), path.read_text())]
    assert found == [], "\n".join(found)


def test_every_module_is_on_a_floor():
    missing = [str(p.relative_to(ROOT)) for p in sources() if p.name != "__init__.py" and floor_of(module_name(p)) is None
               and module_name(p).startswith("megatron.")]
    assert missing == []


def test_no_module_imports_a_floor_above_its_own():
    assert upward_imports() == [], "\n".join(upward_imports())


@pytest.mark.parametrize("module, imported, upward", [
    ("megatron.core.distributed.ddp", "megatron.core.tensor_parallel.layers", True),
    ("megatron.core.transformer.attention", "megatron.core.tensor_parallel.layers", False),
    ("megatron.core.checkpointing.state", "megatron.training.checkpointing", True),
    ("tools.plan", "megatron.training.memory", False),
])
def test_the_floors_order_modules(module, imported, upward):
    assert (floor_of(imported)[0] > floor_of(module)[0]) is upward


def test_a_tool_importing_the_entry_point_or_the_loop_is_named():
    source = ("import pretrain_gpt\nfrom megatron.training.training import setup\n"
              "from megatron.training.arguments import parse_args\nfrom megatron.core import utils\n")
    assert imports_outside_public_entry_points("tools/example_tool.py", source) == [
        "tools/example_tool.py:1 imports pretrain_gpt",
        "tools/example_tool.py:2 imports megatron.training.training.setup"]
