"""Measure the planner's throughput table on this machine's GPU, in one command:

    python bench/bench_plan_table.py --out h200_table.json      # then: tools/plan.py --throughput-table h200_table.json

Times bf16 (and FP8 where `torch._scaled_mm` runs) GEMMs over a range of sizes at the benchmark
presets' shapes, causal SDPA attention forward+backward, an elementwise pass (the HBM bandwidth it
reaches), and writes each as a fraction of the peak you name (--peak-bf16/--peak-fp8 in TFLOP/s,
--hbm in TB/s: the datasheet's dense figures). `--device cpu --preset tiny` checks the script on
any machine (the fractions of a CPU mean nothing for a GPU plan). The median of --repeats timed
runs after one warm-up, each synchronized.
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

# (tokens, in features, out features): the GEMMs of llama3.2-1b (micro-batch 2) and llama3-8b (micro-batch 1) at seq 4096
SHAPES = {"gpu": [(8192, 2048, 2048), (8192, 2048, 3072), (8192, 2048, 16384), (8192, 8192, 2048),
                  (4096, 4096, 6144), (4096, 4096, 28672), (4096, 14336, 4096), (4096, 4096, 128256)],
          "tiny": [(64, 64, 64), (128, 64, 256)]}
ATTENTION = {"gpu": [(1, 32, 8, 4096, 128), (2, 32, 8, 4096, 64)], "tiny": [(1, 4, 2, 64, 16)]}


def _seconds(fn, device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_points(shapes, device, dtype, repeats: int, peak: float) -> list:
    points = []
    for tokens, k, n in shapes:
        a = torch.randn(tokens, k, device=device, dtype=dtype)
        b = torch.randn(n, k, device=device, dtype=dtype)
        seconds = _seconds(lambda: a @ b.t(), device, repeats)
        flops = 2 * tokens * k * n
        points.append((flops, flops / seconds / peak))
        print(f"GEMM {tokens}x{k}x{n} {dtype}: {flops / seconds / 1e12:.1f} TFLOP/s", flush=True)
    return sorted(points)


def fp8_points(shapes, device, repeats: int, peak: float) -> list:
    points = []
    for tokens, k, n in shapes:
        a = torch.randn(tokens, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        try:
            seconds = _seconds(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                               device, repeats)
        except (RuntimeError, NotImplementedError) as error:
            print(f"FP8 GEMMs do not run here ({str(error).splitlines()[0]}); no fp8 table", flush=True)
            return []
        flops = 2 * tokens * k * n
        points.append((flops, flops / seconds / peak))
        print(f"GEMM {tokens}x{k}x{n} fp8: {flops / seconds / 1e12:.1f} TFLOP/s", flush=True)
    return sorted(points)


def attention_points(shapes, device, dtype, repeats: int, peak: float) -> list:
    points = []
    for batch, heads, groups, seq, dim in shapes:
        q = torch.randn(batch, heads, seq, dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(batch, groups, seq, dim, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)

        def step():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

        seconds = _seconds(step, device, repeats)
        forward = 2 * batch * seq * seq * heads * dim  # causal: half of 4 b s^2 h d
        points.append((forward, 3 * forward / seconds / peak))
        print(f"attention b{batch} h{heads}/{groups} s{seq} d{dim}: {3 * forward / seconds / 1e12:.1f} TFLOP/s fwd+bwd",
              flush=True)
    return sorted(points)


def hbm_fraction(device, dtype, repeats: int, bandwidth: float, elements: int) -> float:
    x = torch.randn(elements, device=device, dtype=dtype)
    seconds = _seconds(lambda: x.mul(1.0001), device, repeats)
    achieved = 2 * x.numel() * x.element_size() / seconds
    print(f"elementwise: {achieved / 1e9:.0f} GB/s", flush=True)
    return achieved / bandwidth


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", choices=sorted(SHAPES), default="gpu")
    parser.add_argument("--peak-bf16", type=float, default=989.0, help="dense bf16 TFLOP/s of this GPU")
    parser.add_argument("--peak-fp8", type=float, default=1979.0, help="dense FP8 TFLOP/s of this GPU")
    parser.add_argument("--hbm", type=float, default=3.35, help="HBM bandwidth of this GPU, TB/s")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"bf16_gemm": gemm_points(SHAPES[args.preset], device, dtype, args.repeats, args.peak_bf16 * 1e12),
             "attention": attention_points(ATTENTION[args.preset], device, dtype, args.repeats, args.peak_bf16 * 1e12),
             "hbm_efficiency": hbm_fraction(device, dtype, args.repeats, args.hbm * 1e12,
                                            1 << (28 if device.type == "cuda" else 20))}
    if device.type == "cuda":
        fp8 = fp8_points(SHAPES[args.preset], device, args.repeats, args.peak_fp8 * 1e12)
        if fp8:
            table["fp8_gemm"] = fp8
    with open(args.out, "w") as handle:
        json.dump(table, handle, indent=1)
    print(f"wrote {args.out}: pass it to tools/plan.py --throughput-table", flush=True)


if __name__ == "__main__":
    main()
