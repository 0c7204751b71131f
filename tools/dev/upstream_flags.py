"""Writes megatron/training/megatron_lm/upstream_flags.json: every flag that the argument parsers of
NVIDIA Megatron-LM and of Megatron-LM for ROCm define, with its argument group, type, choices,
nargs, default and action, and the repositories and commits that define it.

    python tools/dev/upstream_flags.py NVIDIA=NVIDIA_GIT_DIR ROCm=ROCM_GIT_DIR \
        ROCm-dbdea573=ARGUMENTS_PY@dbdea573 \
        ROCm-dbdea573:megatron/core/transformer/transformer_config.py=TRANSFORMER_CONFIG_PY@e6f97367 \
        ROCm-dbdea573:megatron/core/model_parallel_config.py=MODEL_PARALLEL_CONFIG_PY@5c34c4cf \
        ROCm-dbdea573:megatron/core/transformer/enums.py=ENUMS_PY@b5103b78 \
        ROCm-dbdea573:megatron/training/training_config.py=TRAINING_CONFIG_PY@2c665460 \
        ROCm-dbdea573:megatron/training/common_config.py=COMMON_CONFIG_PY@5b976d27

A source is either a git directory (a clone, or `git clone --bare`) holding the commit pinned in
SOURCES below, or, for a source SOURCES marks as a file, the parser file itself saved at its pinned
commit (NAME=FILE@COMMIT: e.g. `curl -o /tmp/arguments.py https://raw.githubusercontent.com/ROCm/Megatron-LM/COMMIT/megatron/training/arguments.py`;
keep it out of the repository) plus the files that hold the config dataclasses its parser generates
argument groups from (NAME:PATH=FILE@COMMIT, one per file DATACLASS_FILES pins for the source: PATH
is the file's path in the repository, COMMIT the one it was saved at). Nothing is imported or run
from any of them. A group whose dataclass is in none of the given files (DATACLASS_FILES lists the
files the fork imports that could not be had, under `unread_files`) is listed in the data file
(`unread_groups`) instead of read; the explicit `add_argument` calls are read in full, and so are the
extra-argument functions that the source's pretrain_gpt.py adds (EXTRA_PROVIDERS, with the choices
they append to other flags). The parser source
(megatron/training/arguments.py) is read with `ast`: every `add_argument` call of every `_add_*_args` function that
`add_megatron_arguments` (or, in older versions, `parse_args`) calls, and every argument group that
Megatron-LM's `ArgumentGroupFactory` generates from a config dataclass (its rules reproduced here:
a field `x_y` is `--x-y`; a bool is `store_true`, or `--no-x-y`/`--disable-x-y` with `store_false`
when it defaults to True; `Optional[T]` is T; `list[T]` takes `nargs='+'`; a Literal or an Enum
gives the choices; the field's `argparse_meta` overrides). A value that is not a literal in the
source (a default computed by a function) is stored as its source text. An integer flag that
upstream's `validate_args` bounds (`assert args.x > N` or `>= N`) gets `validated`: the lowest value
accepted and the source of the `if` tests the assert sits under (null when it runs on every start),
so that a test knows which zero and negative values upstream accepts.

To follow upstream: change a commit in SOURCES (and DATACLASS_FILES), rerun, and commit the JSON with
the registry entries (megatron/training/megatron_lm/registry.py) for the flags that the coverage test
names.
"""
import argparse
import ast
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTPUT = os.path.join(ROOT, "megatron", "training", "megatron_lm", "upstream_flags.json")
PARSER_FILE = "megatron/training/arguments.py"
# source -> (commit, what it is, "git" (a git directory) or "file" (the parser file at that commit))
SOURCES = {
    "NVIDIA": ("d98e8a64ddf34856e74b24714e3bedb2f5a39553", "NVIDIA/Megatron-LM main, 2026-08-22", "git"),
    "ROCm": ("2b855bafe238ab0949d49609131d2da87fb09000", "ROCm/Megatron-LM rocm_dev (its default branch), 2024-10-22",
             "git"),
    "ROCm-dbdea573": ("dbdea57365399cd88fd84605e74191f6a932ee16",
                      "ROCm/Megatron-LM, the newest megatron/training/arguments.py of the public code index", "file"),
}
ENTRY_POINTS = ("add_megatron_arguments", "parse_args")
# Functions of the parser file that the source's pretrain_gpt.py also passes as extra_args_provider:
# the ROCm fork's pretrain_gpt.py (45deea22) adds get_patch_args ("patch" group) to every run.
EXTRA_PROVIDERS = {"ROCm-dbdea573": ("get_patch_args",)}
# A file source's dataclass files: {path in the repository: commit}. The public code index holds one
# version of each, not always at the parser's commit: these are the commits it holds (written to the
# data file beside the parser's). `unread_files`: files the parser imports from that it does not hold.
DATACLASS_FILES = {
    "ROCm-dbdea573": {
        "files": {
            "megatron/core/transformer/transformer_config.py": "e6f97367979b84315baccbde57c383cba296fdf8",
            "megatron/core/model_parallel_config.py": "5c34c4cfe41dc304ff51c686358cf039621c7cb1",
            "megatron/core/transformer/enums.py": "b5103b78c435e6d384cb24581b388493ea4c9eac",
            "megatron/training/training_config.py": "2c665460ad228a5e9c166801319addce224e74c7",
            "megatron/training/common_config.py": "5b976d2780f892c0ff24a93daea0ea97a7231974",
        },
        "unread_files": {"megatron/training/resilience_config.py": "not in the public code index"},
    },
}


class FileTree:
    """One parser file saved at a commit, and the dataclass files given with it ({path: local file}):
    a class is found in those files only."""

    def __init__(self, path: str, commit: str, dataclass_files: dict = None):
        self.commit = commit
        self._module = _parse_file(path)
        self._dataclass_modules = [_parse_file(local) for local in (dataclass_files or {}).values()]

    def parse(self, path: str) -> ast.Module:
        return self._module

    def find_class(self, name: str):
        """(module, ClassDef) of the top-level class `name` in the first dataclass file defining it."""
        for module in self._dataclass_modules:
            for node in module.body:
                if isinstance(node, ast.ClassDef) and node.name == name:
                    return module, node
        return None, None


def _parse_file(path: str) -> ast.Module:
    with open(path) as handle:
        return ast.parse(handle.read(), filename=path)


class Tree:
    """The Python files of one commit of a git directory, parsed on demand."""

    def __init__(self, git_dir: str, commit: str):
        self.git_dir, self.commit = git_dir, commit
        listing = self._git("ls-tree", "-r", "--name-only", commit, "megatron")
        self.files = [path for path in listing.splitlines() if path.endswith(".py")]
        self._parsed, self._classes = {}, {}
        self._text = {}

    def _git(self, *args) -> str:
        return subprocess.run(["git", "--git-dir", self.git_dir, *args], check=True, capture_output=True,
                              text=True).stdout

    def parse(self, path: str) -> ast.Module:
        if path not in self._parsed:
            self._parsed[path] = ast.parse(self._text.get(path) or self._git("show", f"{self.commit}:{path}"))
        return self._parsed[path]

    def find_class(self, name: str):
        """(module, ClassDef) of the first top-level class `name` under megatron/."""
        if name not in self._classes:
            self._classes[name] = self._find_class(name)
        return self._classes[name]

    def _find_class(self, name: str):
        for path in sorted(self.files, key=lambda p: ("/core/" not in p and "/training/config" not in p, p)):
            if path not in self._text:
                self._text[path] = self._git("show", f"{self.commit}:{path}")
            if f"class {name}" not in self._text[path]:
                continue
            for node in self.parse(path).body:
                if isinstance(node, ast.ClassDef) and node.name == name:
                    return self.parse(path), node
        return None, None


def _value(node):
    """A literal's value, or its source text."""
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return ast.unparse(node)


def _keywords(call: ast.Call) -> dict:
    return {k.arg: k.value for k in call.keywords if k.arg}


def _type_name(node) -> str:
    return ast.unparse(node) if node is not None else None


def _explicit(call: ast.Call, group: str) -> list:
    """The flag(s) of one `add_argument` call."""
    names = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    kwargs = _keywords(call)
    entry = {"group": group, "action": _value(kwargs.get("action")), "type": _type_name(kwargs.get("type")),
             "choices": _value(kwargs.get("choices")), "nargs": _value(kwargs.get("nargs")),
             "default": _value(kwargs.get("default")), "dest": _value(kwargs.get("dest"))}
    if entry["action"] is None and kwargs.get("action") is not None:
        entry["action"] = ast.unparse(kwargs["action"])
    if str(entry["action"]).endswith("BooleanOptionalAction"):  # argparse adds the --no- spelling
        names += ["--no-" + name[2:] for name in names if name.startswith("--")]
    return [dict(entry, name=name) for name in names if name.startswith("--")]


class Factory:
    """Megatron-LM's ArgumentGroupFactory, read from the dataclass source instead of run."""

    def __init__(self, tree):
        self.tree = tree
        self.unread = []  # file sources: the generated groups whose dataclass is in another file

    def fields(self, class_name: str) -> list:
        """(name, annotation, default node, field metadata node, init) of a dataclass and its bases, bases first."""
        module, node = self.tree.find_class(class_name)
        if node is None:
            raise SystemExit(f"class {class_name} not found in {self.tree.commit}")
        found = []
        for base in node.bases:
            if isinstance(base, ast.Name) and self.tree.find_class(base.id)[1] is not None:
                found += self.fields(base.id)
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            if "ClassVar" in ast.unparse(item.annotation):
                continue
            default, metadata, init = item.value, None, True
            if isinstance(default, ast.Call) and ast.unparse(default.func) in ("field", "dataclasses.field"):
                kwargs = _keywords(default)
                init = _value(kwargs.get("init")) is not False
                metadata = kwargs.get("metadata")
                default = kwargs.get("default", kwargs.get("default_factory"))
                if "default_factory" in kwargs:
                    default = ast.Call(func=kwargs["default_factory"], args=[], keywords=[])
            found = [f for f in found if f[0] != item.target.id] + [(item.target.id, item.annotation, default,
                                                                     metadata, init)]
        return found

    def _enum_choices(self, name: str):
        _, node = self.tree.find_class(name)
        if node is None or not any("Enum" in ast.unparse(b) for b in node.bases):
            return None
        return [t.id for item in node.body if isinstance(item, ast.Assign) for t in item.targets
                if isinstance(t, ast.Name)]

    def _kind(self, annotation) -> dict:
        text = ast.unparse(annotation)
        if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
            left, right = annotation.left, annotation.right
            return self._kind(left if ast.unparse(right) == "None" else right)
        if isinstance(annotation, ast.Subscript):
            outer = ast.unparse(annotation.value).split(".")[-1]
            inner = annotation.slice
            if outer == "Optional":
                return self._kind(inner)
            if outer == "Union":
                items = [e for e in inner.elts if ast.unparse(e) != "None"]
                return self._kind(items[0]) if len(items) == 1 else {"type": text}
            if outer in ("list", "List"):
                return dict(self._kind(inner), nargs="+")
            if outer == "Literal":
                choices = [_value(e) for e in (inner.elts if isinstance(inner, ast.Tuple) else [inner])]
                return {"type": type(choices[0]).__name__, "choices": choices}
            return {"type": text}
        if isinstance(annotation, ast.Name) and annotation.id not in ("bool", "int", "float", "str"):
            choices = self._enum_choices(annotation.id)
            if choices is not None:
                return {"type": annotation.id, "choices": choices}
        return {"type": text}

    def group(self, class_name: str, title: str, exclude: list) -> list:
        flags = []
        for name, annotation, default_node, metadata, init in self.fields(class_name):
            if name in exclude or not init:
                continue
            kind = self._kind(annotation)
            default = _value(default_node)
            entry = {"group": title, "action": None, "type": kind.get("type"), "choices": kind.get("choices"),
                     "nargs": kind.get("nargs"), "default": default, "dest": name}
            names = ["--" + name.replace("_", "-")]
            if entry["type"] == "bool":
                entry.update(type=None, action="store_true" if default is False else "store_false")
                if entry["action"] == "store_false":
                    names = ["--no-" + name.replace("_", "-"), "--disable-" + name.replace("_", "-")]
            meta = _value(metadata) if metadata is not None else None
            if isinstance(meta, dict) and isinstance(meta.get("argparse_meta"), dict):
                overrides = dict(meta["argparse_meta"])
                names = overrides.pop("arg_names", names)
                entry.update({k: v for k, v in overrides.items() if k in entry})
            elif metadata is not None and "argparse_meta" in ast.unparse(metadata):
                for key, value in zip(metadata.keys, metadata.values):
                    if _value(key) == "argparse_meta" and isinstance(value, ast.Dict):
                        for k, v in zip(value.keys, value.values):
                            k = _value(k)
                            if k == "arg_names":
                                names = _value(v)
                            elif k in entry:
                                entry[k] = ast.unparse(v) if k == "type" else _value(v)
            flags += [dict(entry, name=flag) for flag in names if flag.startswith("--")]
        return flags


def _functions(module: ast.Module) -> dict:
    return {node.name: node for node in module.body if isinstance(node, ast.FunctionDef)}


def _called(function: ast.FunctionDef) -> list:
    """The `_add_*` functions a function calls, in order."""
    return [node.func.id for node in ast.walk(function) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name) and node.func.id.startswith("_add_")]


def _group_flags(function: ast.FunctionDef, factory: Factory) -> list:
    """The flags one `_add_*_args(parser)` function defines, in source order. A name bound to an
    argument group (by `add_argument_group` or a factory's `build_group`) has that group's title
    from its binding on."""
    titles, exclusions, factories, flags = {}, {}, {}, []
    nodes = sorted((n for n in ast.walk(function) if isinstance(n, (ast.Assign, ast.Call))),
                   key=lambda n: (n.lineno, n.col_offset, isinstance(n, ast.Call)))
    for node in nodes:
        if isinstance(node, ast.Assign):
            if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
                continue
            target, value = node.targets[0].id, node.value
            func = ast.unparse(value.func) if isinstance(value, ast.Call) else ""
            if isinstance(value, ast.List):
                exclusions[target] = _value(value)
            elif func.endswith("add_argument_group"):
                titles[target] = _value(_keywords(value).get("title", value.args[0] if value.args else None))
            elif func.endswith("build_group"):
                titles[target] = _value(_keywords(value).get("title", value.args[1] if len(value.args) > 1 else None))
            elif func.split(".")[-1] == "ArgumentGroupFactory":
                factories[target] = value
            continue
        func = ast.unparse(node.func)
        if func.endswith(".add_argument"):
            owner = func.rsplit(".", 1)[0]
            flags += _explicit(node, titles.get(owner, owner))
        elif func.endswith(".build_group"):
            owner = node.func.value
            constructor = owner if isinstance(owner, ast.Call) else factories.get(getattr(owner, "id", None))
            if constructor is not None:
                flags += _factory_group(constructor, node, factory, exclusions)
    return flags


def _factory_group(constructor: ast.Call, build: ast.Call, factory: Factory, exclusions: dict) -> list:
    class_name = ast.unparse(constructor.args[0]).split(".")[-1]
    exclude = _keywords(constructor).get("exclude")
    exclude = exclusions.get(exclude.id, []) if isinstance(exclude, ast.Name) else (_value(exclude) or [])
    title = _keywords(build).get("title", build.args[1] if len(build.args) > 1 else None)
    if factory.tree.find_class(class_name)[1] is None and isinstance(factory.tree, FileTree):
        factory.unread.append({"group": _value(title), "class": class_name})
        return []
    return factory.group(class_name, _value(title), exclude)


def _minimum(statement: ast.stmt):
    """(dest, lowest integer accepted) of `assert args.X > N` or `assert args.X >= N`, N a literal."""
    test = statement.test if isinstance(statement, ast.Assert) else None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Gt, ast.GtE))):
        return None
    left, value = test.left, _value(test.comparators[0])
    if not (isinstance(left, ast.Attribute) and isinstance(left.value, ast.Name) and left.value.id == "args"
            and type(value) is int):
        return None
    return left.attr, value + 1 if isinstance(test.ops[0], ast.Gt) else value


def _bounds(statements: list, conditions: tuple = ()) -> list:
    """(dest, lowest integer accepted, condition) of every such assert in `statements`, nested ones
    included; the condition is the source of the `if` tests around it (None if it runs on every start)."""
    found = []
    for statement in statements:
        bound = _minimum(statement)
        if bound is not None:
            found.append((*bound, " and ".join(conditions) or None))
        if isinstance(statement, ast.If):
            test = f"({ast.unparse(statement.test)})"
            found += _bounds(statement.body, conditions + (test,))
            found += _bounds(statement.orelse, conditions + (f"not {test}",))
        elif isinstance(statement, (ast.For, ast.While, ast.With, ast.Try)):
            for name in ("body", "orelse", "finalbody"):
                found += _bounds(getattr(statement, name, []), conditions)
            for handler in getattr(statement, "handlers", []):
                found += _bounds(handler.body, conditions)
    return found


def _minimums(function: ast.FunctionDef) -> dict:
    """{dest: {"minimum": N, "when": condition}} from the asserts of upstream's `validate_args`; an
    unconditional bound wins over a conditional one, then the highest."""
    chosen = {}
    for dest, lowest, when in _bounds(function.body):
        if dest not in chosen or (chosen[dest][1] is not None, -chosen[dest][0]) > (when is not None, -lowest):
            chosen[dest] = (lowest, when)
    return {dest: {"minimum": lowest, "when": when} for dest, (lowest, when) in chosen.items()}


def _added_choices(function: ast.FunctionDef) -> dict:
    """{flag: [values]} that a provider appends to flags defined elsewhere, written as
    `if "--flag" in action.option_strings: action.choices.append(VALUE)`."""
    added = {}
    for node in ast.walk(function):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.ops[0], ast.In) and "option_strings" in ast.unparse(node.test)):
            continue
        flag = _value(node.test.left)
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            if ast.unparse(call.func).endswith("choices.append") and call.args:
                added.setdefault(flag, []).append(_value(call.args[0]))
    return added


def read_parser(tree, source: str = "") -> tuple:
    """(flags, generated groups not read, {flag: choices added}) of the parser of a Tree or FileTree."""
    commit = tree.commit
    module = tree.parse(PARSER_FILE)
    functions = _functions(module)
    entry = next((functions[name] for name in ENTRY_POINTS if name in functions and _called(functions[name])), None)
    if entry is None:
        raise SystemExit(f"{commit}: none of {ENTRY_POINTS} in {PARSER_FILE} calls the _add_*_args functions")
    factory = Factory(tree)
    flags = []
    for name in _called(entry):
        if name in functions:
            flags += _group_flags(functions[name], factory)
    added = {}
    for name in EXTRA_PROVIDERS.get(source, ()):
        flags += _group_flags(functions[name], factory)
        added.update(_added_choices(functions[name]))
    minimums = _minimums(functions["validate_args"]) if "validate_args" in functions else {}
    for flag in flags:
        dest = flag["dest"] or flag["name"][2:].replace("-", "_")
        if flag["type"] == "int" and dest in minimums:
            flag["validated"] = minimums[dest]
    return flags, factory.unread, added


def merge(per_source: dict, added_choices: dict) -> list:
    """One entry per flag: the first source's description, every source that defines it, and every
    choice any source offers (its own list, or what its extra-argument provider appends)."""
    merged = {}
    for source, flags in per_source.items():
        for flag in flags:
            entry = merged.setdefault(flag["name"], dict(flag, sources=[]))
            if source not in entry["sources"]:
                entry["sources"].append(source)
            if source != next(iter(per_source)) and entry["sources"] == [source]:
                entry.update(flag)
            elif isinstance(entry["choices"], list) and isinstance(flag["choices"], list):
                entry["choices"] = entry["choices"] + [c for c in flag["choices"] if c not in entry["choices"]]
    for choices in added_choices.values():
        for name, values in choices.items():
            if name in merged and isinstance(merged[name]["choices"], list):
                merged[name]["choices"] = merged[name]["choices"] + [v for v in values
                                                                     if v not in merged[name]["choices"]]
    return list(merged.values())


def _saved(parser: argparse.ArgumentParser, label: str, location: str, commit: str) -> str:
    """The local path of FILE@COMMIT, checked against the pinned commit."""
    path, _, at = location.rpartition("@")
    if not path or not at or not commit.startswith(at):
        parser.error(f"{label}: give the file saved at commit {commit} as {label}=FILE@{commit[:8]}")
    return path


def _trees(parser: argparse.ArgumentParser, given: dict) -> dict:
    """{source: Tree or FileTree} in SOURCES' order, from NAME=GIT_DIR, or NAME=FILE@COMMIT and
    NAME:PATH=FILE@COMMIT for each dataclass file of a file source."""
    wanted = [name for name in SOURCES] + [f"{name}:{path}" for name, pinned in DATACLASS_FILES.items()
                                           for path in pinned["files"]]
    missing = [name for name in wanted if name not in given]
    if missing:
        parser.error(f"give every source: missing {', '.join(missing)} (a git directory, or for a file source "
                     f"the parser file at its commit, NAME=/tmp/arguments.py@COMMIT, and each of its dataclass "
                     f"files at the commit DATACLASS_FILES pins, NAME:PATH=FILE@COMMIT)")
    unknown = [name for name in given if name not in wanted]
    if unknown:
        parser.error(f"unknown source {', '.join(unknown)}: the sources are {', '.join(wanted)}")
    trees = {}
    for name, (commit, _, kind) in SOURCES.items():
        if kind == "git":
            trees[name] = Tree(given[name], commit)
            continue
        files = {path: _saved(parser, f"{name}:{path}", given[f"{name}:{path}"], file_commit)
                 for path, file_commit in DATACLASS_FILES.get(name, {"files": {}})["files"].items()}
        trees[name] = FileTree(_saved(parser, name, given[name], commit), commit, files)
    return trees


def _source_entry(name: str, unread_groups: list) -> dict:
    """The data file's description of one source: its parser's commit and, for a file source, the
    commit of each dataclass file read and the files not read."""
    commit, what, kind = SOURCES[name]
    entry = {"commit": commit, "what": what, "file": PARSER_FILE, "read_from": kind}
    pinned = DATACLASS_FILES.get(name)
    if pinned:
        entry["dataclass_files"] = [{"file": path, "commit": file_commit} for path, file_commit in
                                    pinned["files"].items()]
        entry["unread_files"] = pinned["unread_files"]
    if unread_groups:
        entry["unread_groups"] = unread_groups
    return entry


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="+", metavar="NAME=GIT_DIR|NAME=FILE@COMMIT|NAME:PATH=FILE@COMMIT",
                        help=f"one per source: {', '.join(SOURCES)}")
    args = parser.parse_args(argv)
    trees = _trees(parser, dict(item.split("=", 1) for item in args.sources))
    read = {name: read_parser(tree, name) for name, tree in trees.items()}
    per_source = {name: flags for name, (flags, _, _) in read.items()}
    flags = merge(per_source, {name: added for name, (_, _, added) in read.items()})
    keys = ("name", "group", "action", "type", "choices", "nargs", "default", "dest", "sources", "validated")
    document = {
        "generated_by": "python tools/dev/upstream_flags.py " + " ".join(
            [f"{n}=GIT_DIR" if kind == "git" else f"{n}=FILE@{commit}" for n, (commit, _, kind) in SOURCES.items()]
            + [f"{n}:{path}=FILE@{commit}" for n, pinned in DATACLASS_FILES.items()
               for path, commit in pinned["files"].items()]),
        "sources": {name: _source_entry(name, read[name][1]) for name in SOURCES},
        "flags": [{key: flag.get(key) for key in keys} for flag in flags],
    }
    with open(OUTPUT, "w") as handle:  # one flag per line, so that a regeneration diffs by flag
        header = {key: value for key, value in document.items() if key != "flags"}
        handle.write(json.dumps(header, indent=1)[:-2] + ',\n "flags": [\n')
        handle.write(",\n".join(json.dumps({k: v for k, v in flag.items() if k != "validated" or v}, default=str)
                                 for flag in document["flags"]))
        handle.write("\n ]\n}\n")
    counts = {name: len({f["name"] for f in flags_}) for name, flags_ in per_source.items()}
    print(f"wrote {OUTPUT}: {len(flags)} flags ({', '.join(f'{n} {c}' for n, c in counts.items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
