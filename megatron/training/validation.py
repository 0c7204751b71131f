"""Cross-field checks run before anything expensive. Every message names the flags and values."""
import importlib.util

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
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    try:
        dp = check_sizes(world_size, tp, pp, 1)
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
        virtual_size = validate_pipeline(
            m.num_layers, pp,
            num_layers_per_virtual_stage=p.num_layers_per_virtual_pipeline_stage,
            num_virtual_stages_per_rank=p.num_virtual_stages_per_pipeline_rank,
            first_stage_layers=p.decoder_first_pipeline_num_layers,
            last_stage_layers=p.decoder_last_pipeline_num_layers,
            num_microbatches=global_batch // (t.micro_batch_size * dp),
            account_for_embedding=p.account_for_embedding_in_pipeline_split,
            account_for_loss=p.account_for_loss_in_pipeline_split,
            microbatch_group_size=p.microbatch_group_size_per_vp_stage)
        validate_data_parallel(ddp_bucket_size=p.ddp_bucket_size, use_distributed_optimizer=p.use_distributed_optimizer,
                               overlap_param_gather=p.overlap_param_gather, use_torch_fsdp2=p.use_torch_fsdp2,
                               overlap_param_gather_with_optimizer_step=p.overlap_param_gather_with_optimizer_step,
                               virtual_pipeline_size=virtual_size)
    except ValueError as error:
        raise ConfigError(str(error)) from None

    if p.sequence_parallel and tp == 1:
        notes.append("--sequence-parallel has no effect with --tensor-model-parallel-size 1; disabled")
        p.sequence_parallel = False
    if p.sequence_parallel:
        _require(t.seq_length % tp == 0, f"--seq-length ({t.seq_length}) must be divisible by "
                                         f"--tensor-model-parallel-size ({tp}) with --sequence-parallel")

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
    return notes


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
