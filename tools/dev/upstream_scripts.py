"""Writes tests/functional/upstream_scripts/launches.json: for every `examples/**/*.sh` of the
upstream repositories at the commits pinned in SOURCES, the entry point it launches and the argument
vector it passes, as data (not the scripts' text): shell variables expanded with the script's own
defaults, model and batch sizes shrunk to tiny ones (the parallel layout kept), paths replaced.

    python tools/dev/upstream_scripts.py NVIDIA=NVIDIA_GIT_DIR ROCm=ROCM_GIT_DIR

Each script runs with bash in a scratch copy of its commit's tree (from the root, then from its own
folder if that launched nothing), with stand-ins first on
PATH: `torchrun`, `python`, `python3`, `deepspeed` record their command line and exit; `uv run`,
`nsys`, `srun` and `sbatch` run what they wrap; network and device tools (`pip`, `wget`, `curl`,
`git`, `nvidia-smi`, `rocm-smi`, `docker`, `huggingface-cli`) do nothing. A script that launches no
Python program (a config fragment, a helper, or one that stops first) is listed with the reason.
tests/unit/test_upstream_launches.py reads the file.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTPUT = os.path.join(ROOT, "tests", "functional", "upstream_scripts", "launches.json")
SOURCES = {  # repository -> commit
    "NVIDIA": "d98e8a64ddf34856e74b24714e3bedb2f5a39553",
    "ROCm": "2b855bafe238ab0949d49609131d2da87fb09000",
}
REPOSITORIES = {"NVIDIA": "NVIDIA/Megatron-LM", "ROCm": "ROCm/Megatron-LM"}
# Arguments some scripts need before they launch anything: {path or folder/: argv}
SCRIPT_ARGS = {"examples/gptoss/02_train.sh": ["--checkpoint-path", "{scratch}/ckpt"],
               "examples/post_training/modelopt/": ["meta-llama/Llama-3.2-1B-Instruct"]}
RECORDERS = ("torchrun", "python", "python3", "deepspeed")
QUIET = ("pip", "pip3", "wget", "curl", "git", "nvidia-smi", "rocm-smi", "docker", "huggingface-cli", "hf",
         "apt-get", "sudo", "conda")
STAND_IN = r"""#!/bin/bash
name=$(basename "$0")
case "$name" in
  torchrun|python|python3|deepspeed)
    n=$(ls "$LAUNCH_RECORDS" | wc -l); printf '%s\0' "$name" "$@" > "$LAUNCH_RECORDS/$(printf %04d "$n")"; exit 0;;
  uv) [ "$1" = run ] && shift && exec "$@"; exit 0;;
  nsys) shift; while [ $# -gt 0 ] && [[ "$1" == -* || "$1" == *=* ]]; do shift; [[ "$1" != -* ]] && shift; done
        exec "$@";;
  srun|sbatch|mpirun) while [ $# -gt 0 ]; do
          case "$(basename "$1")" in
            *.sh) exec bash "$@";;
            bash|sh|torchrun|python|python3|deepspeed|uv|nsys) exec "$@";;
          esac; shift; done; exit 0;;
  *) exit 0;;
esac
"""
PATH_FLAGS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--save", "--load",
              "--tensorboard-dir", "--vocab-file", "--merge-file", "--tokenizer-model", "--data-cache-path",
              "--wandb-save-dir", "--data-args-path", "--per-split-data-args-path", "--tp-comm-overlap-cfg",
              "--pretrained-checkpoint", "--finetune-data-path", "--export-dir", "--output-path",
              "--memory-snapshot-path", "--ckpt-convert-save", "--nsys-profile-path", "--exit-signal-handler-file")


def _script_args(path: str, scratch: str) -> list:
    argv = SCRIPT_ARGS.get(path) or next((a for key, a in SCRIPT_ARGS.items() if key.endswith("/")
                                          and path.startswith(key) and "/conf/" not in path), [])
    return [a.format(scratch=scratch) for a in argv]


def _run(path: str, scratch: str) -> tuple:
    """(the recorded command lines, the script's last output line) of one script run: from the
    repository's root, then, if that launched nothing, from the script's own folder."""
    for cwd in (os.path.join(scratch, "tree"), os.path.join(scratch, "tree", os.path.dirname(path))):
        launches, last_line = _run_in(path, scratch, cwd)
        if launches:
            break
    return launches, last_line


def _run_in(path: str, scratch: str, cwd: str) -> tuple:
    records = os.path.join(scratch, "records")
    shutil.rmtree(records, ignore_errors=True)
    os.makedirs(records)
    os.makedirs(os.path.join(scratch, "ckpt"), exist_ok=True)
    env = dict(PATH=os.path.join(scratch, "bin") + os.pathsep + "/usr/bin:/bin", HOME=scratch,
               LAUNCH_RECORDS=records, TMPDIR=scratch)
    result = subprocess.run(["bash", os.path.join(scratch, "tree", path), *_script_args(path, scratch)], cwd=cwd,
                            env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    launches = []
    for name in sorted(os.listdir(records)):
        with open(os.path.join(records, name), "rb") as handle:
            launches.append(handle.read().decode().split("\0")[:-1])
    output = (result.stdout + result.stderr).replace(os.path.join(scratch, "tree") + "/", "").replace(
        scratch, "SCRATCH").strip().splitlines()
    return launches, output[-1] if output else f"exit status {result.returncode}"


def _program(launch: list) -> tuple:
    """(the Python program, its arguments, torchrun's world size) of a recorded command line."""
    launcher, args = launch[0], launch[1:]
    world, nodes, i = 1, 1, 0
    while i < len(args) and (args[i].startswith("-") or launcher == "torchrun" and "=" in args[i]):
        option = args[i].split("=", 1)
        value = option[1] if len(option) == 2 else (args[i + 1] if i + 1 < len(args) else "")
        if option[0] in ("--nproc_per_node", "--nproc-per-node") and value.isdigit():
            world = int(value)
        if option[0] == "--nnodes" and value.isdigit():
            nodes = int(value)
        if option[0] == "-m" and value in ("torch.distributed.run", "torch.distributed.launch"):
            return _program(["torchrun"] + args[i + 2:])
        if option[0] in ("-m", "-c"):
            return (option[0] + " " + value, args[i + 2:], world * nodes)
        i += 1 if len(option) == 2 or launcher != "torchrun" and option[0] in ("-u", "-O", "-B") else 2
    if i >= len(args):
        return None, [], world * nodes
    return args[i], args[i + 1:], world * nodes


def _options(args: list) -> list:
    """[[flag, value, ...], ...] of an argument vector (words before the first flag dropped)."""
    options = []
    for word in args:
        if word.startswith("--"):
            name, equals, value = word.partition("=")
            options.append([name] + ([value] if equals else []))
        elif options:
            options[-1].append(word)
    return options


def _get(options: list, flag: str, default=None):
    for option in options:
        if option[0] == flag and len(option) > 1:
            return option[1]
    return default


def _int(options: list, flag: str, default: int) -> int:
    value = _get(options, flag)
    return int(value) if value is not None and value.lstrip("-").isdigit() else default


def shrink(args: list) -> tuple:
    """(argument vector with tiny sizes and placeholder paths, world size that fits its layout)."""
    options = _options(args)
    tp, pp, cp = (_int(options, f, 1) for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                               "--context-parallel-size"))
    ep = _int(options, "--expert-model-parallel-size", 1)
    etp = _int(options, "--expert-tensor-parallel-size", tp)
    dp = next(d for d in range(1, 1 + ep * etp) if (tp * cp * d) % (ep * etp) == 0)
    virtual = _int(options, "--num-virtual-stages-per-pipeline-rank", 2 if _get(
        options, "--num-layers-per-virtual-pipeline-stage") else 1)
    groups = _int(options, "--moe-router-num-groups", 1)
    experts = 2 * ep * groups
    heads = 4 * tp
    sizes = {
        "--num-layers": 2 * pp * virtual, "--num-layers-per-virtual-pipeline-stage": 1,
        "--decoder-first-pipeline-num-layers": 2 * virtual, "--decoder-last-pipeline-num-layers": 2 * virtual,
        "--hidden-size": 16 * heads, "--ffn-hidden-size": 32 * heads, "--num-attention-heads": heads,
        "--num-query-groups": tp, "--kv-channels": 16, "--seq-length": 32, "--max-position-embeddings": 32,
        "--decoder-seq-length": 32, "--encoder-seq-length": 32, "--micro-batch-size": 1,
        "--global-batch-size": 2 * dp, "--train-iters": 2, "--train-samples": 4 * dp, "--lr-decay-iters": 2,
        "--lr-warmup-iters": 1, "--lr-decay-samples": 4 * dp, "--lr-warmup-samples": 2 * dp,
        "--lr-wsd-decay-iters": 1, "--lr-wsd-decay-samples": 2 * dp, "--num-experts": experts,
        "--moe-router-topk": min(_int(options, "--moe-router-topk", 2), experts),
        "--moe-router-group-topk": min(_int(options, "--moe-router-group-topk", 1), groups),
        "--moe-ffn-hidden-size": 16 * etp, "--moe-shared-expert-intermediate-size": 16 * etp,
        "--vocab-size": 128, "--profile-step-start": 0, "--profile-step-end": 1, "--exit-interval": 2,
    }
    for option in options:
        flag = option[0]
        if flag in sizes and len(option) > 1:
            option[1:] = [str(sizes[flag])]
        elif flag == "--rampup-batch-size" and len(option) > 1:
            option[1:] = [str(dp), str(dp), str(4 * dp)]
        elif flag == "--moe-layer-freq" and len(option) > 1 and "[" in option[1]:
            option[1:] = ["1"]
        elif flag in PATH_FLAGS:  # a path the script took from an empty positional argument has no word left
            option[1:] = [f"PATH{i}" for i in range(1, max(2, len(option)))]
    return [word for option in options for word in option], tp * pp * cp * dp


def describe(repository: str, commit: str, path: str, launches: list, last_line: str) -> dict:
    entry = {"repository": REPOSITORIES[repository], "commit": commit, "path": path}
    programs = [_program(launch) for launch in launches]
    programs = [p for p in programs if p[0] is not None]  # a program file first, then `python -c/-m`
    for program, args, world in sorted(programs, key=lambda p: p[0].startswith("-")):
        entry["entry_point"] = program if program.startswith("-") else os.path.basename(program)
        if entry["entry_point"] == "pretrain_gpt.py":
            entry["argv"], entry["world_size"] = shrink(args)
            entry["script_world_size"] = world
        else:
            entry["why"] = f"launches {entry['entry_point']}, not pretrain_gpt.py: out of scope here"
        return entry
    entry["entry_point"] = None
    entry["why"] = f"launches no Python program (its last output: {last_line[:160]!r})"
    return entry


def read_repository(name: str, git_dir: str) -> list:
    commit = SOURCES[name]
    listing = subprocess.run(["git", "--git-dir", git_dir, "ls-tree", "-r", "--name-only", commit, "examples"],
                             check=True, capture_output=True, text=True).stdout.split()
    entries = []
    with tempfile.TemporaryDirectory() as scratch:
        archive = subprocess.run(["git", "--git-dir", git_dir, "archive", commit], check=True,
                                 capture_output=True).stdout
        os.makedirs(os.path.join(scratch, "tree"))
        subprocess.run(["tar", "-x", "-C", os.path.join(scratch, "tree")], input=archive, check=True)
        os.makedirs(os.path.join(scratch, "bin"))
        for tool in RECORDERS + QUIET + ("uv", "nsys", "srun", "sbatch", "mpirun"):
            with open(os.path.join(scratch, "bin", tool), "w") as handle:
                handle.write(STAND_IN)
            os.chmod(os.path.join(scratch, "bin", tool), 0o755)
        for path in sorted(p for p in listing if p.endswith(".sh")):
            try:
                launches, last_line = _run(path, scratch)
            except subprocess.TimeoutExpired:
                launches, last_line = [], "did not finish in 60 s"
            entries.append(describe(name, commit, path, launches, last_line))
    return entries


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("git_dirs", nargs="+", metavar="NAME=GIT_DIR", help=f"one per source: {', '.join(SOURCES)}")
    args = parser.parse_args(argv)
    dirs = dict(item.split("=", 1) for item in args.git_dirs)
    missing = [name for name in SOURCES if name not in dirs]
    if missing:
        parser.error(f"give the git directory of {', '.join(missing)}")
    entries = [entry for name in SOURCES for entry in read_repository(name, dirs[name])]
    with open(OUTPUT, "w") as handle:  # one script per line, so that a regeneration diffs by script
        handle.write('{\n "generated_by": "python tools/dev/upstream_scripts.py '
                     + " ".join(f"{n}=GIT_DIR" for n in SOURCES) + '",\n "scripts": [\n')
        handle.write(",\n".join(json.dumps(entry) for entry in entries))
        handle.write("\n ]\n}\n")
    launched = sum(1 for e in entries if e["entry_point"] == "pretrain_gpt.py")
    print(f"wrote {OUTPUT}: {len(entries)} scripts, {launched} launch pretrain_gpt.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
