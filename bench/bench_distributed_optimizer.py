"""Throughput and peak memory of one GPU (DP=1) with and without the distributed optimizer.

    python bench/bench_distributed_optimizer.py                   # llama3.2-1b, bf16, seq 4096, on the GPU
    python bench/bench_distributed_optimizer.py --preset tiny     # a seconds-long smoke run (CPU works)

At DP=1 the distributed optimizer shards nothing; this measures its fixed costs (the parameter
buffer, the shard bookkeeping, the all-gather no-op) against the replicated optimizer, with the
preset and timing rules of docs/performance.md: 8 micro-batches per step, median of >= 8 steps after
3 warm-up steps, timed with a device synchronize. Prints one line per variant; records nothing.
"""
import argparse
import statistics
import time

import torch

from megatron.core import utils
from megatron.core.distributed.ddp import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.parallel_state import single_process
from megatron.core.transformer.config import ExecutionConfig, TransformerConfig

PRESETS = {
    "llama3.2-1b": dict(model=dict(num_layers=16, hidden_size=2048, num_attention_heads=32, group_query_attention=True,
                                   num_query_groups=8, ffn_hidden_size=8192, padded_vocab_size=128256),
                        micro_batch_size=2, seq_length=4096),
    "tiny": dict(model=dict(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True,
                            num_query_groups=2, ffn_hidden_size=128, padded_vocab_size=256),
                 micro_batch_size=2, seq_length=64),
}


def build(preset: dict, device: torch.device, dtype: torch.dtype, use_distributed_optimizer: bool):
    groups = single_process(device)
    config = TransformerConfig(**preset["model"], max_position_embeddings=preset["seq_length"],
                               normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                               position_embedding_type="rope", rotary_base=500000, use_rope_scaling=True,
                               hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, groups, execution=ExecutionConfig(params_dtype=dtype), device=device)
    model.initialize_parameters(1234)
    chunk = DistributedDataParallel(model, groups, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=use_distributed_optimizer, overlap_grad_reduce=True))
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-4, bf16=dtype == torch.bfloat16), [chunk], groups)
    return groups, chunk, optimizer


def step(chunk, optimizer, groups, batches: list) -> None:
    chunk.zero_grad_buffer()
    for index, tokens in enumerate(batches):
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.shape[1], device=tokens.device).unsqueeze(0).expand_as(inputs)
        context = chunk.no_sync() if index < len(batches) - 1 else torch.enable_grad()
        with context:
            loss = chunk(inputs, positions, labels=labels).float().mean()
            optimizer.scale_loss(loss / len(batches)).backward()
    finalize_model_grads([chunk], groups)
    optimizer.step()


def measure(preset: dict, device, dtype, use_distributed_optimizer: bool, args) -> str:
    groups, chunk, optimizer = build(preset, device, dtype, use_distributed_optimizer)
    mbs, seq = preset["micro_batch_size"], preset["seq_length"]
    vocab = preset["model"]["padded_vocab_size"]
    batches = [torch.randint(0, vocab, (mbs, seq + 1), device=device) for _ in range(args.micro_batches)]
    times = []
    for index in range(args.warmup + args.steps):
        if index == args.warmup:
            utils.reset_peak_memory(device)
        utils.synchronize(device)
        start = time.perf_counter()
        step(chunk, optimizer, groups, batches)
        utils.synchronize(device)
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    tokens = mbs * seq * args.micro_batches
    name = "distributed optimizer" if use_distributed_optimizer else "replicated optimizer "
    return (f"{name}: median step {median * 1e3:.1f} ms | {tokens / median:,.0f} tokens/s/GPU | "
            f"optimizer state {optimizer.optimizer_state_bytes() / 2**30:.2f} GiB | "
            f"peak memory {utils.peak_memory_bytes(device) / 2**30:.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3.2-1b")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fp32", action="store_true", help="fp32 parameters instead of bf16")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if utils.accelerator_available() else torch.device("cpu")
    dtype = torch.float32 if args.fp32 else torch.bfloat16
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}, preset {args.preset}, {args.micro_batches} micro-batches per step")
    for use_distributed_optimizer in (False, True):
        print(measure(PRESETS[args.preset], device, dtype, use_distributed_optimizer, args), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
