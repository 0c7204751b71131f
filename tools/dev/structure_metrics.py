"""Counts that say how the application side is laid out (docs/design.md, "Rooms of the application"),
read from the source with `ast` so that anyone can reproduce them on any commit:

    python tools/dev/structure_metrics.py [--root DIR] [--limit 60]

- modules at the top of megatron/training: its .py files (not __init__.py) and its sub-packages;
- project imports of megatron/training/training.py: the distinct project modules it imports
  (`from megatron.x import a, b` counts once, function-level imports included);
- the largest object handed between modules: the dataclass with the most fields among those the
  application defines to carry state (megatron/training outside config/, whose dataclasses are the
  flag groups a user fills in), over the whole application and over the loop's rooms alone
  (outside planning/, whose dataclasses are the planner's records of numbers);
- functions over --limit lines in megatron/ (def line to last line, docstring included).

It imports nothing of the project: the numbers come from the files alone.
"""
import argparse
import ast
from pathlib import Path

PROJECT_PREFIXES = ("megatron.", "pretrain_gpt", "tools.", "bench.")


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def top_of_training(root: Path) -> tuple:
    """(modules, packages) directly under megatron/training."""
    training = root / "megatron" / "training"
    modules = sorted(p.stem for p in training.glob("*.py") if p.name != "__init__.py")
    packages = sorted(p.name for p in training.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    return modules, packages


def project_imports(path: Path) -> list:
    """The distinct project modules `path` imports."""
    found = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return sorted(name for name in found if name.startswith(PROJECT_PREFIXES) or name == "pretrain_gpt")


def _is_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False


def dataclass_fields(root: Path) -> list:
    """[(fields, 'module.Class')] of the state-carrying dataclasses, largest first."""
    training = root / "megatron" / "training"
    sizes = []
    for path in sorted(training.rglob("*.py")):
        if (training / "config") in path.parents:
            continue
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ClassDef) and _is_dataclass(node):
                fields = [s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                          and not (isinstance(s.annotation, ast.Name) and s.annotation.id == "ClassVar")]
                module = ".".join(path.relative_to(root).with_suffix("").parts)
                sizes.append((len(fields), f"{module}.{node.name}"))
    return sorted(sizes, key=lambda item: (-item[0], item[1]))


def long_functions(root: Path, limit: int) -> list:
    """[(lines, 'path:line name')] of the functions in megatron/ longer than `limit` lines, longest first."""
    found = []
    for path in sorted((root / "megatron").rglob("*.py")):
        for node in ast.walk(parse(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append((lines, f"{path.relative_to(root)}:{node.lineno} {node.name}"))
    return sorted(found, key=lambda item: (-item[0], item[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[2]), help="the repository to measure")
    parser.add_argument("--limit", type=int, default=60, help="a function longer than this many lines is counted")
    args = parser.parse_args()
    root = Path(args.root)
    modules, packages = top_of_training(root)
    print(f"modules at the top of megatron/training: {len(modules)} (+ {len(packages)} packages: {', '.join(packages)})")
    imports = project_imports(root / "megatron" / "training" / "training.py")
    print(f"project imports of megatron/training/training.py: {len(imports)}")
    sizes = dataclass_fields(root)
    print("largest state dataclasses of megatron/training (fields): "
          + ", ".join(f"{name} {count}" for count, name in sizes[:4]))
    loop = [(count, name) for count, name in sizes if ".planning." not in name]
    print("largest outside planning/: " + ", ".join(f"{name} {count}" for count, name in loop[:4]))
    functions = long_functions(root, args.limit)
    print(f"functions over {args.limit} lines in megatron/: {len(functions)}")
    for lines, where in functions:
        print(f"  {lines:4d}  {where}")


if __name__ == "__main__":
    main()
