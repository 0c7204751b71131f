"""The runs of bench/gpu_check.sh, in order, each with its predicted duration on one H100.

    python bench/gpu_plan.py [--tunableop] [--budget 570]           # the plan, for people (--dry-run)
    python bench/gpu_plan.py --lines [--tunableop] [--smoke]        # what gpu_check.sh reads (--smoke: tiny)

Order: the benchmarks first (bf16 on llama3-8b-8layers, the MoE presets, a few Mixtral 8x7B,
Qwen3-30B-A3B and DeepSeek-V3-routed layers, in bf16, Mixtral's again with
--moe-grouped-wgrad per-expert (the A/B of the experts' weight-gradient path), Qwen3-MoE's with the
compiled permutation and router, and Mixtral's in FP8 (hybrid tensorwise, with the gradient GEMMs grouped
and per expert, then e4m3: all three expert GEMMs FP8 grouped GEMMs), then with --tunableop the bf16 run with PyTorch TunableOp, with --dense-ab llama3.2-1b
in bf16, llama3-8b-8layers in FP8 delayed and the compile and gradient-accumulation-fusion
off-switches as A/Bs on llama3-8b-8layers), the GPU test lane last with what is left. A run's estimate = start-up (model,
data, NCCL) + compilation (cold for the first run, warm from inductor's cache after it) + its steps
at the step time bench/cost_model.py predicts; the MoE runs and the A/Bs take fewer steps (2
warm-up, 4 timed) so that all of it fits one 10-minute command. Each run costs about 45 s before its
first step, so the plan holds 9 runs: FP8 on llama3.2-1b, FP8 tensorwise on llama3-8b-8layers and
the --no-cross-entropy-loss-fusion A/B gave way to the MoE runs (run them by hand:
docs/performance.md), and llama3.2-1b in bf16, the 8B preset in FP8 and the dense off-switch A/Bs
(measured 2026-11-28; --dense-ab runs them) to the weight-gradient and FP8 A/Bs, leaving the GPU test lane about 2
minutes by the estimates (the MoE runs took 26-53 s each on an H200, which leaves it more). The estimates are predictions:
gpu_check.sh gives each run 1.5x its estimate (at least +30 s), and skips what no longer fits.
`--smoke` (gpu_check.sh's CPU dry run) runs each entry on the tiny preset, the MoE ones on tiny-moe.
"""
import argparse

START_UP, COLD_COMPILE, WARM_COMPILE, TUNING = 25, 60, 20, 60  # seconds (predicted)
LANE_MIN = 60
FP8_DELAYED = "--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max"
FP8_TENSORWISE = "--fp8-format hybrid --fp8-recipe tensorwise"
FP8_E4M3 = "--fp8-format e4m3 --fp8-recipe tensorwise"
BIG, SMALL = "llama3-8b-8layers", "llama3.2-1b"
MIXTRAL, QWEN3_MOE = "mixtral-8x7b-2layers", "qwen3-30b-a3b-4layers"  # a few MoE layers each, EP1
DEEPSEEK = "deepseek-v3-4layers"  # DeepSeek-V3's routing (256 experts, group-limited, sigmoid) at h 2048
MOE_PRESETS = (MIXTRAL, QWEN3_MOE, DEEPSEEK)
TRITON_WGRAD = "--moe-grouped-wgrad triton"
PER_EXPERT_WGRAD = "--moe-grouped-wgrad per-expert"
FUSIONS = "--moe-permute-fusion --moe-router-fusion"
TUNABLEOP_ENV = "PYTORCH_TUNABLEOP_ENABLED=1 PYTORCH_TUNABLEOP_TUNING=1 PYTORCH_TUNABLEOP_MAX_TUNING_DURATION_MS=30"


def runs(tunableop: bool, dense_ab: bool = False) -> list:
    """(name, preset, flags, warm-up steps, timed steps, environment) in the order they run."""
    protocol, ab = (3, 8), (2, 4)
    dense = [("bf16", SMALL, "", *protocol, ""), ("fp8-delayed", BIG, FP8_DELAYED, *protocol, "")] if dense_ab else []
    plan = [("bf16", BIG, "", *protocol, "")] + dense + [
            ("bf16", MIXTRAL, "", *ab, ""), ("bf16", QWEN3_MOE, "", *ab, ""), ("bf16", DEEPSEEK, "", *ab, ""),
            # A/B: the experts' weight gradients by one cuBLAS GEMM per expert accumulating into
            # main_grad (the Triton grouped GEMM that adds into it measured no faster on 2026-11-28:
            # Qwen3-MoE equal, Mixtral 5% slower; run it by hand with --moe-grouped-wgrad triton)
            ("bf16-per-expert-wgrad", MIXTRAL, PER_EXPERT_WGRAD, *ab, ""),
            # the compiled permutation and router, where the host's share is largest
            ("bf16-fused", QWEN3_MOE, FUSIONS, *ab, ""),
            # (auto: its start-up probe times grouped-mm, per-expert and per-expert accumulating in
            # bf16, and the fast-paths line gives the three times and the choice)
            ("fp8-tensorwise", MIXTRAL, f"{FP8_TENSORWISE} --moe-router-padding-for-fp8", *ab, ""),
            # FP8's gradient GEMMs per expert by cuBLAS (E5M2 x E4M3 at the FP8 rate; the Triton
            # kernels, which widen FP8 tiles to fp16, measured 692 ms against 714 on 2026-11-28: run
            # them by hand with --moe-grouped-wgrad triton)
            ("fp8-tensorwise-per-expert", MIXTRAL, f"{FP8_TENSORWISE} --moe-router-padding-for-fp8 {PER_EXPERT_WGRAD}",
             *ab, ""),
            # all three expert GEMMs as FP8 grouped GEMMs (E4M3 gradients: no widening to bf16)
            ("fp8-e4m3-tensorwise", MIXTRAL, f"{FP8_E4M3} --moe-router-padding-for-fp8", *ab, "")]
    if tunableop:
        plan.append(("bf16-tunableop", BIG, "", *protocol, TUNABLEOP_ENV))
    for switch in ("--no-torch-compile", "--no-gradient-accumulation-fusion") if dense_ab else ():
        plan.append((f"bf16{switch.removeprefix('-')}", BIG, switch, *ab, ""))
    return plan


def estimates(plan: list) -> list:
    from cost_model import moe_prediction, prediction

    step = {(name, precision): prediction(name, precision, after=True)["step_seconds"]
            for name in (BIG, SMALL) for precision in ("bf16", "fp8")}
    step.update({(name, precision): moe_prediction(name, precision)["step_seconds"]
                 for name in MOE_PRESETS for precision in ("bf16", "fp8")})
    step.update({(name, f"{precision}-triton"): moe_prediction(name, precision, "triton")["step_seconds"]
                 for name in MOE_PRESETS for precision in ("bf16", "fp8")})
    step.update({(name, f"{precision}-per-expert"): moe_prediction(name, precision, "per-expert")["step_seconds"]
                 for name in MOE_PRESETS for precision in ("bf16", "fp8")})
    seconds, compiled = [], set()
    for name, preset, flags, warmup, timed, env in plan:
        wgrad = "-triton" if TRITON_WGRAD in flags else "-per-expert" if PER_EXPERT_WGRAD in flags else ""
        precision = ("fp8" if "--fp8-format" in flags else "bf16") + wgrad
        compile_seconds = 0 if "--no-torch-compile" in flags else (
            WARM_COMPILE if compiled else COLD_COMPILE)
        compiled.add(preset)
        slower = 1.15 if flags.startswith("--no-") else 1.0  # an off-switch costs time (the A/B measures how much)
        tuning = TUNING if env else 0
        seconds.append(round(START_UP + compile_seconds + tuning + (warmup + timed) * step[preset, precision] * slower))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tunableop", action="store_true", help="also measure bf16 with PyTorch TunableOp")
    parser.add_argument("--dense-ab", action="store_true",
                        help="also llama3.2-1b in bf16, the 8B preset in FP8 delayed, and the --no-torch-compile "
                             "and --no-gradient-accumulation-fusion A/Bs on the 8B preset")
    parser.add_argument("--budget", type=int, default=570, help="seconds for the whole check")
    parser.add_argument("--lines", action="store_true", help="machine-readable: one run per line")
    parser.add_argument("--smoke", action="store_true", help="with --lines: the CPU smoke run (tiny preset)")
    args = parser.parse_args()
    plan = runs(args.tunableop, args.dense_ab)
    if args.lines and args.smoke:
        for name, preset, flags, _, _, env in plan:
            # On the CPU the Triton kernel runs in Triton's interpreter.
            smoke_env = " ".join(filter(None, (env, "TRITON_INTERPRET=1" if TRITON_WGRAD in flags else "")))
            print(f"{name}|{'tiny-moe' if preset in MOE_PRESETS else 'tiny'}|{flags}|1|2|600|{smoke_env}")
        return
    seconds = estimates(plan)
    if args.lines:
        for (name, preset, flags, warmup, timed, env), estimate in zip(plan, seconds):
            print(f"{name}|{preset}|{flags}|{warmup}|{timed}|{estimate}|{env}")
        return
    print(f"bench/gpu_check.sh plan (predicted seconds on one H100; budget {args.budget} s)")
    used = 0
    for (name, preset, flags, warmup, timed, env), estimate in zip(plan, seconds):
        used += estimate
        fits = "" if used + LANE_MIN <= args.budget else "   <- past the budget: would be skipped"
        print(f"  {used - estimate:4d}-{used:4d} s  {name:36s} {preset:21s} {warmup}+{timed} steps "
              f"{(env + ' ') if env else ''}{flags}{fits}")
    lane = args.budget - used
    print(f"  {used:4d}-{args.budget:4d} s  GPU test lane (pytest -m gpu), the time left: {lane} s "
          f"({'fits' if lane >= LANE_MIN else f'under its {LANE_MIN} s minimum: skipped'})")
    print(f"total predicted: {used} s of benchmarks + {max(lane, 0)} s for the lane "
          f"{'fits' if lane >= LANE_MIN else 'does NOT fit'} the {args.budget} s budget")


if __name__ == "__main__":
    main()
