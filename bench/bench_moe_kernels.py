"""The experts' weight-gradient paths on one GPU, at the MoE presets' shapes: PyTorch's grouped GEMM
plus the pass into main_grad against the Triton kernel that adds into main_grad itself, for a few
tile configurations (FP8 casts too: E5M2 x E4M3, widened in registers), and against
--moe-grouped-wgrad per-expert's cuBLAS GEMM per expert accumulating into main_grad; and FP8
hybrid's gradient GEMMs: the row-grouped E5M2 x E4M3 Triton GEMM and per-expert's `_scaled_mm`
(both gradients, `fp8_experts._per_expert_gradients`) against the bf16 grouped GEMMs.
(torch._grouped_mm of bf16 writes bf16 on PyTorch 2.11: the baseline adds that product into the
fp32 main_grad, eagerly.)

    python bench/bench_moe_kernels.py [--seconds 60] [--json out.json]

Shapes (one micro-batch of 4096 tokens, routing balanced): mixtral-8x7b-2layers' fc1 and fc2 (8
experts, 1024 rows each), qwen3-30b-a3b-4layers' (128 experts of 256 rows), deepseek-v3-4layers'
fc1 (256 experts of 128 rows). Each figure: the median of triton.testing.do_bench, in ms and in
TFLOP/s (2 N n k per weight), printed as it is measured; the sweep stops starting new shapes after
--seconds. Needs a CUDA GPU and Triton.
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron.core.transformer.moe import fp8_experts, triton_experts  # noqa: E402
from megatron.core.transformer.moe.experts import _accumulate_per_expert_  # noqa: E402

SHAPES = [  # name, experts, rows per expert, n (gradient's columns), k (input's columns)
    ("mixtral-fc1", 8, 1024, 28672, 4096), ("mixtral-fc2", 8, 1024, 4096, 14336),
    ("qwen3-fc1", 128, 256, 1536, 2048), ("qwen3-fc2", 128, 256, 2048, 768),
    ("deepseek-fc1", 256, 128, 896, 2048)]
# BLOCK_N, BLOCK_K, BLOCK_ROWS, warps, stages
WGRAD_CONFIGS = [(128, 128, 32, 4, 5), (128, 128, 32, 8, 4), (128, 256, 32, 8, 4), (256, 128, 32, 8, 4),
                 (128, 128, 64, 8, 3)]  # the first: triton_experts' own
ROWS_CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 128, 32, 4, 5)]


def set_wgrad(config):
    (triton_experts.BLOCK_N, triton_experts.BLOCK_K, triton_experts.BLOCK_ROWS,
     triton_experts.WGRAD_WARPS, triton_experts.WGRAD_STAGES) = config


def set_rows(config):
    (triton_experts.ROWS_BLOCK_M, triton_experts.ROWS_BLOCK_N, triton_experts.ROWS_BLOCK_K,
     triton_experts.NUM_WARPS, triton_experts.NUM_STAGES) = config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from triton.testing import do_bench

    start, results = time.time(), []
    default_wgrad = (triton_experts.BLOCK_N, triton_experts.BLOCK_K, triton_experts.BLOCK_ROWS,
                     triton_experts.WGRAD_WARPS, triton_experts.WGRAD_STAGES)
    default_rows = (triton_experts.ROWS_BLOCK_M, triton_experts.ROWS_BLOCK_N, triton_experts.ROWS_BLOCK_K,
                    triton_experts.NUM_WARPS, triton_experts.NUM_STAGES)

    def record(shape, path, config, ms, flops, error=None):
        row = dict(shape=shape, path=path, config=config, ms=ms,
                   tflops=None if ms is None else flops / ms / 1e9, error=error)
        results.append(row)
        text = f"error {error}" if error else f"{ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s"
        print(f"{shape:13s} {path:24s} {str(config):26s} {text}", flush=True)

    for name, experts, per, n, k in SHAPES:
        if time.time() - start > args.seconds:
            print(f"stopped: {args.seconds:.0f} s spent", flush=True)
            break
        rows = experts * per
        grad = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        ends = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * per
        main_grad = torch.zeros(experts, n, k, device="cuda", dtype=torch.float32)
        flops = 2 * rows * n * k

        def grouped_then_add():
            main_grad.add_(torch._grouped_mm(grad.t(), x, offs=ends))

        record(name, "grouped-mm bf16 + add", None, do_bench(grouped_then_add, rep=60), flops)
        record(name, "grouped-mm bf16 only", None,
               do_bench(lambda: torch._grouped_mm(grad.t(), x, offs=ends), rep=60), flops)
        counts = [per] * experts
        record(name, "per-expert cublas accum", None,
               do_bench(lambda: _accumulate_per_expert_(main_grad, grad, x, counts), rep=60), flops)
        for config in WGRAD_CONFIGS:
            set_wgrad(config)
            try:
                ms = do_bench(lambda: triton_experts.accumulate_grouped_wgrad_(main_grad, grad, x, ends), rep=60)
                record(name, "triton wgrad bf16", config, ms, flops)
            except Exception as error:  # a configuration the compiler refuses (shared memory): the next
                record(name, "triton wgrad bf16", config, None, flops, f"{type(error).__name__}: {error}"[:200])
        if name == "mixtral-fc1":  # FP8 hybrid: E5M2 gradient x E4M3 input, per-expert factors
            g8, x8 = grad.to(torch.float8_e5m2), x.to(torch.float8_e4m3fn)
            scales = torch.ones(experts, device="cuda")
            for config in WGRAD_CONFIGS[:3]:
                set_wgrad(config)
                try:
                    ms = do_bench(lambda: triton_experts.accumulate_grouped_wgrad_(main_grad, g8, x8, ends, scales),
                                  rep=60)
                    record(name, "triton wgrad e5m2xe4m3", config, ms, flops)
                except Exception as error:
                    record(name, "triton wgrad e5m2xe4m3", config, None, flops, f"{type(error).__name__}: {error}"[:200])
            # the input gradient: grad [N, n] x weight [E, n, k] per row's expert
            w8 = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16)
            record(name, "dgrad grouped-mm bf16", None,
                   do_bench(lambda: torch._grouped_mm(grad, w8, offs=ends), rep=60), flops)
            w8 = w8.to(torch.float8_e4m3fn)
            row_scale = torch.ones(rows, device="cuda")
            for config in ROWS_CONFIGS:
                set_rows(config)
                try:
                    ms = do_bench(lambda: triton_experts.fp8_grouped_rows_mm(g8, w8, row_scale, ends, torch.bfloat16),
                                  rep=60)
                    record(name, "triton dgrad e5m2xe4m3", config, ms, flops)
                except Exception as error:
                    record(name, "triton dgrad e5m2xe4m3", config, None, flops, f"{type(error).__name__}: {error}"[:200])
            set_rows(default_rows)
            # Both gradient GEMMs: bf16 grouped (input gradient, weight gradient and its add) against
            # per-expert `_scaled_mm` of the casts (hybrid), the weight gradient added or written.
            w16 = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16)

            def bf16_both():
                torch._grouped_mm(grad, w16, offs=ends)
                grouped_then_add()

            record(name, "dgrad+wgrad bf16 grouped", None, do_bench(bf16_both, rep=60), 2 * flops)
            weight = torch.empty(0)
            weight.main_grad = main_grad
            w_dgrad = w8.transpose(1, 2).contiguous().transpose(1, 2)                # column-major per expert
            x_t = fp8_experts.aligned_transpose(x8)
            ones = torch.ones(experts, device="cuda")
            for written in (False, True):
                fp8 = type("FP8", (), dict(linears=[type("L", (), dict(writes_into=lambda self, out: written))()]))

                def fp8_both():
                    weight.main_grad_empty = written
                    fp8_experts._per_expert_gradients(weight, g8, ones, x_t, ones, w_dgrad, ones, counts, fp8,
                                                      torch.bfloat16)

                try:
                    record(name, f"dgrad+wgrad fp8 per-expert ({'written' if written else 'added'})", None,
                           do_bench(fp8_both, rep=60), 2 * flops)
                except Exception as error:
                    record(name, "dgrad+wgrad fp8 per-expert", None, None, 2 * flops,
                           f"{type(error).__name__}: {error}"[:200])
        set_wgrad(default_wgrad)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), results=results), indent=1))


if __name__ == "__main__":
    main()
