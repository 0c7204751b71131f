"""Peak memory (and time) of the loss: fused chunked cross entropy against the plain one.

    python bench/bench_cross_entropy.py                       # 2048 tokens x 128256 vocabulary, bf16, CPU
    python bench/bench_cross_entropy.py --tokens 4096 --device cuda

Each variant runs forward + backward of the per-token loss over bf16 logits in a fresh process.
The figure is the peak memory above what was allocated before the loss (the logits themselves):
on CPU the growth of the process's peak resident set (VmHWM) over its resident set just before;
on GPU `torch.cuda.max_memory_allocated` over the allocation before.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(variant: str, tokens: int, vocab: int, device: str) -> dict:
    import torch

    from megatron.core.tensor_parallel.cross_entropy import (
        fused_vocab_parallel_cross_entropy,
        vocab_parallel_cross_entropy,
    )

    torch.manual_seed(0)
    logits = (torch.randn(tokens, 1, vocab, dtype=torch.bfloat16, device=device) * 3).requires_grad_()
    target = torch.randint(0, vocab, (tokens, 1), device=device)
    loss_fn = fused_vocab_parallel_cross_entropy if variant == "fused" else vocab_parallel_cross_entropy
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _status("VmRSS")
    start = time.perf_counter()
    scaled = logits * 1.0  # the model's logits are a non-leaf; this is what the loss receives
    loss = loss_fn(scaled, target, None)
    loss.mean().backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")) - before
    return {"variant": variant, "seconds": seconds, "peak_above_inputs_gib": peak / 2 ** 30,
            "logits_gib": logits.numel() * 2 / 2 ** 30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--child", choices=["plain", "fused"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.tokens, args.vocab, args.device)))
        return
    print(f"cross entropy, {args.tokens} tokens x {args.vocab} vocabulary, bf16 logits, {args.device}")
    for variant in ("plain", "fused"):
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens),
                              "--vocab", str(args.vocab), "--device", args.device],
                             capture_output=True, text=True, check=True).stdout
        figures = json.loads(out.strip().splitlines()[-1])
        print(f"{variant:>6}: peak memory above the logits {figures['peak_above_inputs_gib']:.2f} GiB "
              f"(logits {figures['logits_gib']:.2f} GiB), forward+backward {figures['seconds'] * 1000:.0f} ms")


if __name__ == "__main__":
    main()
