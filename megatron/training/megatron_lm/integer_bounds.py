"""The lowest value of the integer flags whose zero or negative values Megatron-LM's parser and
validate_args let through and this framework refuses, each with the reason (tests/unit/test_integer_flags.py
checks every integer flag of upstream_flags.json against this table; docs/megatron-compatibility.md
shows it)."""
# {flag: (lowest value accepted, why)}; upstream_flags.json records the bounds upstream does check.
# Each reason says what upstream does with such a value.
_MODULO = "Megatron-LM takes the iteration number modulo it (ZeroDivisionError at 0; a negative N acts as -N)"
_WORLD_SPLIT = "Megatron-LM divides the world size by it (ZeroDivisionError at 0, no valid layout below)"
INTEGER_MINIMUMS = {
    "--num-layers": (1, "the model is built of at least one transformer layer"),
    "--hidden-size": (1, "a model width of 0 has no weights; Megatron-LM divides it among the attention heads"),
    "--num-attention-heads": (1, "Megatron-LM divides --hidden-size by it (ZeroDivisionError at 0)"),
    "--seq-length": (1, "a sample holds at least one token"),
    "--max-position-embeddings": (1, "Megatron-LM asserts it is at least --seq-length"),
    "--vocab-size": (2, "a vocabulary of fewer than two tokens has nothing to predict"),
    "--tensor-model-parallel-size": (1, _WORLD_SPLIT),
    "--pipeline-model-parallel-size": (1, _WORLD_SPLIT),
    "--context-parallel-size": (1, _WORLD_SPLIT),
    "--num-layers-per-virtual-pipeline-stage": (1, "Megatron-LM divides the layers of a stage by it "
                                                   "(ZeroDivisionError at 0)"),
    "--num-virtual-stages-per-pipeline-rank": (1, "Megatron-LM divides the layers of a stage by it "
                                                  "(ZeroDivisionError at 0)"),
    "--decoder-first-pipeline-num-layers": (1, "every pipeline stage holds at least one transformer layer here"),
    "--decoder-last-pipeline-num-layers": (1, "every pipeline stage holds at least one transformer layer here"),
    "--num-experts": (1, "Megatron-Core's TransformerConfig refuses num_moe_experts <= 0"),
    "--expert-model-parallel-size": (1, "Megatron-LM divides --num-experts by it (ZeroDivisionError at 0)"),
    "--expert-tensor-parallel-size": (1, "Megatron-LM divides the expert FFN width by it (ZeroDivisionError at 0)"),
    "--moe-router-topk": (1, "the router sends each token to at least one expert"),
    "--mtp-num-layers": (0, "Megatron-Core builds no prediction module at 0 (nor does this framework) and fails in "
                            "its first forward step at a negative count"),
    "--train-iters": (1, "pretrain_gpt.py trains at least one iteration (Megatron-LM skips training at 0 and "
                         "only evaluates, which is not built)"),
    "--train-samples": (1, "pretrain_gpt.py trains at least one global batch"),
    "--eval-interval": (1, "Megatron-LM divides --train-iters by it to size the validation set (ZeroDivisionError "
                           "at 0); --eval-iters 0 turns evaluation off"),
    "--log-interval": (1, _MODULO),
    "--tensorboard-log-interval": (1, _MODULO),
    "--exit-interval": (0, "Megatron-LM stops after the first iteration at a negative interval (Python's modulo); "
                           "0 turns it off"),
    "--exit-duration-in-mins": (0, "Megatron-LM stops after the first iteration at a negative duration; 0 turns it "
                                   "off"),
    "--manual-gc-interval": (0, "Megatron-LM asserts it is >= 0 with --manual-gc; 0 collects at evaluations and "
                                "saves only"),
    "--distributed-timeout-minutes": (1, "a timeout of 0 minutes fails every collective at once"),
    "--ddp-bucket-size": (1, "a gradient bucket holds at least one element"),
    "--straggler-minmax-count": (1, "the report names the N slowest and fastest ranks, N >= 1"),
    "--iterations-to-skip": (0, "iterations are numbered from 1; a negative one never comes"),
    "--lr-decay-iters": (0, "Megatron-LM's scheduler asserts a positive number of decay steps; 0 here decays over "
                            "the whole training"),
    "--rampup-batch-size": (1, "Megatron-LM's batch-size calculator asserts START and INCREMENT > 0 and divides by "
                               "SAMPLES per increment (ZeroDivisionError at 0)"),
    "--lr-decay-samples": (0, "Megatron-LM's scheduler asserts a positive number of decay steps; 0 here decays "
                              "over the whole training"),
}
