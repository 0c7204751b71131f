"""Memory a rank holds, measured on any device by counting live tensor bytes (`LiveTensorBytes`):

1. a pipeline stage during one step's forwards and backwards (N = 8 micro-batches), keeping every
   sent output until its backward against freeing its data once sent: 1F1B at PP4 and interleaved
   at PP4 x VPP2;
2. FSDP2 start-up at DP4 (bf16 parameters): building the model whole, initializing it and then
   sharding it, against building it on the meta device and initializing each rank's shards.

    torchrun --nproc_per_node 4 bench/bench_scale_memory.py            # gloo on CPU works
    torchrun --nproc_per_node 4 bench/bench_scale_memory.py --seq-length 2048 --hidden-size 1024

Prints one line per rank and variant; records nothing.
"""
import argparse
import os

import torch
import torch.distributed as dist

from megatron.core.distributed.ddp import DistributedDataParallel
from megatron.core.distributed.fsdp import FullyShardedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.pipeline_parallel.layout import stage_layer_numbers
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.transformer.config import ExecutionConfig, TransformerConfig
from megatron.training.memory import LiveTensorBytes

SEED = 1234


def model_config(args, num_layers: int) -> TransformerConfig:
    return TransformerConfig(num_layers=num_layers, hidden_size=args.hidden_size, num_attention_heads=8,
                             group_query_attention=True, num_query_groups=2, ffn_hidden_size=4 * args.hidden_size,
                             padded_vocab_size=args.vocab_size, max_position_embeddings=args.seq_length,
                             normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                             position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0)


def forward_step(data_iterator, model):
    tokens = next(data_iterator)
    positions = torch.arange(tokens.shape[1] - 1).expand(tokens.shape[0], -1)
    output = model(tokens[:, :-1], positions, labels=tokens[:, 1:])
    return output, lambda loss: (loss.mean(), {})


def pipeline_stage(args, virtual: int) -> dict:
    """Peak live bytes of one step on this rank, outputs kept vs freed."""
    layers = 4 * virtual * args.layers_per_chunk
    groups = initialize_model_parallel(1, 4)
    config = model_config(args, layers)
    chunks = []
    for index, numbers in enumerate(stage_layer_numbers(layers, 4, groups.pp_rank, virtual_size=virtual)):
        model = GPTModel(config, groups, pre_process=groups.is_first_stage and index == 0,
                         post_process=groups.is_last_stage and index == virtual - 1, layer_numbers=numbers)
        model.initialize_parameters(SEED)
        chunks.append(DistributedDataParallel(model, groups))
    schedule = get_forward_backward_func(4, virtual)
    peaks = {}
    for deallocate in (False, True):
        generator = torch.Generator().manual_seed(SEED)
        batches = [torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1),
                                 generator=generator) for _ in range(args.micro_batches)]
        with LiveTensorBytes() as counter:
            schedule(forward_step_func=forward_step, data_iterator=iter(batches), model_chunks=chunks,
                     num_microbatches=args.micro_batches, groups=groups, dtype=torch.float32,
                     tensor_shape=(args.seq_length, args.micro_batch_size, args.hidden_size),
                     overlap_p2p_comm=True, deallocate_pipeline_outputs=deallocate)
        peaks[deallocate] = counter.peak
    return dict(kept=peaks[False], freed=peaks[True])


def fsdp_startup(args) -> dict:
    groups = initialize_model_parallel(1, 1)
    config = model_config(args, args.fsdp_layers)
    bf16 = ExecutionConfig(params_dtype=torch.bfloat16)
    peaks = {}
    for on_meta in (False, True):
        with LiveTensorBytes() as counter:
            model = GPTModel(config, groups, execution=bf16,
                             device=torch.device("meta") if on_meta else groups.device)
            if not on_meta:
                model.initialize_parameters(SEED)
            chunk = FullyShardedDataParallel(model, groups, init_seed=SEED)
        peaks[on_meta] = counter.peak
        parameters = sum(p.numel() for p in chunk.params)
        del model, chunk
    return dict(built_whole=peaks[False], built_sharded=peaks[True], parameters=parameters)


def mib(value: int) -> str:
    return f"{value / 2 ** 20:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--layers-per-chunk", type=int, default=1)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--fsdp-layers", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    if dist.get_world_size() != 4:
        raise SystemExit("run with torchrun --nproc_per_node 4 (PP4, and DP4 for FSDP2)")
    rank = dist.get_rank()
    activation = args.seq_length * args.micro_batch_size * args.hidden_size * 4
    for name, virtual in (("PP4", 1), ("PP4 x VPP2", 2)):
        figures = pipeline_stage(args, virtual)
        print(f"{name} rank {rank}: peak live {mib(figures['kept'])} keeping sent outputs, {mib(figures['freed'])} "
              f"freeing them (saved {mib(figures['kept'] - figures['freed'])} = "
              f"{(figures['kept'] - figures['freed']) / activation:.2f} outputs of {mib(activation)})", flush=True)
    dist.barrier()
    figures = fsdp_startup(args)
    if rank == 0:
        print(f"FSDP2 DP4 start-up, rank 0, {figures['parameters'] / 1e6:.1f}M parameters (bf16): peak "
              f"{mib(figures['built_whole'])} built whole then sharded, {mib(figures['built_sharded'])} built on "
              f"meta and initialized by shard ({figures['built_sharded'] / figures['built_whole']:.2f} of it)",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
