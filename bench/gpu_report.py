"""Writes the Markdown report of bench/gpu_check.sh from its working directory (logs and JSONs)."""
import argparse
import datetime
import json
import platform
import re
import subprocess
from pathlib import Path


def _versions() -> list:
    import torch

    lines = [f"- Python {platform.python_version()}, PyTorch {torch.__version__}, CUDA {torch.version.cuda}"]
    try:
        import triton

        lines.append(f"- Triton {triton.__version__}")
    except ImportError:
        lines.append("- Triton not installed (fusions run eagerly)")
    if torch.cuda.is_available():
        lines.insert(0, f"- Device: {torch.cuda.get_device_name()} "
                        f"({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)")
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30).stdout.strip()
            lines.append(f"- Driver {driver}")
        except (OSError, subprocess.SubprocessError):
            pass
    else:
        lines.insert(0, "- Device: CPU (dry run: no figure here is a GPU measurement)")
    return lines


def _lane(work: Path) -> list:
    log = work / "lane.log"
    text = log.read_text() if log.exists() else "(no output)"
    lines = text.splitlines()
    summary = [line for line in lines if line.startswith(("PASSED", "FAILED", "ERROR", "SKIPPED"))]
    if not summary:  # cut short before pytest's summary: the outcomes -v printed as each test ended
        summary = [line for line in lines if re.search(r"::\S+ (PASSED|FAILED|ERROR|SKIPPED)", line)]
    tail = text.strip().splitlines()[-1:] if text.strip() else ["(no output)"]
    return ["```", *(summary or []), *tail, "```"]


def planner_preset(device_name: str) -> str:
    """The planner's GPU preset (megatron/training/planning/hardware.py) for a device's name."""
    name = device_name.upper()
    for marker, preset in (("H200", "h200"), ("A100", "a100-80gb"), ("MI300", "mi300x")):
        if marker in name:
            return preset
    return "h100-80gb"


def planned_run(preset: str, flags: str, gpu: str = "h100-80gb"):
    """The planner's prediction (tools/plan.py) for one bench_pretrain.py run on one GPU of `gpu`."""
    from bench_pretrain import preset_flags
    from megatron.training.arguments import parse_args
    from megatron.training.planning.hardware import cluster
    from megatron.training.planning.plan import plan_for_flags

    config = parse_args(preset_flags(preset, flags.split()))
    return plan_for_flags(config, config.data.vocab_size, 1, cluster(gpu, nodes=1, gpus_per_node=1))


def _beside_plan(f: dict, preset: str, flags: str) -> str:
    """The plan's step time and MFU, and how far the measurement is from it (docs/planning.md: 15%)."""
    plan = planned_run(preset, flags, planner_preset(f.get("device", "")))
    ratio = f["step_ms"] / (plan.time.seconds * 1e3)
    flag = "" if abs(ratio - 1) <= 0.15 else " (off by more than 15%)"
    return f"{plan.time.seconds * 1e3:.1f} ms, {100 * plan.time.mfu:.1f}% | {ratio:.2f}{flag}"


def _run_lines(work: Path) -> list:
    """(index, name, preset, flags, status) of each run in runs.txt. gpu_check.sh writes the run's
    number in the plan first (its files are run<index>.*; runs skipped for time or by GPU_CHECK_ONLY
    leave gaps); a line without it is numbered by its position."""
    lines = (work / "runs.txt").read_text().splitlines() if (work / "runs.txt").exists() else []
    runs = []
    for position, line in enumerate(lines, start=1):
        fields = line.split("|")
        index = int(fields.pop(0)) if len(fields) == 5 else position
        runs.append((index, *fields))
    return runs


def _runs(work: Path) -> list:
    rows = ["| run | preset | step (ms) | TFLOP/s/GPU | MFU (BF16 peak) | MFU (FP8 peak) | tokens/s/GPU | "
            "peak memory (GB) | attention | plan: step, MFU | measured / planned step |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    failures = []
    for index, name, preset, flags, status in _run_lines(work):
        figures_file = work / f"run{index}.json"
        if status != "0" or not figures_file.exists():
            log = (work / f"run{index}.log").read_text().strip().splitlines()[-15:]
            failures += [f"**{name} {preset}** (`{flags}`) exit status {status}:", "```", *log, "```"]
            rows.append(f"| {name} | {preset} | failed | | | | | | | | |")
            continue
        f = json.loads(figures_file.read_text())
        rows.append(f"| {name} | {preset} | {f['step_ms']:.1f} | {f['tflops_per_gpu']:.1f} | "
                    f"{f['mfu_bf16_peak']:.1f}% | {f['mfu_fp8_peak']:.1f}% | {f['tokens_per_gpu']:.0f} | "
                    f"{f['peak_memory_gb']:.2f} | {f['attention'].removeprefix('attention: ')} | "
                    f"{_beside_plan(f, preset, flags)} |")
    return rows + ([""] + failures if failures else [])


def _against_bf16(work: Path) -> list:
    """Each run with flags against the same preset's plain bf16 run (no flags), when both finished:
    the A/Bs (a weight-gradient path, FP8) as speed-ups, the plain step over the run's."""
    finished = {}
    for index, name, preset, flags, status in _run_lines(work):
        figures_file = work / f"run{index}.json"
        if status == "0" and figures_file.exists():
            finished[(name, preset, flags)] = json.loads(figures_file.read_text())["step_ms"]
    plain = {preset: step for (_, preset, flags), step in finished.items() if not flags}
    rows = ["| run | preset | flags | step (ms) | plain bf16 step (ms) | speed-up |", "|---|---|---|---|---|---|"]
    for (name, preset, flags), step in finished.items():
        if flags and preset in plain:
            rows.append(f"| {name} | {preset} | `{flags}` | {step:.1f} | {plain[preset]:.1f} | "
                        f"{plain[preset] / step:.2f}x |")
    return rows if len(rows) > 2 else ["(no run with flags finished beside its preset's plain bf16 run)"]


def _fast_paths(work: Path) -> list:
    """Each run's start-up line naming the implementation of every speed-critical path."""
    lines = []
    for index, name, preset, _, _ in _run_lines(work):
        figures_file = work / f"run{index}.json"
        if figures_file.exists():
            lines.append(f"- {name} {preset}: {json.loads(figures_file.read_text()).get('fast_paths', '(not recorded)')}")
    return lines or ["(no run finished)"]


def _profiles(work: Path) -> list:
    """The profiled step of each run that has one (the MoE presets): its CPU/GPU time and top kernels."""
    from bench_pretrain import profile_text

    lines = []
    for index, name, preset, _, _ in _run_lines(work):
        figures_file = work / f"run{index}.json"
        profile = json.loads(figures_file.read_text()).get("profile") if figures_file.exists() else None
        if profile:
            lines += [f"### {name} {preset}", "", profile_text(profile), ""]
    return lines or ["(no run was profiled)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--dry-run", default="0")
    args = parser.parse_args()
    work = Path(args.work)
    title = "GPU check" + (" (CPU dry run)" if args.dry_run == "1" else "")
    text = [f"# {title}, {datetime.date.today().isoformat()}", "", *_versions(), "",
            "Protocol: bench/bench_pretrain.py, seq 4096, 8 micro-batches per step, median of 8 steps after 3 "
            "warm-up steps; MFU against 989 (BF16) and 1979 (FP8) TFLOP/s dense.", "",
            "## GPU test lane (`pytest -m gpu`)", "", *_lane(work), "", "## Benchmarks", "", *_runs(work), "",
            "## Against the plain bf16 run of the same preset", "", *_against_bf16(work), "",
            "## Fast paths (the start-up line of each run)", "", *_fast_paths(work), "",
            "## Where the time goes (one more step of each MoE run under torch.profiler)", "", *_profiles(work),
            "## Steps", "", "```", *(work / "steps.log").read_text().splitlines(), "```", ""]
    Path(args.report).write_text("\n".join(text))


if __name__ == "__main__":
    main()
