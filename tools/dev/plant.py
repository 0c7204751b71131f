"""Plants one-line bugs in a copy of the repository and reports which ones the tests catch.

    python tools/dev/plant.py                                  # every mutation of tools/dev/mutations.txt
    python tools/dev/plant.py my_list.txt --only dp-average    # some mutations of another list
    python tools/dev/plant.py --full-suite                     # each mutation against all of tests/

Each mutation replaces text on one line of one file (see tools/dev/mutations.txt for the format)
and names the tests that should catch it (a few test ids: the list is a benchmark-style job, not
part of the suite). The repository (tracked and untracked files that git does
not ignore, plus built extensions) is copied once to a temporary directory; there each mutation is
applied, its tests run (`python -m pytest -x`, with the copy first on PYTHONPATH), and the file is
restored. The working tree is never modified.

A mutation is caught when its tests fail (or cannot be collected, or time out), and survives when
they pass. Before planting anything each distinct selection of tests runs once on the unmodified
copy: a failure there would make the score meaningless, so it stops the run (--no-baseline skips
it).
Prints one line per mutation and the score, caught / planted; --report writes them as JSON.
"""
import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
DEFAULT_LIST = os.path.join(ROOT, "tools", "dev", "mutations.txt")
KEYS = ("name", "file", "find", "occurrence", "replace", "tests", "why")


@dataclasses.dataclass
class Mutation:
    name: str
    file: str
    find: str
    replace: str
    tests: list
    why: str = ""
    occurrence: int = 0  # which occurrence of `find` to replace (1-based); 0: it must occur once
    line: int = 0  # 1-based line the text was found on


def parse(path: str) -> list:
    """Mutations of a list file: blocks of `key: value` lines separated by blank lines; `#` starts
    a comment line. The value is everything after `key: ` (leading spaces of find/replace count)."""
    blocks, current = [], {}
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    for number, line in enumerate(lines + [""], start=1):
        if line.startswith("#"):
            continue
        if not line.strip():
            if current:
                blocks.append(current)
                current = {}
            continue
        key, colon, value = line.partition(":")
        if not colon or key not in KEYS:
            raise SystemExit(f"{path}:{number}: expected 'KEY: value' with KEY one of {', '.join(KEYS)}, got {line!r}")
        if key in current:
            raise SystemExit(f"{path}:{number}: {key!r} given twice in one mutation")
        current[key] = value[1:] if value.startswith(" ") else value
    mutations = []
    for block in blocks:
        missing = [key for key in ("name", "file", "find", "replace", "tests") if key not in block]
        if missing:
            raise SystemExit(f"{path}: mutation {block.get('name', block)!r} lacks {', '.join(missing)}")
        occurrence = block.get("occurrence", "0")
        if not occurrence.isdigit():
            raise SystemExit(f"{path}: mutation {block['name']!r}: occurrence must be a number, got {occurrence!r}")
        mutations.append(Mutation(block["name"], block["file"], block["find"], block["replace"],
                                  shlex.split(block["tests"]), block.get("why", ""), int(occurrence)))
    names = [m.name for m in mutations]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SystemExit(f"{path}: mutation names must be unique; repeated: {', '.join(duplicates)}")
    return mutations


def locate(mutation: Mutation, root: str) -> str:
    """Checks that the mutation's text lies on one line, occurs exactly once in its file (or at
    least `occurrence` times when that is given), and that the replacement changes it; returns the
    mutated file content (sets `mutation.line`)."""
    path = os.path.join(root, mutation.file)
    if not os.path.isfile(path):
        raise SystemExit(f"mutation {mutation.name}: no file {mutation.file}")
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    starts = [found.start() for found in re.finditer(re.escape(mutation.find), text)] if mutation.find else []
    wanted = mutation.occurrence or 1
    if "\n" in mutation.find or len(starts) < wanted or (not mutation.occurrence and len(starts) != 1):
        raise SystemExit(f"mutation {mutation.name}: the 'find' text occurs {len(starts)} times in {mutation.file} "
                         "(it must be part of one line, and occur once unless 'occurrence' picks one); "
                         "quote more of the line")
    if mutation.find == mutation.replace:
        raise SystemExit(f"mutation {mutation.name}: 'replace' equals 'find'")
    start = starts[wanted - 1]
    mutation.line = text[:start].count("\n") + 1
    return text[:start] + mutation.replace + text[start + len(mutation.find):]


def repository_files(root: str) -> list:
    """Tracked and untracked-but-not-ignored files, plus built extension modules (ignored by git)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True,
                            check=True).stdout.decode().split("\0")
    files = [f for f in listed if f and os.path.isfile(os.path.join(root, f))]
    for directory, _, names in os.walk(os.path.join(root, "megatron")):
        files.extend(os.path.relpath(os.path.join(directory, n), root) for n in names if n.endswith((".so", ".pyd")))
    return sorted(set(files))


def copy_repository(root: str, destination: str) -> None:
    for relative in repository_files(root):
        target = os.path.join(destination, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(root, relative), target)


def test_environment(copy: str) -> dict:
    return dict(os.environ, PYTHONPATH=copy + os.pathsep + os.environ.get("PYTHONPATH", ""),
                PYTHONDONTWRITEBYTECODE="1")


def check_copy_is_imported(copy: str) -> None:
    """An editable install of the working tree must not shadow the copy, or nothing planted would run."""
    if not os.path.isdir(os.path.join(copy, "megatron")):
        return
    found = subprocess.run([sys.executable, "-c", "import megatron; print(megatron.__file__)"], cwd=copy,
                           env=test_environment(copy), capture_output=True, text=True).stdout.strip()
    if not os.path.realpath(found).startswith(os.path.realpath(copy) + os.sep):
        raise SystemExit(f"the tests would import megatron from {found or '(nowhere)'}, not from the copy in {copy}")


def run_tests(copy: str, tests: list, timeout: float) -> tuple:
    """(outcome, seconds, first failing test or the last line of output). Outcome: "passed",
    "failed" (a test failed or could not be collected), "timeout", or "error" (pytest could not run
    them, e.g. no test matched)."""
    env = test_environment(copy)
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    try:
        result = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, f"no result within {timeout:.0f} s"
    seconds = time.monotonic() - start
    output = result.stdout + result.stderr
    found = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    detail = found.group(1) if found else (output.strip().splitlines() or [""])[-1]
    if result.returncode == 0:
        return "passed", seconds, detail
    if result.returncode in (1, 2):
        return "failed", seconds, detail
    return "error", seconds, f"pytest exit code {result.returncode}: {detail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mutations", nargs="?", default=DEFAULT_LIST, help="mutation list (default: %(default)s)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="plant only these mutations")
    parser.add_argument("--full-suite", action="store_true", help="run all of tests/ for every mutation")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per test run (default %(default)s)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on the unmodified copy")
    parser.add_argument("--report", help="write the results as JSON to this file")
    parser.add_argument("--root", default=ROOT, help="the git checkout to copy and plant in (default: %(default)s)")
    args = parser.parse_args(argv)

    mutations = parse(args.mutations)
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in mutations})
        if unknown:
            raise SystemExit(f"--only: no mutation named {', '.join(unknown)} in {args.mutations}")
        mutations = [m for m in mutations if m.name in args.only]
    for mutation in mutations:
        locate(mutation, args.root)
        if args.full_suite:
            mutation.tests = ["tests"]

    with tempfile.TemporaryDirectory(prefix="plant-") as copy:
        copy_repository(args.root, copy)
        check_copy_is_imported(copy)
        if not args.no_baseline:
            for selection in dict.fromkeys(tuple(m.tests) for m in mutations):
                outcome, seconds, detail = run_tests(copy, list(selection), args.timeout)
                print(f"baseline {outcome:8s} {shlex.join(selection)}  {seconds:.0f} s", flush=True)
                if outcome != "passed":
                    raise SystemExit(f"{shlex.join(selection)} fails without any mutation ({detail}); fix that first")
        results = []
        for mutation in mutations:
            path = os.path.join(copy, mutation.file)
            with open(path, encoding="utf-8") as handle:
                original = handle.read()
            mutated = locate(mutation, copy)
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(mutated)
            try:
                outcome, seconds, detail = run_tests(copy, mutation.tests, args.timeout)
            finally:
                with open(path, "w", encoding="utf-8") as handle:
                    handle.write(original)
            verdict = {"passed": "SURVIVED", "failed": "caught", "timeout": "caught (timeout)"}.get(outcome, "ERROR")
            results.append(dict(name=mutation.name, file=mutation.file, line=mutation.line, verdict=verdict,
                                seconds=round(seconds, 1), detail=detail, why=mutation.why))
            print(f"{verdict:16s} {mutation.name:40s} {mutation.file}:{mutation.line}  {seconds:6.0f} s  {detail}",
                  flush=True)

    caught = sum(r["verdict"].startswith("caught") for r in results)
    errors = [r["name"] for r in results if r["verdict"] == "ERROR"]
    print(f"score: caught {caught} / planted {len(results)}")
    for result in results:
        if result["verdict"] == "SURVIVED":
            print(f"survived: {result['name']} ({result['file']}:{result['line']}): {result['why']}")
    if args.report:
        with open(args.report, "w", encoding="utf-8") as handle:
            json.dump(dict(caught=caught, planted=len(results), results=results), handle, indent=1)
    if errors:
        print(f"could not run the tests of: {', '.join(errors)}", file=sys.stderr)
        return 2
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
