"""Cross-field checks run before anything expensive. Every message names the flags and values."""
import importlib.util
import os

from megatron.core.context_parallel import check_context_parallel
from megatron.core.distributed.ddp import validate_data_parallel
from megatron.core.parallel_state import check_sizes
from megatron.core.pipeline_parallel.layout import validate_pipeline
from megatron.training.config import Config


class ConfigError(ValueError):
    pass


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(config: Config, world_size: int) -> list:
    """Raises ConfigError on the first problem; returns notes to print (non-fatal adjustments)."""
    notes = []
    m, p, t = config.model, config.parallel, config.training
    for flag, value in (("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                        ("--num-attention-heads", m.num_attention_heads)):
        _require(value is not None, f"{flag} is required (--use-checkpoint-args found no checkpoint to take it from)")
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    try:
        dp = check_sizes(world_size, tp, pp, cp)
    except ValueError as error:
        raise ConfigError(str(error)) from None

    _require(not (t.bf16 and t.fp16), "--bf16 and --fp16 are mutually exclusive; pass one of them")
    for flag, value in (("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                        ("--num-attention-heads", m.num_attention_heads), ("--micro-batch-size", t.micro_batch_size),
                        ("--seq-length", t.seq_length), ("--train-iters", t.train_iters)):
        _require(value > 0, f"{flag} must be positive, got {value}")
    if m.kv_channels is None:
        _require(m.hidden_size % m.num_attention_heads == 0,
                 f"--hidden-size ({m.hidden_size}) must be divisible by --num-attention-heads "
                 f"({m.num_attention_heads}), or pass --kv-channels")
    _require(m.num_attention_heads % tp == 0,
             f"--num-attention-heads ({m.num_attention_heads}) must be divisible by "
             f"--tensor-model-parallel-size ({tp})")
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    _require(ffn % tp == 0, f"--ffn-hidden-size ({ffn}) must be divisible by --tensor-model-parallel-size ({tp})")
    if m.group_query_attention:
        groups = m.num_query_groups
        _require(m.num_attention_heads % groups == 0,
                 f"--num-attention-heads ({m.num_attention_heads}) must be divisible by --num-query-groups ({groups})")
        _require(groups % tp == 0 or tp % groups == 0,
                 f"--num-query-groups ({groups}) and --tensor-model-parallel-size ({tp}) must divide one another")
    max_positions = m.max_position_embeddings or t.seq_length
    _require(t.seq_length <= max_positions,
             f"--seq-length ({t.seq_length}) exceeds --max-position-embeddings ({max_positions})")

    global_batch = t.global_batch_size or t.micro_batch_size * dp
    _require(global_batch % (t.micro_batch_size * dp) == 0,
             f"--global-batch-size ({global_batch}) must be divisible by --micro-batch-size "
             f"({t.micro_batch_size}) x data-parallel size ({dp}) = {t.micro_batch_size * dp}")

    try:
        validate_pipeline(
            m.num_layers, pp,
            num_layers_per_virtual_stage=p.num_layers_per_virtual_pipeline_stage,
            num_virtual_stages_per_rank=p.num_virtual_stages_per_pipeline_rank,
            first_stage_layers=p.decoder_first_pipeline_num_layers,
            last_stage_layers=p.decoder_last_pipeline_num_layers,
            num_microbatches=global_batch // (t.micro_batch_size * dp))
    except ValueError as error:
        raise ConfigError(str(error)) from None

    try:
        validate_data_parallel(ddp_bucket_size=p.ddp_bucket_size, use_distributed_optimizer=p.use_distributed_optimizer,
                               overlap_param_gather=p.overlap_param_gather, use_torch_fsdp2=p.use_torch_fsdp2,
                               pipeline_model_parallel_size=pp)
    except ValueError as error:
        raise ConfigError(str(error)) from None

    if p.sequence_parallel and tp == 1:
        notes.append("--sequence-parallel has no effect with --tensor-model-parallel-size 1; disabled")
        p.sequence_parallel = False
    if p.sequence_parallel:
        _require(t.seq_length % tp == 0, f"--seq-length ({t.seq_length}) must be divisible by "
                                         f"--tensor-model-parallel-size ({tp}) with --sequence-parallel")
    _validate_context_parallel(config)

    if m.transformer_impl == "transformer_engine":
        if importlib.util.find_spec("transformer_engine") is None:
            raise ConfigError("--transformer-impl transformer_engine needs the transformer_engine package, which "
                              "is not installed; install it or use --transformer-impl local")
        raise ConfigError("--transformer-impl transformer_engine is not supported by this version; "
                          "use --transformer-impl local (the default)")
    if (not m.no_torch_compile and (p.distributed_backend or "nccl") == "nccl" and
            importlib.util.find_spec("triton") is None and _cuda_available()):
        notes.append("Triton is not installed, so RMSNorm/RoPE/SwiGLU run eagerly (unfused); "
                      "install triton for the torch.compile'd kernels")
    if m.use_flash_attn and importlib.util.find_spec("flash_attn") is None:
        notes.append("--use-flash-attn: the flash-attn package is not installed; using PyTorch SDPA "
                     "(its flash kernel on GPU)")

    if config.logging.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard-dir needs the tensorboard package, which is not installed: "
                          "pip install tensorboard (or drop --tensorboard-dir)")
    _validate_profiling(config)
    _validate_data(config, notes)
    _validate_schedule(config)
    _validate_checkpointing(config, notes)
    _validate_reliability(config)
    return notes


def _validate_reliability(config: Config) -> None:
    t, p, log = config.training, config.parallel, config.logging
    _require(p.distributed_timeout_minutes > 0,
             f"--distributed-timeout-minutes must be positive, got {p.distributed_timeout_minutes}")
    _require(not t.skip_iter_on_nan or t.check_for_nan_in_loss_and_grad,
             "--skip-iter-on-nan needs the NaN/Inf check: drop --no-check-for-nan-in-loss-and-grad")
    _require(t.max_skipped_iters >= 0, f"--max-skipped-iters must be >= 0, got {t.max_skipped_iters}")
    _require(t.spike_factor > 1, f"--spike-factor must be above 1, got {t.spike_factor}")
    _require(log.straggler_minmax_count >= 1, f"--straggler-minmax-count must be >= 1, got {log.straggler_minmax_count}")
    negative = [i for i in t.iterations_to_skip if i < 0]
    _require(not negative, f"--iterations-to-skip takes iteration numbers >= 0, got {negative}")


def _validate_checkpointing(config: Config, notes: list) -> None:
    c, t = config.checkpoint, config.training
    if c.ckpt_format in ("zarr", "fsdp_dtensor"):
        raise ConfigError(f"--ckpt-format {c.ckpt_format} is not supported; use --ckpt-format torch_dist (the default: "
                          "layout-independent, loads at any parallel layout)")
    if c.ckpt_format in ("torch", "torch_dcp"):
        notes.append(f"--ckpt-format {c.ckpt_format}: checkpoints are written in the one format of this framework "
                     "(torch_dist: torch.distributed.checkpoint, layout-independent)")
    for flag, value in (("--save-interval", c.save_interval), ("--ckpt-keep-latest", c.ckpt_keep_latest),
                        ("--exit-interval", t.exit_interval), ("--exit-duration-in-mins", t.exit_duration_in_mins)):
        _require(value is None or value > 0, f"{flag} must be positive, got {value}")
    for flag, value in (("--async-save", c.async_save), ("--save-interval", c.save_interval),
                        ("--ckpt-keep-latest", c.ckpt_keep_latest)):
        _require(not value or c.save, f"{flag} needs --save DIR")
    for flag, value in (("--ckpt-step", c.ckpt_step is not None), ("--use-checkpoint-args", c.use_checkpoint_args),
                        ("--finetune", c.finetune)):
        _require(not value or c.load, f"{flag} needs --load DIR")
    if c.save:
        _require(not os.path.exists(c.save) or os.path.isdir(c.save), f"--save {c.save} exists and is not a directory")
        parent = c.save if os.path.isdir(c.save) else os.path.dirname(os.path.abspath(c.save))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        _require(os.access(parent, os.W_OK | os.X_OK), f"--save {c.save}: {parent} is not writable")


def _validate_context_parallel(config: Config) -> None:
    """Sequence length, comm type, heads (a2a), dropout and masks that context parallelism can run."""
    m, p, t = config.model, config.parallel, config.training
    cp, tp = p.context_parallel_size, p.tensor_model_parallel_size
    if cp == 1:
        return
    groups = m.num_query_groups if m.group_query_attention else m.num_attention_heads
    try:
        check_context_parallel(cp_size=cp, comm_type=p.cp_comm_type, num_local_heads=m.num_attention_heads // tp,
                               num_local_groups=max(groups // tp, 1), attention_dropout=m.attention_dropout,
                               seq_length=t.seq_length)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if p.sequence_parallel:
        _require((t.seq_length // cp) % tp == 0,
                 f"--seq-length ({t.seq_length}) / --context-parallel-size ({cp}) = {t.seq_length // cp} tokens per "
                 f"context-parallel rank must be divisible by --tensor-model-parallel-size ({tp}) with "
                 "--sequence-parallel")
    _require(not config.data.reset_attention_mask,
             f"--reset-attention-mask is not supported with --context-parallel-size {cp}: context parallelism runs "
             "causal attention only (documents in a sample attend across EOD); drop --reset-attention-mask or use "
             "--context-parallel-size 1")


def _validate_data(config: Config, notes: list) -> None:
    d = config.data
    has_files = bool(d.data_path or d.train_data_path)
    _require(d.mock_data or has_files,
             "no training data: pass --data-path PREFIX (or --train-data-path), or --mock-data")
    _require(not (d.mock_data and has_files), "--mock-data and --data-path/--train-data-path are mutually exclusive")
    if d.tokenizer_type is None:
        _require(d.mock_data, "--tokenizer-type is required with --data-path")
        _require(d.vocab_size is not None,
                 "--mock-data without --tokenizer-type needs --vocab-size (or --tokenizer-type NullTokenizer --vocab-size N)")
    if d.tokenizer_type == "NullTokenizer":
        _require(d.vocab_size is not None and d.vocab_size > 1, "--tokenizer-type NullTokenizer needs --vocab-size N")
    if d.tokenizer_type == "GPT2BPETokenizer":
        _require(d.vocab_file is not None and d.merge_file is not None,
                 "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if d.tokenizer_type in ("SentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer"):
        _require(d.tokenizer_model is not None, f"--tokenizer-type {d.tokenizer_type} needs --tokenizer-model")


def _validate_profiling(config: Config) -> None:
    log = config.logging
    if not log.profile:
        return
    _require(0 <= log.profile_step_start < log.profile_step_end,
             f"--profile-step-start ({log.profile_step_start}) must be >= 0 and below --profile-step-end "
             f"({log.profile_step_end})")
    _require(log.profile_step_end <= config.training.train_iters,
             f"--profile-step-end ({log.profile_step_end}) exceeds --train-iters ({config.training.train_iters})")
    if not log.use_pytorch_profiler:
        _require(_cuda_available(),
                 "--profile without --use-pytorch-profiler marks a range for nsys and needs a GPU; "
                 "add --use-pytorch-profiler")


def _cuda_available() -> bool:
    from megatron.core.utils import accelerator_available

    return accelerator_available()


def _validate_schedule(config: Config) -> None:
    t, o = config.training, config.optimizer
    _require(t.eval_interval > 0, f"--eval-interval must be positive, got {t.eval_interval}")
    _require(t.eval_iters >= 0, f"--eval-iters must be >= 0, got {t.eval_iters}")
    _require(config.logging.log_interval > 0, f"--log-interval must be positive, got {config.logging.log_interval}")
    decay = o.lr_decay_iters or t.train_iters
    _require(o.lr_warmup_iters <= decay,
             f"--lr-warmup-iters ({o.lr_warmup_iters}) exceeds the decay iterations ({decay})")
    _require(o.min_lr <= o.lr, f"--min-lr ({o.min_lr}) exceeds --lr ({o.lr})")
    if o.lr_decay_style == "WSD":
        _require(o.lr_wsd_decay_iters is not None, "--lr-decay-style WSD needs --lr-wsd-decay-iters")
    if t.recompute_granularity == "full":
        _require(t.recompute_method is not None, "--recompute-granularity full needs --recompute-method uniform|block")
        _require(t.recompute_num_layers is not None and t.recompute_num_layers > 0,
                 "--recompute-granularity full needs --recompute-num-layers N (N > 0)")
    elif t.recompute_method is not None:
        raise ConfigError("--recompute-method needs --recompute-granularity full")
