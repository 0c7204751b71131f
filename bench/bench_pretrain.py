"""Single-GPU training throughput for the presets of docs/performance.md: TFLOP/s/GPU, MFU, tokens/s, memory.

    python bench/bench_pretrain.py --preset llama3-8b-8layers          # bf16, seq 4096, 8 micro-batches
    python bench/bench_pretrain.py --preset llama3.2-1b
    python bench/bench_pretrain.py --preset mixtral-8x7b-2layers       # MoE (qwen3-30b-a3b-4layers, deepseek-v3-4layers)
    python bench/bench_pretrain.py --preset qwen3-30b-a3b-4layers --profile   # then one step under torch.profiler
    python bench/bench_pretrain.py --preset tiny --device cpu          # smoke run of this script on CPU (also tiny-moe)
    python bench/bench_pretrain.py --preset llama3.2-1b -- --recompute-granularity full ...  (extra flags)
    python bench/bench_pretrain.py --preset llama3-8b-8layers -- --fp8-format hybrid --fp8-recipe delayed
    python bench/bench_pretrain.py --preset tiny --device cpu --json out.json   # figures also as JSON

Protocol (docs/performance.md): the median of --steps optimizer steps after --warmup steps, each
timed with a device synchronize; FLOPs by Megatron's formula (for a mixture of experts, the active
parameters: top-k experts per token); MFU against the dense BF16 peak. With --profile one more step
runs under torch.profiler (after the timed ones, so it does not change them) and the run prints its
top operators and kernels by device time and the step's CPU-time / GPU-time ratio (above 1: the
host is the bottleneck), also written to the JSON.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron.core import utils  # noqa: E402
from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.data import build_loader  # noqa: E402
from megatron.training.reporting.logging import flops_per_iteration  # noqa: E402
from megatron.training.training import setup, train_step  # noqa: E402
from megatron.core.datasets.mock_dataset import MockGPTDataset  # noqa: E402
from pretrain_gpt import forward_step  # noqa: E402

COMMON = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
          "--group-query-attention", "--num-query-groups", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--lr", "1e-4", "--mock-data", "--num-workers", "1", "--log-interval", "1000000", "--eval-iters", "0"]
MOE = ["--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
       "--moe-aux-loss-coeff", "1e-2", "--moe-router-force-load-balancing"]
PRESETS = {
    "llama3.2-1b": ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "32",
                    "--ffn-hidden-size", "8192", "--vocab-size", "128256", "--micro-batch-size", "2",
                    "--rotary-base", "500000", "--seq-length", "4096", "--bf16"],
    "llama3-8b-8layers": ["--num-layers", "8", "--hidden-size", "4096", "--num-attention-heads", "32",
                          "--ffn-hidden-size", "14336", "--vocab-size", "128256", "--micro-batch-size", "1",
                          "--untie-embeddings-and-output-weights", "--rotary-base", "500000",
                          "--seq-length", "4096", "--bf16"],
    # A few mixture-of-experts layers of Mixtral 8x7B and Qwen3-30B-A3B at full width, EP1, sized for
    # one 80 GB GPU (bench/cost_model.py predicts them); tokens spread evenly over the experts.
    "mixtral-8x7b-2layers": ["--num-layers", "2", "--hidden-size", "4096", "--num-attention-heads", "32",
                             "--ffn-hidden-size", "14336", "--num-experts", "8", "--moe-ffn-hidden-size", "14336",
                             "--moe-router-topk", "2", "--vocab-size", "32000", "--micro-batch-size", "1",
                             "--rotary-base", "1000000", "--untie-embeddings-and-output-weights",
                             "--seq-length", "4096", "--bf16", *MOE],
    "qwen3-30b-a3b-4layers": ["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "32",
                              "--kv-channels", "128", "--num-query-groups", "4", "--qk-layernorm",
                              "--ffn-hidden-size", "6144", "--num-experts", "128", "--moe-ffn-hidden-size", "768",
                              "--moe-router-topk", "8", "--vocab-size", "151936", "--micro-batch-size", "1",
                              "--rotary-base", "1000000", "--untie-embeddings-and-output-weights",
                              "--seq-length", "4096", "--bf16", *MOE],
    # DeepSeek-V3's routing at a width one 80 GB GPU holds: 256 routed experts, top-8 in 4 of 8 groups,
    # sigmoid scores with the expert bias and a scaling of 2.5, one shared expert, the sequence-level
    # balancing loss. (Full width, h 7168 and experts of 2048, is 11 B parameters per layer: EP only.)
    "deepseek-v3-4layers": ["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "16",
                            "--kv-channels", "128", "--ffn-hidden-size", "7168", "--num-experts", "256",
                            "--moe-ffn-hidden-size", "448", "--moe-shared-expert-intermediate-size", "448",
                            "--moe-router-topk", "8", "--moe-router-num-groups", "8", "--moe-router-group-topk", "4",
                            "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                            "--moe-router-topk-scaling-factor", "2.5", "--vocab-size", "129280",
                            "--micro-batch-size", "1", "--rotary-base", "10000",
                            "--untie-embeddings-and-output-weights", "--seq-length", "4096", "--bf16", *MOE,
                            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4"],
    "tiny": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--ffn-hidden-size", "128",
             "--vocab-size", "256", "--micro-batch-size", "2", "--seq-length", "64"],
}
PRESETS["tiny-moe"] = PRESETS["tiny"] + ["--num-experts", "4", "--moe-ffn-hidden-size", "64", "--moe-router-topk", "2",
                                         *MOE]
PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}  # H100/H200 SXM dense


def preset_flags(preset: str, extra: list, micro_batches: int = 8, iterations: int = 11, device: str = "cuda") -> list:
    """The pretrain_gpt.py flags of a benchmark run (bench/gpu_report.py plans the same run)."""
    flags = COMMON + PRESETS[preset] + list(extra)  # a preset may override the common Llama settings
    micro = int(flags[flags.index("--micro-batch-size") + 1])
    seq = int(flags[flags.index("--seq-length") + 1])
    return flags + ["--global-batch-size", str(micro * micro_batches), "--train-iters", str(iterations),
                    "--max-position-embeddings", str(seq), "--distributed-backend", "nccl" if device == "cuda" else "gloo"]


def profile_step(run, iterators, device, top: int = 15) -> dict:
    """One training step under torch.profiler: {"cpu_ms", "gpu_ms", "ratio", "top": [{name, cpu_ms,
    gpu_ms, calls}]}, the top entries by self device time (CPU time where there is no device)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        train_step(run, iterators)
        utils.synchronize(device)
    events = prof.key_averages()
    gpu_us = lambda e: getattr(e, "self_device_time_total", 0.0)  # noqa: E731
    cpu_total = sum(e.self_cpu_time_total for e in events) / 1e3
    gpu_total = sum(gpu_us(e) for e in events) / 1e3
    ranked = sorted(events, key=lambda e: (gpu_us(e), e.self_cpu_time_total), reverse=True)[:top]
    return {"cpu_ms": cpu_total, "gpu_ms": gpu_total, "ratio": cpu_total / gpu_total if gpu_total else None,
            "top": [{"name": e.key[:80], "cpu_ms": e.self_cpu_time_total / 1e3, "gpu_ms": gpu_us(e) / 1e3,
                     "calls": e.count} for e in ranked]}


def profile_text(profile: dict) -> str:
    """The profile as Markdown: the CPU/GPU line and the table of top kernels."""
    ratio = f"{profile['ratio']:.2f}" if profile["ratio"] is not None else "n/a (no device time)"
    lines = [f"profiled step: self CPU {profile['cpu_ms']:.1f} ms, self GPU {profile['gpu_ms']:.1f} ms, "
             f"CPU/GPU {ratio}", "", "| kernel or op | self CPU (ms) | self GPU (ms) | calls |", "|---|---|---|---|"]
    lines += [f"| {t['name']} | {t['cpu_ms']:.2f} | {t['gpu_ms']:.2f} | {t['calls']} |" for t in profile["top"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per optimizer step")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed steps, profile one more: top kernels and CPU/GPU time")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    total = args.warmup + args.steps + (1 if args.profile else 0)
    flags = preset_flags(args.preset, extra, args.micro_batches, total, args.device)
    micro = int(flags[flags.index("--micro-batch-size") + 1])
    seq = int(flags[flags.index("--seq-length") + 1])
    config = parse_args(flags)
    run = setup(config, forward_step, config.data.vocab_size)
    dataset = MockGPTDataset(total * run.batches.global_batch_size, seq, config.data.vocab_size, seed=1)
    iterators = [iter(build_loader(dataset, 0, micro, run.groups, config.data.num_workers))]
    device = run.groups.device
    times = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            utils.reset_peak_memory(device)
        utils.synchronize(device)
        start = time.perf_counter()
        train_step(run, iterators)
        utils.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    profile = profile_step(run, iterators, device) if args.profile else None
    seconds = statistics.median(times)
    flops = flops_per_iteration(run.model.config, run.batches.global_batch_size, seq)
    tflops = flops / seconds / 1e12 / run.groups.world_size
    tokens = run.batches.global_batch_size * seq / seconds / run.groups.world_size
    precision = "fp8" if "--fp8-format" in flags else "bf16"
    figures = {
        "preset": args.preset, "flags": " ".join(extra), "precision": precision,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "step_ms": seconds * 1000, "tflops_per_gpu": tflops, "tokens_per_gpu": tokens,
        "mfu_bf16_peak": 100 * tflops / PEAK_TFLOPS["bf16"], "mfu_fp8_peak": 100 * tflops / PEAK_TFLOPS["fp8"],
        "peak_memory_gb": utils.peak_memory_bytes(device) / 1e9, "attention": run.reports.attention_report,
        "fast_paths": run.reports.fast_paths, "profile": profile,
    }
    print(f"preset: {args.preset} | device: {figures['device']} | torch {torch.__version__} | {precision}")
    print(f"global batch: {run.batches.global_batch_size} x {seq} tokens ({args.micro_batches} micro-batches of {micro})")
    print(f"{run.reports.attention_report}")
    print(run.reports.fast_paths)
    print(f"median step time (ms): {seconds * 1000:.1f}  (min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f})")
    print(f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f}")
    if device.type == "cuda":
        print(f"MFU (of the dense BF16 peak {PEAK_TFLOPS['bf16']:.0f}): {figures['mfu_bf16_peak']:.1f}%")
        if precision == "fp8":
            print(f"MFU (of the dense FP8 peak {PEAK_TFLOPS['fp8']:.0f}): {figures['mfu_fp8_peak']:.1f}%")
    print(f"tokens per GPU (tokens/s/GPU): {tokens:.0f}")
    print(f"peak memory (GB): {figures['peak_memory_gb']:.2f}")
    if profile is not None:
        print(profile_text(profile))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
