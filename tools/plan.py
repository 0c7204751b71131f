"""Plan a run before you have the cluster: memory per GPU term by term, predicted step time, and
the best layouts, for the flags of a pretrain_gpt.py run on a target cluster, from any machine.

    # the plan for these flags' layout on one node of 8 H100s
    python tools/plan.py --gpu h100-80gb --nodes 1 -- --num-layers 32 --hidden-size 4096 ... \\
        --tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 2 --global-batch-size 64 \\
        --seq-length 8192 --bf16 --vocab-size 128256

    # the 5 fastest layouts that fit (TP, PP, VPP, CP, DP, sharding, recompute, micro-batch size,
    # and for a mixture of experts EP, ETP and --moe-layer-recompute)
    python tools/plan.py --gpu h100-80gb --nodes 4 --top 5 -- <the same model and batch flags>

Everything after `--` is read exactly as pretrain_gpt.py reads it (--lr, --train-iters and the data
flags may be left out). The vocabulary size comes from --vocab-size or the tokenizer flags. Nothing is built
and this machine's memory is never consulted. See docs/planning.md for what each term counts, what
was checked against measurements and published tables, and the limits.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron.training.planning.hardware import GB, PRESETS, cluster  # noqa: E402
from megatron.training.planning.plan import MARGIN, format_plan, model_architecture, plan_for_flags  # noqa: E402


def parse(argv=None) -> tuple:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     usage="%(prog)s [target options] -- <pretrain_gpt.py flags>")
    parser.add_argument("--gpu", choices=sorted(PRESETS), default="h100-80gb", help="the target GPU's preset")
    parser.add_argument("--nodes", type=int, default=1, help="nodes in the cluster")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the preset's (8)")
    parser.add_argument("--intra-node-bandwidth", type=float, default=None,
                        help="GB/s per GPU per direction inside a node (default: the preset's)")
    parser.add_argument("--inter-node-bandwidth", type=float, default=None,
                        help="GB/s per GPU per direction between nodes (default: the preset's)")
    parser.add_argument("--throughput-table", default=None,
                        help="a JSON table measured on the target GPU by bench/bench_plan_table.py")
    parser.add_argument("--margin", type=float, default=MARGIN,
                        help="fraction of the GPU's memory kept free for the CUDA context, buffers and fragmentation")
    parser.add_argument("--top", type=int, default=0, metavar="K",
                        help="rank the layouts that fit by predicted tokens/s and print the best K")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    options = parser.parse_args(argv[:split])
    run_flags = argv[split + 1:]
    if not run_flags:
        parser.error("give the run's pretrain_gpt.py flags after `--` (at least the model shape, "
                     "--micro-batch-size, --seq-length and --vocab-size)")
    if options.nodes < 1 or (options.gpus_per_node is not None and options.gpus_per_node < 1):
        parser.error("--nodes and --gpus-per-node must be >= 1")
    if not 0 <= options.margin < 1:
        parser.error(f"--margin must be in [0, 1), got {options.margin}")
    return options, run_flags


def run_config(flags: list):
    """(training Config, vocabulary size) from pretrain_gpt.py flags."""
    from megatron.training.arguments import parse_args
    from megatron.training.data import build_tokenizer

    if "--lr" not in flags:
        flags = flags + ["--lr", "0"]  # no effect on the plan
    if "--train-iters" not in flags and "--train-samples" not in flags:
        flags = flags + ["--train-iters", "1"]
    if not any(flag in flags for flag in ("--data-path", "--train-data-path", "--mock-data")):
        flags = flags + ["--mock-data"]  # the data does not change the plan
    config = parse_args(flags)
    tokenizer = build_tokenizer(config)  # as the run builds it (NullTokenizer adds an end token)
    vocab_size = tokenizer.vocab_size if tokenizer is not None else config.data.vocab_size
    if vocab_size is None:
        raise SystemExit("error: no vocabulary size: pass --vocab-size N (or the tokenizer flags with its files)")
    return config, vocab_size


def main(argv=None) -> int:
    options, flags = parse(argv)
    config, vocab_size = run_config(flags)
    target = cluster(options.gpu, nodes=options.nodes, gpus_per_node=options.gpus_per_node,
                     intra_node_bandwidth=options.intra_node_bandwidth and options.intra_node_bandwidth * GB,
                     inter_node_bandwidth=options.inter_node_bandwidth and options.inter_node_bandwidth * GB,
                     table_file=options.throughput_table)
    if options.top > 0:
        from megatron.training.planning.plan import layout_for_flags
        from megatron.training.planning.search import format_table, search

        base = layout_for_flags(config, vocab_size, target.world_size)
        if config.training.global_batch_size is None:
            raise SystemExit("error: --top needs --global-batch-size (the batch every layout must train)")
        plans, tried = search(lambda tp: model_architecture(config, vocab_size, tp), base, target, options.top,
                              options.margin)
        print(format_table(plans, tried, target))
        if plans:
            print("\nthe best layout in detail:\n" + format_plan(plans[0]))
        return 0 if plans else 1
    p = config.parallel
    used = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    if target.world_size % used:
        raise SystemExit(f"error: TP x PP x CP = {used} does not divide the cluster's {target.world_size} GPUs "
                         f"({target.nodes} nodes x {target.gpus_per_node})")
    from megatron.training.errors import ConfigError
    from megatron.training.validation import validate

    try:
        for note in validate(config, target.world_size):
            print(f"NOTE: {note}")
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from None
    plan = plan_for_flags(config, vocab_size, target.world_size, target, options.margin)
    print(format_plan(plan))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
