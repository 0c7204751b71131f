"""Writes tests/functional/upstream_scripts/launches.json: for every `examples/**/*.sh` of the
upstream repositories at the commits pinned in SOURCES, the entry point it launches and the argument
vector it passes, as data (not the scripts' text): shell variables expanded with the script's own
defaults, model and batch sizes shrunk to tiny ones (the parallel layout kept), paths replaced.

    python tools/dev/upstream_scripts.py NVIDIA=NVIDIA_GIT_DIR ROCm=ROCM_GIT_DIR ROCm-index=SCRIPTS_DIR

The ROCm fork's newer scripts (ROCM_INDEX below: each path at the commit where the public code index
holds it) are no commit of one git directory: SCRIPTS_DIR holds each saved at its commit under its
path (`curl -o SCRIPTS_DIR/PATH --create-dirs https://raw.githubusercontent.com/ROCm/Megatron-LM/COMMIT/PATH`;
keep it out of the repository). A listed script missing there is listed as not read. They run in a copy
of SCRIPTS_DIR, where an empty stand-in takes the place of each repository-root file that some of them
check for before launching it (ROOT_FILES: the fork's pretrain_gpt.py).

Each script runs with bash in a scratch copy of its commit's tree (from the root, then from its own
folder if that launched nothing), with stand-ins first on
PATH: `torchrun`, `python`, `python3`, `deepspeed` record their command line and exit; `uv run`,
`nsys`, `srun` and `sbatch` run what they wrap; network and device tools (`pip`, `wget`, `curl`,
`git`, `nvidia-smi`, `rocm-smi`, `huggingface-cli`) do nothing, and so do the container tools
(`docker`, `podman`), which note a `run` or `exec`: a script that starts its training in a container
is listed as such. A script that launches no Python program (a config fragment, a helper, or one
that stops first) is listed with the reason.
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
REPOSITORIES = {"NVIDIA": "NVIDIA/Megatron-LM", "ROCm": "ROCm/Megatron-LM", "ROCm-index": "ROCm/Megatron-LM"}
# The ROCm fork's examples/**/*.sh in the public code index: {path: commit}
ROCM_INDEX = {
    "examples/deepseek_v2/train_deepseekv2.sh": "02b8aa76d2fc0f99e0077ee932b771397db9c415",
    "examples/deepseek_v3/proxy_mi355x_deepseekv3_671B.sh": "6f6bfd4984b226b5485b1e4df97f0f9b943275fb",
    "examples/deepseek_v3/run_deepseekv3_compare_perf.sh": "d43e55980704db0bd3c59f5eb3350f271c5b43bd",
    "examples/deepseek_v3/run_deepseekv3_single_gpu_test.sh": "a8c52909611420d35413b4fde2f3ee2210dde7b5",
    "examples/deepseek_v3/train_deepseek_v3_slurm.sh": "8a0515597c087df3e6595b08b724435dd4e809ac",
    "examples/deepseek_v3/train_deepseekv3.sh": "430335a6f0426c98342bef35cafb0baef9922f30",
    "examples/deepseek_v4/train_deepseekv4_smoke.sh": "f877c8d1b2b15b34d88b1081853a9be38c5e0d3d",
    **{f"examples/export/ptq_and_trtllm_export/ptq_trtllm_{name}.sh": "7a6a17ecf38d60ea7c8b3ebf3813373a3f634ad9"
       for name in ("llama2_7b", "llama3_1_8b", "llama3_8b", "minitron_8b", "mistral_12b", "mixtral_8x7b")},
    **{f"examples/kosmos/{name}.sh": "ee637485800da92e9b0227986842afd2aab407c5" for name in (
        "config", "deps/numa_bind", "lib/common", "run_all", "steps/a2a", "steps/micro", "steps/scale", "steps/setup",
        "tools/deepep", "tools/gen_scripts", "tools/megamoe_shim", "tools/moe_run", "tools/routing_stats")},
    **{f"examples/kosmos/{name}.sh": "bc4a530dc60843414ff9b4809c028cadfbcac894" for name in (
        "steps/collect", "steps/manual", "steps/tpsp", "tools/llama_run", "tools/primus_run")},
    "examples/llama/run_pretrain_llama2_7b_native.sh": "5d7cd29f169b87d0e82f3a9d0b7323a8d57e96fb",
    "examples/llama/train_llama2.sh": "bb3bcb6512c1cf225c3f00050bbd03fdd027811e",
    "examples/llama/train_llama2_slurm.sh": "488cccffc77db3364928af05e88b8a5fec8327dc",
    "examples/llama/train_llama3.sh": "32d5d428a90abab0583999bdbc85bd653332ce26",
    "examples/llama/train_llama3_8b_h100_fp8.sh": "eeef074a5a583fd5086f974d60c629b1edb819cd",
    "examples/llama/train_llama_slurm.sh": "f9b53e2fe3118c1ef3c112877fc077d4e3dd5dfe",
    "examples/mixtral/train_mixtral_8x22B_slurm.sh": "2ae5e0ef250eb05ea770ccaecd828779cafc97e6",
    "examples/mixtral/train_mixtral_8x7B_slurm.sh": "890bd39ed285980558178918fdbcd83e699b1328",
    "examples/mixtral/train_mixtral_8x7b_distributed.sh": "4835f41922812ce064a38ba29f9a89f491cc2c2d",
    "examples/mixtral/train_mixtral_moe.sh": "bedee295cb191bd6fa7df0d1b1c47faff20eeac8",
    "examples/qwen/train_qwen.sh": "18d9910cd06d774ca41ad3321aa47b753fb390ea",
    "examples/qwen/train_qwen2.sh": "addbda20af0f9aaaadee5c237c62cd6116ffda75",
    "examples/qwen/train_qwen_moe.sh": "bc13dffac7ff5b9740cd61501548129f1c69b48c",
    "examples/qwen/train_qwen_slurm.sh": "18d9910cd06d774ca41ad3321aa47b753fb390ea",
    "examples/qwen2/train_qwen2.sh": "5d7cd29f169b87d0e82f3a9d0b7323a8d57e96fb",
    "examples/qwen3/1P1G_AAI_proxy_mi355x_qwen3_235B_A22B.sh": "28603d50c23175ed209fc8b9bd567346b76bb412",
    "examples/qwen3/proxy_mi355x_qwen3_235B_A22B.sh": "2f2806ab85f6a3dbf2ce2bf40fe95345528d79df",
    "examples/qwen3/run_qwen3_perf_compare.sh": "d43e55980704db0bd3c59f5eb3350f271c5b43bd",
    "examples/qwen3/run_qwen3_single_gpu_test.sh": "a8c52909611420d35413b4fde2f3ee2210dde7b5",
    "examples/qwen3/train_qwen3.sh": "d026b78209a090d77755ea4cbc1898f5bb5596db",
}
# Files of the fork's repository root that saved scripts test for (`[ -f pretrain_gpt.py ]`) before launching
ROOT_FILES = ("pretrain_gpt.py",)
# Arguments some scripts need before they launch anything: {path or folder/: argv}
SCRIPT_ARGS = {"examples/gptoss/02_train.sh": ["--checkpoint-path", "{scratch}/ckpt"],
               "examples/post_training/modelopt/": ["meta-llama/Llama-3.2-1B-Instruct"]}
RECORDERS = ("torchrun", "python", "python3", "deepspeed")
QUIET = ("pip", "pip3", "wget", "curl", "git", "nvidia-smi", "rocm-smi", "huggingface-cli", "hf",
         "apt-get", "sudo", "conda")
STAND_IN = r"""#!/bin/bash
name=$(basename "$0")
case "$name" in
  torchrun|python|python3|deepspeed)
    [ "$1" = -c ] && [[ "$2" == *device_count* ]] && echo 8  # a probe for the GPUs per node
    n=$(ls "$LAUNCH_RECORDS" | wc -l); printf '%s\0' "$name" "$@" > "$LAUNCH_RECORDS/$(printf %04d "$n")"; exit 0;;
  uv) [ "$1" = run ] && shift && exec "$@"; exit 0;;
  docker|podman) case "$1" in run|exec) echo "$name $1" >> "$CONTAINER_RECORDS";; esac; exit 0;;
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
    """(the recorded command lines, the script's last output line, the container commands it ran,
    e.g. "docker exec") of one script run: from the repository's root, then, if that launched
    nothing, from the script's own folder."""
    for cwd in (os.path.join(scratch, "tree"), os.path.join(scratch, "tree", os.path.dirname(path))):
        launches, last_line, containers = _run_in(path, scratch, cwd)
        if launches:
            break
    return launches, last_line, containers


def _run_in(path: str, scratch: str, cwd: str) -> tuple:
    records, containers = os.path.join(scratch, "records"), os.path.join(scratch, "containers")
    shutil.rmtree(records, ignore_errors=True)
    os.makedirs(records)
    if os.path.exists(containers):
        os.remove(containers)
    os.makedirs(os.path.join(scratch, "ckpt"), exist_ok=True)
    env = dict(PATH=os.path.join(scratch, "bin") + os.pathsep + "/usr/bin:/bin", HOME=scratch,
               LAUNCH_RECORDS=records, CONTAINER_RECORDS=containers, TMPDIR=scratch)
    result = subprocess.run(["bash", os.path.join(scratch, "tree", path), *_script_args(path, scratch)], cwd=cwd,
                            env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    launches = []
    for name in sorted(os.listdir(records)):
        with open(os.path.join(records, name), "rb") as handle:
            launches.append(handle.read().decode().split("\0")[:-1])
    output = (result.stdout + result.stderr).replace(os.path.join(scratch, "tree") + "/", "").replace(
        scratch, "SCRATCH").strip().splitlines()
    ran = []
    if os.path.exists(containers):
        with open(containers) as handle:
            ran = list(dict.fromkeys(handle.read().split("\n")[:-1]))
    return launches, output[-1] if output else f"exit status {result.returncode}", ran


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


def describe(repository: str, commit: str, path: str, launches: list, last_line: str, containers: list = ()) -> dict:
    entry = {"source": repository, "repository": REPOSITORIES[repository], "commit": commit, "path": path}
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
    if containers:  # e.g. `docker exec NAME bash -c "... bash examples/llama/train_llama2.sh"`
        entry["why"] = (f"launches no Python program here: it starts its training in a container "
                        f"({', '.join(containers)}), which is not run")
    else:
        entry["why"] = f"launches no Python program (its last output: {last_line[:160]!r})"
    return entry


def _stand_ins(scratch: str) -> None:
    os.makedirs(os.path.join(scratch, "bin"))
    for tool in RECORDERS + QUIET + ("uv", "nsys", "srun", "sbatch", "mpirun", "docker", "podman"):
        with open(os.path.join(scratch, "bin", tool), "w") as handle:
            handle.write(STAND_IN)
        os.chmod(os.path.join(scratch, "bin", tool), 0o755)


def _describe_all(name: str, scripts: dict, scratch: str) -> list:
    """describe() of each {path: commit} run in the scratch tree."""
    entries = []
    for path, commit in sorted(scripts.items()):
        try:
            launches, last_line, containers = _run(path, scratch)
        except subprocess.TimeoutExpired:
            launches, last_line, containers = [], "did not finish in 60 s", []
        entries.append(describe(name, commit, path, launches, last_line, containers))
    return entries


def read_repository(name: str, git_dir: str) -> list:
    commit = SOURCES[name]
    listing = subprocess.run(["git", "--git-dir", git_dir, "ls-tree", "-r", "--name-only", commit, "examples"],
                             check=True, capture_output=True, text=True).stdout.split()
    with tempfile.TemporaryDirectory() as scratch:
        archive = subprocess.run(["git", "--git-dir", git_dir, "archive", commit], check=True,
                                 capture_output=True).stdout
        os.makedirs(os.path.join(scratch, "tree"))
        subprocess.run(["tar", "-x", "-C", os.path.join(scratch, "tree")], input=archive, check=True)
        _stand_ins(scratch)
        return _describe_all(name, {p: commit for p in listing if p.endswith(".sh")}, scratch)


def read_saved(name: str, directory: str) -> list:
    """The ROCM_INDEX scripts saved under `directory`; those not saved there are listed as not read."""
    saved = {p: c for p, c in ROCM_INDEX.items() if os.path.isfile(os.path.join(directory, p))}
    with tempfile.TemporaryDirectory() as scratch:
        shutil.copytree(directory, os.path.join(scratch, "tree"))
        for root_file in ROOT_FILES:
            open(os.path.join(scratch, "tree", root_file), "a").close()
        _stand_ins(scratch)
        entries = _describe_all(name, saved, scratch)
    entries += [{"source": name, "repository": REPOSITORIES[name], "commit": c, "path": p, "entry_point": None,
                 "why": "not read: not saved from the public code index for this regeneration"}
                for p, c in ROCM_INDEX.items() if p not in saved]
    return sorted(entries, key=lambda e: e["path"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("git_dirs", nargs="+", metavar="NAME=DIR",
                        help=f"one per source: {', '.join(SOURCES)} (git directories), ROCm-index (saved scripts)")
    args = parser.parse_args(argv)
    dirs = dict(item.split("=", 1) for item in args.git_dirs)
    missing = [name for name in list(SOURCES) + ["ROCm-index"] if name not in dirs]
    if missing:
        parser.error(f"give the git directory of {', '.join(missing)} (ROCm-index: the folder of saved scripts)")
    entries = [entry for name in SOURCES for entry in read_repository(name, dirs[name])]
    entries += read_saved("ROCm-index", dirs["ROCm-index"])
    with open(OUTPUT, "w") as handle:  # one script per line, so that a regeneration diffs by script
        handle.write('{\n "generated_by": "python tools/dev/upstream_scripts.py '
                     + " ".join(f"{n}=GIT_DIR" for n in SOURCES) + ' ROCm-index=SCRIPTS_DIR",\n "scripts": [\n')
        handle.write(",\n".join(json.dumps(entry) for entry in entries))
        handle.write("\n ]\n}\n")
    launched = sum(1 for e in entries if e["entry_point"] == "pretrain_gpt.py")
    print(f"wrote {OUTPUT}: {len(entries)} scripts, {launched} launch pretrain_gpt.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
