"""Mixture of experts on one process: training throughput against the dense model of the same
active parameters, and the dispatch overhead of one MoE layer.

    python bench/bench_moe.py                 # CPU, fp32, one thread per OMP_NUM_THREADS
    python bench/bench_moe.py --tokens 8192   # the layer timings with more tokens

1. Training: a GPTModel (forward, backward) with every layer a mixture of 8 experts of hidden size F,
   top-2, against the same model with a dense SwiGLU MLP of hidden size 2F (the same FLOPs per
   token); tokens per second, the median of --steps steps of each after 2 warm-up steps, the two
   models' steps alternating.
2. One layer: MoELayer forward + backward on [tokens, h], split into the router, the dispatch and
   combine (permutation and its inverse, no communication on one process) and the experts' GEMMs.
Prints one line per figure; docs/moe.md records them with the machine they ran on.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.parallel_state import single_process  # noqa: E402
from megatron.core.transformer.config import ExecutionConfig, TransformerConfig, derive  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.moe.token_dispatcher import permute, unpermute  # noqa: E402


def config(moe: bool, hidden: int, expert_ffn: int, layers: int) -> TransformerConfig:
    shape = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=8, padded_vocab_size=1024,
                 ffn_hidden_size=2 * expert_ffn, swiglu=True, add_bias_linear=False,
                 normalization="RMSNorm", position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0,
                 max_position_embeddings=4096)
    if moe:
        shape.update(num_experts=8, moe_ffn_hidden_size=expert_ffn, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                     moe_token_dispatcher_type="alltoall")
    return derive(TransformerConfig(**shape))


EXECUTION = ExecutionConfig(cross_entropy_loss_fusion=False, gradient_accumulation_fusion=False)


def median_seconds(step, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def training_tokens_per_second(args) -> tuple:
    """(dense, MoE) tokens/s: the two models' steps alternate, so both see the same machine load."""
    models = []
    for moe in (False, True):
        model = GPTModel(config(moe, args.hidden, args.expert_ffn, args.layers), single_process(), execution=EXECUTION)
        model.initialize_parameters(1)
        models.append(model)
    tokens = torch.randint(0, 1024, (args.batch, args.seq))
    positions = torch.arange(args.seq).expand(args.batch, args.seq)

    def step(model):
        start = time.perf_counter()
        model(tokens, positions, labels=tokens).mean().backward()
        return time.perf_counter() - start

    for _ in range(2):
        for model in models:
            step(model)
    times = [[], []]
    for _ in range(args.steps):
        for index, model in enumerate(models):
            times[index].append(step(model))
    return tuple(args.batch * args.seq / statistics.median(t) for t in times)


def layer_breakdown(args) -> dict:
    cfg = config(True, args.hidden, args.expert_ffn, 1)
    layer = MoELayer(cfg, execution=EXECUTION, layer_number=0, groups=single_process(), device=torch.device("cpu"))
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.02)
    x = torch.randn(args.tokens, 1, args.hidden, requires_grad=True)
    flat = x.detach().reshape(-1, args.hidden)
    probs, routing_map = layer.router(x)
    rows, row_probs, index, per_expert = permute(flat, probs.detach(), routing_map)
    counts = per_expert.tolist()
    rows = rows.requires_grad_(True)

    def whole():
        layer(x).sum().backward()

    def router():
        layer.router(x)[0].sum().backward()

    def dispatch_and_combine():
        moved, _, order, _ = permute(flat, probs.detach(), routing_map)
        unpermute(moved, order, flat.shape[0])

    def experts():
        layer.experts(rows, counts, row_probs).sum().backward()

    for step in (whole, router, dispatch_and_combine, experts):
        step()
    return {name: median_seconds(step, 5) * 1e3 for name, step in
            (("layer", whole), ("router", router), ("dispatch+combine", dispatch_and_combine),
             ("experts", experts))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-ffn", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    torch.manual_seed(0)
    dense, moe = training_tokens_per_second(args)
    print(f"training tokens/s (h {args.hidden}, {args.layers} layers, {args.batch}x{args.seq} tokens, "
          f"{torch.get_num_threads()} threads): dense SwiGLU f={2 * args.expert_ffn}: {dense:.0f} | "
          f"8 experts f={args.expert_ffn} top-2: {moe:.0f} | MoE/dense {moe / dense:.2f}")
    parts = layer_breakdown(args)
    print(f"one MoE layer, forward+backward of {args.tokens} tokens (ms): "
          + " | ".join(f"{name} {ms:.2f}" for name, ms in parts.items()))


if __name__ == "__main__":
    main()
