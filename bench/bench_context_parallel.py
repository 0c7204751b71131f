"""Attention throughput of the context-parallel kernels on one device.

    python bench/bench_context_parallel.py                  # GPU: seq 32k and 64k, Llama 3 8B heads, bf16
    python bench/bench_context_parallel.py --preset cpu     # CPU figures at small sizes (fp32)
    python bench/bench_context_parallel.py --preset tiny    # a seconds-long smoke run

One device can run CP only as 1, so this measures the compute side of context parallelism:

- `sdpa`: causal `F.scaled_dot_product_attention` over the whole sequence (what CP=1 runs);
- `cp kernel`: the block kernel the CP schemes call (the op that also returns the log-sum-exp),
  causal over the whole sequence, forward and backward from the returned output and log-sum-exp;
- `ring, C ranks`: the load-balanced ring's blocks for all C ranks run one after another on this
  device, with the log-sum-exp merges and the backward from merged results; no communication.
  Same FLOPs as `sdpa`, so its time over `sdpa`'s is the cost of chunking (smaller kernels and
  the merges); divided by C it is one rank's compute per layer at CP = C.

FLOPs of causal attention forward+backward are counted as in the TFLOP/s formula
(6 x b x s^2 x heads x head_dim, the causal half). Times are medians of --reps after --warmup runs,
each with a device synchronize.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from megatron.core import utils
from megatron.core.context_parallel import kernels
from megatron.core.context_parallel.layout import local_positions
from megatron.core.context_parallel.merge import empty_partial, merge_block
from megatron.core.context_parallel.ring import step_blocks

PRESETS = {
    "gpu": dict(device="cuda", dtype=torch.bfloat16, seqs=(32768, 65536), heads=32, groups=8, head_dim=128,
                cps=(2, 4, 8), reps=5, warmup=2),
    "cpu": dict(device="cpu", dtype=torch.float32, seqs=(1024, 2048), heads=8, groups=2, head_dim=64,
                cps=(2, 4), reps=3, warmup=1),
    "tiny": dict(device="cpu", dtype=torch.float32, seqs=(64,), heads=4, groups=2, head_dim=16, cps=(2,),
                 reps=1, warmup=1),
}


def sdpa(q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)
    out.backward(dout)


def cp_kernel(kernel):
    def run(q, k, v, dout):
        out, lse, state = kernels.block_forward(kernel, q, k, v, True)
        kernels.block_backward(kernel, dout, q, k, v, out, lse, True, state)
    return run


def ring(kernel, cp: int):
    """Every rank's ring blocks, one rank after the other, forward then backward."""
    def run(q, k, v, dout):
        seq = q.shape[2]
        positions = [local_positions(seq, cp, r, device=q.device) for r in range(cp)]
        local = [(q[:, :, p], k[:, :, p], v[:, :, p], dout[:, :, p]) for p in positions]
        for rank in range(cp):
            q_r, _, _, dout_r = local[rank]
            out, lse = empty_partial(q_r)
            blocks = []
            for step in range(cp):
                rows, cols, causal = step_blocks(step, rank, cp, q_r.shape[2])
                _, k_s, v_s, _ = local[(rank - step) % cp]
                block_out, block_lse, state = kernels.block_forward(kernel, q_r[:, :, rows], k_s[:, :, cols],
                                                                    v_s[:, :, cols], causal)
                merge_block(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
                blocks.append((rows, k_s[:, :, cols], v_s[:, :, cols], causal, state))
            out = out.to(q.dtype)
            for rows, k_b, v_b, causal, state in blocks:
                kernels.block_backward(kernel, dout_r[:, :, rows], q_r[:, :, rows], k_b, v_b, out[:, :, rows],
                                       lse[:, :, rows], causal, state)
    return run


def time_it(fn, inputs, device, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn(*inputs)
    times = []
    for _ in range(reps):
        utils.synchronize(device)
        start = time.perf_counter()
        fn(*inputs)
        utils.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    device = torch.device(preset["device"])
    dtype = preset["dtype"]
    kernel = kernels.select_kernel(device, dtype)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"{dtype}, heads {preset['heads']}, key/value groups {preset['groups']}, head dim {preset['head_dim']}, "
          f"batch 1, block kernel {kernel}, torch {torch.__version__}")
    for seq in preset["seqs"]:
        generator = torch.Generator(device=device).manual_seed(0)
        shapes = [(1, h, seq, preset["head_dim"]) for h in (preset["heads"], preset["groups"], preset["groups"],
                                                             preset["heads"])]
        inputs = [torch.randn(shape, generator=generator, device=device, dtype=dtype) for shape in shapes]
        flops = 6 * seq * seq * preset["heads"] * preset["head_dim"]
        variants = [("sdpa (CP=1, unchunked)", sdpa), ("cp kernel (CP=1)", cp_kernel(kernel))]
        variants += [(f"ring, {cp} ranks on one device", ring(kernel, cp)) for cp in preset["cps"]]
        baseline = None
        for name, fn in variants:
            utils.reset_peak_memory(device)
            seconds = time_it(fn, inputs, device, preset["reps"], preset["warmup"])
            baseline = baseline or seconds
            print(f"seq {seq:6d} | {name:32s} | fwd+bwd {seconds * 1e3:9.1f} ms | {flops / seconds / 1e12:8.3f} TFLOP/s"
                  f" | {seq / seconds:10.0f} tokens/s | x{seconds / baseline:5.2f} of sdpa"
                  f" | peak memory {utils.peak_memory_bytes(device) / 1e9:.2f} GB", flush=True)


if __name__ == "__main__":
    main()
