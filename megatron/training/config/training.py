"""Batch, schedule, precision and optimizer flags."""
from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron.core.transformer.config.fields import Flag, flag_field


@dataclass
class TrainingConfig:
    micro_batch_size: int
    """Samples per micro-batch per data-parallel rank."""
    seq_length: int
    """Tokens per sample."""
    train_iters: Optional[int] = None
    """Optimizer steps to train for (or give --train-samples)."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step over all data-parallel ranks; default micro-batch x DP."""
    eval_interval: int = 1000
    """Evaluate on the validation set every this many iterations."""
    eval_iters: int = 100
    """Micro-batch steps (global batches) per evaluation."""
    seed: int = 1234
    """Random seed for initialization, dropout and data order."""
    bf16: bool = False
    """Train in bf16 with fp32 master weights."""
    fp16: bool = False
    """Train in fp16 with fp32 master weights and loss scaling."""
    loss_scale: Optional[float] = None
    """Constant loss scale for fp16; default dynamic scaling."""
    initial_loss_scale: float = 4294967296.0
    """Initial dynamic loss scale."""
    min_loss_scale: float = 1.0
    """Minimum dynamic loss scale."""
    loss_scale_window: int = 1000
    """Clean iterations before the dynamic loss scale grows."""
    hysteresis: int = 2
    """Overflowing iterations tolerated before the dynamic loss scale shrinks."""
    recompute_granularity: Optional[Literal["full", "selective"]] = None
    """Activation recomputation: full layers or the attention core only."""
    recompute_method: Optional[Literal["uniform", "block"]] = None
    """With full recompute: uniform (groups of layers) or block (the first N layers per stage)."""
    recompute_num_layers: Optional[int] = None
    """With full recompute: layers per group (uniform) or recomputed layers per stage (block)."""
    exit_interval: Optional[int] = None
    """Stop (saving a checkpoint first when --save is given) after an iteration number divisible by this."""
    exit_duration_in_mins: Optional[float] = None
    """Stop (saving first when --save is given) once this many minutes have passed since the job started; all ranks agree."""
    exit_signal_handler: bool = False
    """On SIGTERM or SIGUSR1 (Slurm's --signal), finish the current iteration, save when --save is given, and exit 0."""
    train_samples: Optional[int] = None
    """Train on this many samples instead of --train-iters (iterations: the samples over the global batch size, partial last batch dropped)."""
    rampup_batch_size: list = field(default_factory=list)
    """START INCREMENT SAMPLES: the global batch size starts at START and grows by INCREMENT in equal steps over SAMPLES samples up to --global-batch-size (needs --train-samples)."""
    calculate_per_token_loss: bool = False
    """Average the loss over the tokens of the whole global batch (not per micro-batch, then over micro-batches): each token weighs the same."""
    manual_gc: bool = False
    """Turn off Python's automatic garbage collector; collect every --manual-gc-interval iterations and around evaluations, so all ranks pause together."""
    manual_gc_interval: int = 0
    """With --manual-gc: collect every this many iterations (0: never between iterations)."""
    manual_gc_eval: bool = flag_field(True, Flag(
        "--no-manual-gc-eval", "store_false", "With --manual-gc: do not collect at the start and end of each evaluation."))
    """With --manual-gc: collect at the start and end of each evaluation (off with --no-manual-gc-eval)."""
    empty_unused_memory_level: Literal[0, 1, 2] = 0
    """Release cached, unused device memory: 1 after each forward-backward (and evaluation step), 2 also after each optimizer step."""
    dry_run: bool = False
    """Check the flags for WORLD_SIZE processes, print the layout and the plan for --dry-run-gpu (memory per GPU term by term with a verdict, predicted step time), and exit without building anything; stops with exit code 2 when the plan does not fit."""
    dry_run_gpu: Literal["h100-80gb", "h200", "a100-80gb", "mi300x"] = "h100-80gb"
    """With --dry-run: the GPU to plan for, with LOCAL_WORLD_SIZE GPUs per node (else 8) (this framework's own flag; tools/plan.py takes more targets)."""
    check_for_nan_in_loss_and_grad: bool = flag_field(True, Flag(
        "--no-check-for-nan-in-loss-and-grad", "store_false",
        "Do not stop (or, with --skip-iter-on-nan, skip the step) when the loss or the gradient norm is NaN or Inf."))
    """Stop every rank when the loss or the gradient norm is NaN or Inf on any rank, naming the iteration, the ranks and which; --no-check-for-nan-in-loss-and-grad turns the check off."""
    skip_iter_on_nan: bool = False
    """With the NaN/Inf check: skip such iterations (no update; counted as skipped and NaN iterations in the log line) instead of stopping (this framework's own flag)."""
    max_skipped_iters: int = 5
    """With --skip-iter-on-nan: stop once more than this many iterations in a row were NaN/Inf (this framework's own flag)."""
    check_for_large_grads: bool = False
    """Report a gradient norm --spike-factor times above the largest of the previous 100 iterations, with the iteration and the last checkpoint."""
    check_for_spiky_loss: bool = False
    """Report a rank's loss --spike-factor times above the largest of its previous 100 iterations, with the iteration and the last checkpoint."""
    spike_factor: float = 10.0
    """How far above its recent history a loss or gradient norm is a spike (this framework's own flag; Megatron's factor is 10)."""
    iterations_to_skip: list[int] = field(default_factory=list)
    """Skip these iterations entirely: their data is consumed, nothing is trained on it (Megatron's numbering: N skips the step that starts after N completed iterations)."""


@dataclass
class OptimizerArgs:
    lr: float
    """Peak learning rate."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer (adam is AdamW: decoupled weight decay)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "linear"
    """Shape of the learning-rate decay after warmup."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which to decay; default --train-iters."""
    lr_warmup_iters: int = 0
    """Iterations of linear warmup from 0."""
    lr_warmup_fraction: Optional[float] = None
    """Warmup as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)."""
    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    """Decay shape of the WSD tail."""
    lr_wsd_decay_iters: Optional[int] = None
    """Iterations of the WSD decay tail."""
    weight_decay: float = 0.01
    """Decoupled weight decay (not applied to norms and biases)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    sgd_momentum: float = 0.9
    """SGD momentum."""
    lr_decay_samples: Optional[int] = None
    """With --train-samples: samples over which to decay; default --train-samples."""
    lr_warmup_samples: int = 0
    """With --train-samples: samples of linear warmup."""
    lr_wsd_decay_samples: Optional[int] = None
    """With --train-samples: samples of the WSD decay tail."""
    lr_warmup_init: float = 0.0
    """Learning rate the warmup starts from."""
    decoupled_lr: Optional[float] = None
    """Peak learning rate of the word embedding and output layer (the rest follow --lr)."""
    decoupled_min_lr: Optional[float] = None
    """Final learning rate of the word embedding and output layer; default --min-lr."""
