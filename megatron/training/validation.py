"""Cross-field checks run before anything expensive. Every message names the flags and values."""
import copy
import dataclasses
import importlib.util
import json
import os
from typing import Optional

from megatron.core.context_parallel import check_context_parallel
from megatron.core.parallel_layout import check_expert_sizes
from megatron.core.pipeline_parallel.layout import validate_split
from megatron.core.transformer.moe.moe_utils import LOAD_BALANCING_TYPES
from megatron.training import megatron_lm
from megatron.training.arguments import as_flags  # the library's messages name fields; the user reads flags
from megatron.training.builders import parallel_layout, validate_data_parallel_config
from megatron.training.state import batch_schedule, global_batch_size
from megatron.core.transformer.config import derive
from megatron.training.config import Config
from megatron.training.errors import ConfigError  # noqa: F401 (raised here; its callers import it from here too)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(config: Config, world_size: int) -> list:
    """Raises ConfigError on the first problem; returns notes to print (non-fatal adjustments).
    `config` is not changed (see `resolve` for the config the notes describe)."""
    return resolve(config, world_size)[1]


def resolve(config: Config, world_size: int) -> tuple:
    """(the config with what the flags imply made explicit, notes): --train-iters from
    --train-samples, the blends of --data-args-path / --per-split-data-args-path, the tokenizer
    --vocab-file and --merge-file imply, --sequence-parallel off with one tensor-parallel rank, the
    PyTorch profiler for --profile without a GPU. Checks everything on the way (raises ConfigError);
    the given config is not changed."""
    config = copy.deepcopy(config)
    return config, _checked(config, world_size)


def _checked(config: Config, world_size: int) -> list:
    """The checks, in order, filling in the implied values of `config` (a private copy)."""
    notes = _megatron_lm_notes(config)
    m, p, t = config.model, config.parallel, config.training
    for flag, value in (("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                        ("--num-attention-heads", m.num_attention_heads)):
        _require(value is not None, f"{flag} is required (--use-checkpoint-args found no checkpoint to take it from)")
    try:
        layout = parallel_layout(config, world_size)
    except ValueError as error:
        raise ConfigError(as_flags(str(error))) from None
    tp, cp, dp = layout.tp, layout.cp, layout.dp

    _require(not (t.bf16 and t.fp16), "--bf16 and --fp16 are mutually exclusive; pass one of them")
    for flag, value in (("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                        ("--num-attention-heads", m.num_attention_heads), ("--micro-batch-size", t.micro_batch_size),
                        ("--seq-length", t.seq_length)):
        _require(value > 0, f"{flag} must be positive, got {value}")
    _validate_model_shape(config, tp)

    global_batch = global_batch_size(t, dp)
    _require(global_batch % (t.micro_batch_size * dp) == 0,
             f"--global-batch-size ({global_batch}) must be divisible by --micro-batch-size "
             f"({t.micro_batch_size}) x data-parallel size ({dp}) = {t.micro_batch_size * dp}")
    _validate_training_length(config, dp)

    try:
        for batch in batch_schedule(t, dp).batch_sizes():
            virtual_size = validate_split(m.num_layers, layout.pp, layout.pipeline_split,
                                          num_microbatches=batch // (t.micro_batch_size * dp))
        validate_data_parallel_config(config, virtual_size)
    except ValueError as error:
        raise ConfigError(as_flags(str(error))) from None

    if p.sequence_parallel and tp == 1:
        notes.append("--sequence-parallel has no effect with --tensor-model-parallel-size 1; disabled")
        p.sequence_parallel = False
    if p.sequence_parallel:
        _require(t.seq_length % tp == 0, f"--seq-length ({t.seq_length}) must be divisible by "
                                         f"--tensor-model-parallel-size ({tp}) with --sequence-parallel")
    _validate_context_parallel(config)
    _validate_moe(config, tp * cp * dp)

    _validate_kernels(config, notes)
    _validate_fp8(config)

    if config.logging.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard-dir needs the tensorboard package, which is not installed: "
                          "pip install tensorboard (or drop --tensorboard-dir)")
    _validate_profiling(config, notes)
    _validate_logging(config)
    _validate_data(config, notes)
    _validate_schedule(config, notes)
    _validate_checkpointing(config, notes)
    _validate_reliability(config)
    return notes


def _validate_model_shape(config: Config, tp: int) -> None:
    """Sizes that must divide one another (tensor parallelism included) and the sequence length."""
    m, t = config.model, config.training
    if m.kv_channels is None:
        _require(m.hidden_size % m.num_attention_heads == 0,
                 f"--hidden-size ({m.hidden_size}) must be divisible by --num-attention-heads "
                 f"({m.num_attention_heads}), or pass --kv-channels")
    _require(m.num_attention_heads % tp == 0,
             f"--num-attention-heads ({m.num_attention_heads}) must be divisible by "
             f"--tensor-model-parallel-size ({tp})")
    if m.group_query_attention:
        groups = m.num_query_groups
        _require(m.num_attention_heads % groups == 0,
                 f"--num-attention-heads ({m.num_attention_heads}) must be divisible by --num-query-groups ({groups})")
        _require(groups % tp == 0 or tp % groups == 0,
                 f"--num-query-groups ({groups}) and --tensor-model-parallel-size ({tp}) must divide one another")
    arch = architecture(config)
    ffn = arch.ffn_hidden_size
    _require(ffn % tp == 0, f"--ffn-hidden-size ({ffn}) must be divisible by --tensor-model-parallel-size ({tp})")
    max_positions = arch.max_position_embeddings
    _require(t.seq_length <= max_positions,
             f"--seq-length ({t.seq_length}) exceeds --max-position-embeddings ({max_positions})")


def _megatron_lm_notes(config: Config) -> list:
    """Notes for the given Megatron-LM flags this framework does not build; the first one that would
    change the result is an error."""
    try:
        notes = megatron_lm.check(config.megatron_lm_flags)
    except ValueError as error:
        raise ConfigError(as_flags(str(error))) from None
    _require("--no-position-embedding" not in config.megatron_lm_flags
             or config.model.position_embedding_type == "rope",
             "--no-position-embedding is deprecated in Megatron-LM and accepted with --position-embedding-type rope "
             "only; use --position-embedding-type none")
    return notes


def _validate_training_length(config: Config, dp: int) -> None:
    """Iteration-based (--train-iters) or sample-based (--train-samples) training, each with its own
    schedule flags, as Megatron-LM has them; a sample-based run gets its iteration count here."""
    t, o = config.training, config.optimizer
    if t.train_samples is None:
        _require(t.train_iters is not None, "give the length of training: --train-iters N (or --train-samples N)")
        _require(t.train_iters > 0, f"--train-iters must be positive, got {t.train_iters}")
        for flag, given in (("--lr-decay-samples", o.lr_decay_samples is not None),
                            ("--lr-warmup-samples", o.lr_warmup_samples != 0),
                            ("--lr-wsd-decay-samples", o.lr_wsd_decay_samples is not None),
                            ("--rampup-batch-size", bool(t.rampup_batch_size))):
            _require(not given, f"{flag} needs sample-based training: replace --train-iters by --train-samples "
                                "(as Megatron-LM requires)")
        _require(o.lr_warmup_fraction is None or o.lr_warmup_iters == 0,
                 "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive (as in Megatron-LM); give one")
        return
    _require(t.train_iters is None, "--train-iters and --train-samples are mutually exclusive; give one")
    _require(t.train_samples > 0, f"--train-samples must be positive, got {t.train_samples}")
    for flag, given in (("--lr-decay-iters", o.lr_decay_iters is not None), ("--lr-warmup-iters", o.lr_warmup_iters != 0),
                        ("--lr-wsd-decay-iters", o.lr_wsd_decay_iters is not None)):
        _require(not given, f"{flag} is for --train-iters; with --train-samples use {flag.replace('iters', 'samples')}")
    _require(o.lr_warmup_fraction is None or o.lr_warmup_samples == 0,
             "--lr-warmup-fraction and --lr-warmup-samples are mutually exclusive (as in Megatron-LM); give one")
    if t.rampup_batch_size:
        _validate_rampup(t, dp)
    t.train_iters = batch_schedule(t, dp).iterations_for(t.train_samples)
    _require(t.train_iters > 0, f"--train-samples ({t.train_samples}) is less than one global batch "
                                f"({global_batch_size(t, dp)})")


def _validate_rampup(t, dp: int) -> None:
    """START INCREMENT SAMPLES: every batch size of the ramp must split into micro-batches."""
    values = t.rampup_batch_size
    _require(len(values) == 3 and all(str(v).isdigit() for v in values),
             f"--rampup-batch-size takes three non-negative integers START INCREMENT SAMPLES, got {' '.join(values)}")
    start, increment, samples = (int(v) for v in values)
    final = global_batch_size(t, dp)
    step = t.micro_batch_size * dp
    _require(start > 0 and increment > 0 and samples > 0,
             f"--rampup-batch-size START ({start}), INCREMENT ({increment}) and SAMPLES ({samples}) must be positive")
    _require(start < final, f"--rampup-batch-size START ({start}) must be below --global-batch-size ({final})")
    _require((final - start) % increment == 0,
             f"--global-batch-size ({final}) - START ({start}) must be a multiple of INCREMENT ({increment}) "
             "in --rampup-batch-size")
    _require(start % step == 0 and increment % step == 0,
             f"--rampup-batch-size START ({start}) and INCREMENT ({increment}) must be multiples of --micro-batch-size "
             f"({t.micro_batch_size}) x data-parallel size ({dp}) = {step}, so that every batch size of the ramp splits "
             "into micro-batches")


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
    # Megatron-LM checks --save-interval only with --save: without it, any value saves nothing
    for flag, value in (("--save-interval", c.save_interval if c.save else None),
                        ("--ckpt-keep-latest", c.ckpt_keep_latest)):
        _require(value is None or value > 0, f"{flag} must be positive, got {value}")
    for flag, value in (("--exit-interval", t.exit_interval), ("--exit-duration-in-mins", t.exit_duration_in_mins)):
        _require(value is None or value >= 0, f"{flag} must be >= 0 (0 turns it off), got {value}")
        if value == 0:
            notes.append(f"{flag} 0: off (as in Megatron-LM)")
    _require(not c.ckpt_keep_latest or c.save, "--ckpt-keep-latest needs --save DIR")
    for flag, value in (("--save-interval", c.save_interval), ("--async-save", c.async_save)):
        if value and not c.save:  # Megatron-LM accepts these without --save and saves nothing
            notes.append(f"{flag} without --save: no checkpoint is saved (as in Megatron-LM); pass --save DIR to save")
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
    arch = architecture(config)
    # Multi-latent attention gives every head its own key and value (--num-query-groups aside).
    groups = arch.local_heads(tp) if arch.multi_latent_attention else arch.local_query_groups(tp)
    try:
        check_context_parallel(cp_size=cp, comm_type=p.cp_comm_type, num_local_heads=arch.local_heads(tp),
                               num_local_groups=groups, attention_dropout=m.attention_dropout,
                               seq_length=t.seq_length)
    except ValueError as error:
        raise ConfigError(as_flags(str(error))) from None
    if p.sequence_parallel:
        _require((t.seq_length // cp) % tp == 0,
                 f"--seq-length ({t.seq_length}) / --context-parallel-size ({cp}) = {t.seq_length // cp} tokens per "
                 f"context-parallel rank must be divisible by --tensor-model-parallel-size ({tp}) with "
                 "--sequence-parallel")
    _require(not config.data.reset_attention_mask,
             f"--reset-attention-mask is not supported with --context-parallel-size {cp}: context parallelism runs "
             "causal attention only (documents in a sample attend across EOD); drop --reset-attention-mask or use "
             "--context-parallel-size 1")
    _require(not m.mtp_num_layers,
             f"--mtp-num-layers is not supported with --context-parallel-size {cp}: each prediction depth shifts the "
             "tokens by one, which would cross the context-parallel chunks; use --context-parallel-size 1")


def _validate_kernels(config: Config, notes: list) -> None:
    """Implementation choices: Transformer Engine, attention kernels, fused cross entropy, compile."""
    m, p, d = config.model, config.parallel, config.data
    te_installed = importlib.util.find_spec("transformer_engine") is not None
    if m.transformer_impl == "transformer_engine":
        why = "its layers are not wired into this version" if te_installed else "it is not installed"
        notes.append(f"--transformer-impl transformer_engine: Transformer Engine is not used ({why}); running "
                     "the local implementation (plain PyTorch, FP8 through torch._scaled_mm)")
    if m.cross_entropy_fusion_impl == "te":
        notes.append("--cross-entropy-fusion-impl te: running the native fused cross entropy "
                     "(Transformer Engine's kernel is not used by this version)")
    if (not m.no_torch_compile and importlib.util.find_spec("triton") is None and _cuda_available()):
        notes.append("Triton is not installed, so RMSNorm/RoPE/SwiGLU run eagerly (unfused); "
                      "install triton for the torch.compile'd kernels")
    fp8_grouped = m.moe_router_padding_for_fp8 and m.fp8_recipe in ("tensorwise", "delayed")
    if m.moe_grouped_wgrad == "triton":
        _require(importlib.util.find_spec("triton") is not None,
                 "--moe-grouped-wgrad triton needs Triton (pip install triton); or use --moe-grouped-wgrad grouped-mm")
        _require(_cuda_available() or os.environ.get("TRITON_INTERPRET") == "1",
                 "--moe-grouped-wgrad triton runs its kernel on a CUDA GPU and none is visible (or in Triton's "
                 "interpreter, TRITON_INTERPRET=1); use --moe-grouped-wgrad grouped-mm")
    if m.moe_grouped_wgrad not in ("grouped-mm", "auto") and (not m.num_experts or not m.gradient_accumulation_fusion
                                                 or (m.fp8 and not fp8_grouped)):
        notes.append(f"--moe-grouped-wgrad {m.moe_grouped_wgrad} has no effect here: it takes the grouped experts' "
                     "weight gradients into main_grad (needs --num-experts and --gradient-accumulation-fusion; under "
                     "FP8 --moe-router-padding-for-fp8 with the tensorwise or delayed recipe)")
    if m.use_flash_attn:
        _require(m.attention_backend in ("auto", "flash", "flash_attn"),
                 f"--use-flash-attn conflicts with --attention-backend {m.attention_backend}; drop one of them")
    wants_package = m.use_flash_attn or m.attention_backend == "flash_attn"
    if wants_package and importlib.util.find_spec("flash_attn") is None:
        notes.append("--use-flash-attn / --attention-backend flash_attn: the flash-attn package is not installed; "
                     "using PyTorch SDPA's flash kernel instead")
    if p.use_torch_fsdp2 and m.gradient_accumulation_fusion:
        notes.append("--use-torch-fsdp2 keeps no main_grad buffers, so gradient accumulation fusion is off")
    if d.reset_attention_mask and not d.create_attention_mask_in_dataloader:
        notes.append("--reset-attention-mask with --no-create-attention-mask-in-dataloader: samples carry no "
                     "document boundaries, so attention stays causal over the whole sequence (as Megatron-LM)")
    if d.reset_attention_mask and d.create_attention_mask_in_dataloader and _cuda_available():
        _require(m.attention_dropout == 0.0,
                 f"--reset-attention-mask on GPU runs FlexAttention block masks, which have no dropout; "
                 f"pass --attention-dropout 0 (got {m.attention_dropout})")


def _validate_fp8(config: Config) -> None:
    m, t, p = config.model, config.training, config.parallel
    if m.fp8 is None:
        return
    from megatron.core.transformer.fp8 import check_fp8_options

    try:
        check_fp8_options(m.fp8, m.fp8_recipe, m.fp8_margin, m.fp8_amax_history_len, m.fp8_amax_compute_algo)
    except ValueError as error:
        raise ConfigError(as_flags(str(error))) from None
    _require(t.bf16, "--fp8-format needs --bf16 (FP8 GEMMs take bf16 inputs and write bf16 outputs)")
    _require(not p.use_torch_fsdp2, "--fp8-format with --use-torch-fsdp2 is not supported yet (cached FP8 "
                                    "weights follow DDP's parameter storage); drop one of them")
    tp = p.tensor_model_parallel_size
    arch = architecture(config)
    kv, groups, ffn = arch.kv_channels, arch.num_query_groups, arch.ffn_hidden_size
    sizes = {"--hidden-size": m.hidden_size, "--ffn-hidden-size / TP": ffn // tp,
             "attention heads x --kv-channels / TP": m.num_attention_heads * kv // tp,
             "query groups x --kv-channels": groups * kv,
             # the weight gradient's contracted dimension: a rank's tokens of a micro-batch
             "--micro-batch-size x --seq-length / --context-parallel-size":
                 t.micro_batch_size * t.seq_length // p.context_parallel_size}
    multiple = 128 if m.fp8_recipe == "blockwise" else 16  # blockwise: whole 1x128 tiles and 128x128 blocks
    needs = f"FP8 GEMMs{' with --fp8-recipe blockwise' if multiple == 128 else ''} need matrix sizes divisible by {multiple}"
    for what, size in sizes.items():
        _require(size % multiple == 0, f"{needs}: {what} is {size}")
    if m.fp8_recipe == "blockwise":
        _validate_blockwise(config)
    if m.first_last_layers_bf16:
        start, end = m.num_layers_at_start_in_bf16, m.num_layers_at_end_in_bf16
        _require(start >= 0 and end >= 0 and start + end <= m.num_layers,
                 f"--num-layers-at-start-in-bf16 ({start}) + --num-layers-at-end-in-bf16 ({end}) must be >= 0 "
                 f"and at most --num-layers ({m.num_layers})")
    _validate_fp8_weights(config, arch, multiple, needs)


def _validate_fp8_weights(config: Config, arch, multiple: int, needs: str) -> None:
    """Every weight the FP8 layers multiply, as a layer of each kind builds it on one rank (on the
    meta device, as the planner counts): the sizes above are the dense layers'; the routed and
    shared experts' and multi-latent attention's come from their own flags, which the GPU's FP8
    GEMMs would otherwise refuse at the first step (the CPU's take any size)."""
    from megatron.core.transformer.fp8 import fp8_layer_numbers
    from megatron.core.transformer.layer import TransformerLayer
    from megatron.training.planning import built

    m, p = config.model, config.parallel
    tp, ep = p.tensor_model_parallel_size, p.expert_model_parallel_size
    etp = tp if p.expert_tensor_parallel_size is None else p.expert_tensor_parallel_size
    if arch.padded_vocab_size is None:  # (the tokenizer's, not known yet; no layer's weight has it)
        arch = dataclasses.replace(arch, padded_vocab_size=128 * tp)
    kinds = sorted({TransformerLayer.kind(arch, number) for number in fp8_layer_numbers(m, m.num_layers)})
    for kind in kinds:
        for name, shape in built.fp8_weight_shapes(arch, built.model_key(arch), kind, tp, ep, etp):
            if all(size % multiple == 0 for size in shape[-2:]):
                continue
            if ".experts." in f".{name}" and "shared" not in name:
                source = (f"--moe-ffn-hidden-size ({arch.moe_ffn_hidden_size}) / --expert-tensor-parallel-size "
                          f"({etp}), and --hidden-size")
            elif "shared" in name:
                source = (f"--moe-shared-expert-intermediate-size ({arch.moe_shared_expert_intermediate_size}) / "
                          f"--tensor-model-parallel-size ({tp}), and --hidden-size")
            else:
                source = f"the model's sizes / --tensor-model-parallel-size ({tp})"
            raise ConfigError(f"{needs}: a {kind} layer's {name} is {list(shape)} on each rank (from {source})")


def _validate_blockwise(config: Config) -> None:
    """What can be known before a device is chosen: PyTorch's block-scaled GEMM, a GPU at all, and
    dense layers (the experts' FP8 GEMMs are tensorwise, delayed or rowwise). The GPU itself is
    checked when the model is built (`fp8.blockwise_unavailable`)."""
    from megatron.core.transformer.fp8 import blockwise_refusal, has_block_scaled_gemm

    m = config.model
    if not has_block_scaled_gemm() or not _cuda_available():
        reason = blockwise_refusal(has_block_scaled_gemm(), "cuda" if _cuda_available() else "cpu", (9, 0), None)
        raise ConfigError(f"--fp8-recipe blockwise cannot run here: {reason}; use --fp8-recipe tensorwise, "
                          f"delayed or rowwise")
    _require(m.num_experts is None, f"--fp8-recipe blockwise runs the dense layers' GEMMs; with --num-experts "
                                    f"({m.num_experts}) use --fp8-recipe tensorwise, delayed or rowwise")


def architecture(config: Config):
    """The architecture the model flags describe (derived; the vocabulary is left out: it comes
    from the tokenizer). Call after the shape checks above: it raises ConfigError otherwise."""
    try:
        return derive(config.model, seq_length=config.training.seq_length)
    except ValueError as error:
        raise ConfigError(as_flags(str(error))) from None


def implied_tokenizer_type(data_config) -> Optional[str]:
    """--tokenizer-type, or GPT2BPETokenizer when only its --vocab-file and --merge-file are given
    (as Megatron-LM's GPT-3 example passes them)."""
    d = data_config
    return d.tokenizer_type or ("GPT2BPETokenizer" if d.vocab_file and d.merge_file else None)


def _read_data_args(config: Config) -> None:
    """--data-args-path / --per-split-data-args-path: the blend lists from files, as Megatron-LM reads them."""
    d = config.data
    if d.data_args_path is not None:
        _require(not d.data_path, "--data-args-path and --data-path are mutually exclusive; give one")
        _require(os.path.isfile(d.data_args_path), f"--data-args-path {d.data_args_path}: no such file")
        with open(d.data_args_path) as handle:
            d.data_path = handle.read().split()
        _require(bool(d.data_path), f"--data-args-path {d.data_args_path} is empty; it should hold the --data-path value")
    if d.per_split_data_args_path is not None:
        path = d.per_split_data_args_path
        _require(not (d.train_data_path or d.valid_data_path or d.test_data_path),
                 "--per-split-data-args-path and --train/--valid/--test-data-path are mutually exclusive; give one")
        _require(os.path.isfile(path), f"--per-split-data-args-path {path}: no such file")
        try:
            with open(path) as handle:
                splits = json.load(handle)
        except json.JSONDecodeError as error:
            raise ConfigError(f"--per-split-data-args-path {path} is not JSON ({error})") from None
        _require(isinstance(splits, dict) and {"train", "valid", "test"} <= set(splits),
                 f"--per-split-data-args-path {path} must be a JSON object with keys train, valid and test")
        d.train_data_path, d.valid_data_path, d.test_data_path = (
            splits[name].split() if isinstance(splits[name], str) else [str(v) for v in splits[name] or []]
            for name in ("train", "valid", "test"))


def _validate_data(config: Config, notes: list) -> None:
    _read_data_args(config)
    d = config.data
    _require(d.dataloader_type != "external",
             "--dataloader-type external passes a user's own data loader through (Megatron-LM's hook for custom "
             "training scripts); pretrain_gpt.py builds its loader: use --dataloader-type single or cyclic")
    if d.reset_attention_mask and not d.create_attention_mask_in_dataloader:
        notes.append("--no-create-attention-mask-in-dataloader: samples carry no document mask, so attention is causal "
                     "across documents despite --reset-attention-mask (as in Megatron-LM)")
    has_files = bool(d.data_path or d.train_data_path)
    _require(d.mock_data or has_files,
             "no training data: pass --data-path PREFIX (or --train-data-path), or --mock-data")
    _require(not (d.mock_data and has_files), "--mock-data and --data-path/--train-data-path are mutually exclusive")
    if d.tokenizer_type is None and implied_tokenizer_type(d):
        d.tokenizer_type = implied_tokenizer_type(d)
        notes.append("--vocab-file and --merge-file without --tokenizer-type: using GPT2BPETokenizer")
    if d.tokenizer_type is None:
        _require(d.mock_data, "--tokenizer-type is required with --data-path")
        _require(d.vocab_size is not None,
                 "--mock-data without --tokenizer-type needs --vocab-size (or --tokenizer-type NullTokenizer --vocab-size N)")
    if d.tokenizer_type == "NullTokenizer":
        _require(d.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size N")
        _require(d.vocab_size > 1, f"--vocab-size must be above 1 with --tokenizer-type NullTokenizer, got {d.vocab_size}")
    if d.tokenizer_type == "GPT2BPETokenizer":
        _require(d.vocab_file is not None and d.merge_file is not None,
                 "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if d.tokenizer_type in ("SentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer"):
        _require(d.tokenizer_model is not None, f"--tokenizer-type {d.tokenizer_type} needs --tokenizer-model")
    if d.sft:
        _validate_sft(config)


def _validate_sft(config: Config) -> None:
    """--sft: conversations tokenized by a Hugging Face tokenizer, packed with per-conversation attention."""
    from megatron.core.datasets.sft import check_prompt_format

    d = config.data
    try:
        check_prompt_format(d.sft_tokenizer_prompt_format)
    except ValueError as error:
        raise ConfigError(as_flags(str(error))) from None
    _require(not d.mock_data, "--sft reads JSONL conversations from --data-path; drop --mock-data")
    _require(d.tokenizer_type == "HuggingFaceTokenizer",
             f"--sft needs --tokenizer-type HuggingFaceTokenizer (got {d.tokenizer_type}): conversations are "
             "rendered by its chat template and tokenized turn by turn")
    _require(d.create_attention_mask_in_dataloader,
             "--sft with --no-create-attention-mask-in-dataloader would let packed conversations attend to each "
             "other; drop --no-create-attention-mask-in-dataloader")
    if _cuda_available():
        _require(config.model.attention_dropout == 0.0,
                 f"--sft on GPU runs FlexAttention block masks (one conversation per document), which have no "
                 f"dropout; pass --attention-dropout 0 (got {config.model.attention_dropout})")
    _require(not (d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss),
             "--reset-position-ids, --reset-attention-mask and --eod-mask-loss act on EOD-separated pretraining "
             "documents; --sft packs conversations with their own positions, attention and loss mask: drop them")


def _validate_logging(config: Config) -> None:
    log, t, o = config.logging, config.training, config.optimizer
    _require(log.tensorboard_log_interval > 0,
             f"--tensorboard-log-interval must be positive, got {log.tensorboard_log_interval}")
    _require(t.manual_gc_interval >= 0, f"--manual-gc-interval must be >= 0, got {t.manual_gc_interval}")
    _require(not log.log_progress or config.checkpoint.save, "--log-progress writes progress.txt into --save DIR; give --save")
    _require(o.decoupled_min_lr is None or o.decoupled_lr is not None, "--decoupled-min-lr needs --decoupled-lr")


def _validate_profiling(config: Config, notes: list) -> None:
    log = config.logging
    if not log.profile:
        return
    _require(0 <= log.profile_step_start < log.profile_step_end,
             f"--profile-step-start ({log.profile_step_start}) must be >= 0 and below --profile-step-end "
             f"({log.profile_step_end})")
    t = config.training
    length = "--train-iters" if t.train_samples is None else "the iterations of --train-samples"
    _require(log.profile_step_end <= t.train_iters,
             f"--profile-step-end ({log.profile_step_end}) exceeds {length} ({t.train_iters})")
    if not log.use_pytorch_profiler and not _cuda_available():
        notes.append("--profile: no GPU for an nsys capture range, so the PyTorch profiler records instead "
                     "(as with --use-pytorch-profiler): a Chrome trace per profiled rank")
        log.use_pytorch_profiler = True


def _cuda_available() -> bool:
    from megatron.core.utils import accelerator_available

    return accelerator_available()


def _validate_schedule(config: Config, notes: list) -> None:
    t, o = config.training, config.optimizer
    _require(t.eval_interval > 0, f"--eval-interval must be positive, got {t.eval_interval}")
    if t.eval_iters < 0:
        notes.append(f"--eval-iters {t.eval_iters}: no evaluation (as in Megatron-LM, where 0 or a negative number "
                     "turns it off)")
    _require(config.logging.log_interval > 0, f"--log-interval must be positive, got {config.logging.log_interval}")
    for flag, value in (("--lr-decay-iters", o.lr_decay_iters), ("--lr-decay-samples", o.lr_decay_samples)):
        _require(value is None or value >= 0, f"{flag} must be >= 0 (0: the length of training), got {value}")
    unit = "iters" if t.train_samples is None else "samples"
    decay = (o.lr_decay_iters or t.train_iters) if unit == "iters" else (o.lr_decay_samples or t.train_samples)
    warmup = o.lr_warmup_iters if unit == "iters" else o.lr_warmup_samples
    _require(warmup <= decay, f"--lr-warmup-{unit} ({warmup}) exceeds the decay {unit} ({decay})")
    _require(o.min_lr <= o.lr, f"--min-lr ({o.min_lr}) exceeds --lr ({o.lr})")
    _require(o.lr_warmup_init <= o.lr, f"--lr-warmup-init ({o.lr_warmup_init}) exceeds --lr ({o.lr})")
    if o.lr_decay_style == "WSD":
        tail = o.lr_wsd_decay_iters if unit == "iters" else o.lr_wsd_decay_samples
        _require(tail is not None, f"--lr-decay-style WSD needs --lr-wsd-decay-{unit}")
    if t.recompute_granularity == "full":
        _require(t.recompute_method is not None, "--recompute-granularity full needs --recompute-method uniform|block")
        _require(t.recompute_num_layers is not None and t.recompute_num_layers > 0,
                 "--recompute-granularity full needs --recompute-num-layers N (N > 0)")
    elif t.recompute_method is not None:
        raise ConfigError("--recompute-method needs --recompute-granularity full")


def check_expert_layout(*, num_experts: int, expert_ffn: int, tp: int, ep: int, etp: int, stage_ranks: int,
                        sequence_parallel: bool, fsdp2: bool) -> None:
    """The expert layout's rules (start-up validation and the planner's layout search): raises
    ConfigError naming the flags. `stage_ranks`: TP x CP x DP, the ranks EP x ETP is folded from."""
    _require(ep >= 1 and etp >= 1,
             f"--expert-model-parallel-size ({ep}) and --expert-tensor-parallel-size ({etp}) must be >= 1")
    _require(num_experts % ep == 0, f"--num-experts ({num_experts}) must be divisible by "
                                    f"--expert-model-parallel-size ({ep})")
    try:
        check_expert_sizes(stage_ranks, ep, etp)
    except ValueError as error:
        raise ConfigError(as_flags(str(error))) from None
    _require(etp in (1, tp), f"--expert-tensor-parallel-size ({etp}) must be 1 or --tensor-model-parallel-size ({tp})")
    _require(expert_ffn % etp == 0, f"--moe-ffn-hidden-size ({expert_ffn}) must be divisible by "
                                    f"--expert-tensor-parallel-size ({etp})")
    _require(tp == 1 or sequence_parallel, f"mixture of experts with --tensor-model-parallel-size {tp} needs "
                                           "--sequence-parallel (as in Megatron-LM)")
    _require(not fsdp2, "--use-torch-fsdp2 with --num-experts is not built; use "
                        "--use-distributed-optimizer for sharded optimizer state")


def _validate_moe(config: Config, stage_ranks: int) -> None:
    """Mixture-of-experts flags against each other and the layout (before the model is built)."""
    m, p = config.model, config.parallel
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    etp = tp if p.expert_tensor_parallel_size is None else p.expert_tensor_parallel_size
    if m.num_experts is None:
        _require(ep == 1, f"--expert-model-parallel-size {ep} needs --num-experts (a mixture-of-experts model)")
        return
    experts, topk = m.num_experts, m.moe_router_topk
    _require(experts >= 1, f"--num-experts must be >= 1, got {experts}")
    derived = architecture(config)  # --moe-layer-freq checked against --num-layers; the expert size filled in
    check_expert_layout(num_experts=experts, expert_ffn=derived.moe_ffn_hidden_size,
                        tp=tp, ep=ep, etp=etp, stage_ranks=stage_ranks, sequence_parallel=p.sequence_parallel,
                        fsdp2=p.use_torch_fsdp2)
    _require(1 <= topk <= experts, f"--moe-router-topk ({topk}) must be between 1 and --num-experts ({experts})")
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    # As Megatron-Core: --moe-router-group-topk turns group-limited routing on and needs the groups;
    # --moe-router-num-groups alone routes over all experts (the ROCm fork's DeepSeek-V3 script passes 1).
    _require(group_topk is None or groups is not None, f"group-limited routing (--moe-router-group-topk "
                                                       f"{group_topk}) needs --moe-router-num-groups")
    if group_topk is not None:
        _require(experts % groups == 0, f"--num-experts ({experts}) must be divisible by --moe-router-num-groups "
                                        f"({groups})")
        _require(1 <= group_topk <= groups and topk % group_topk == 0 and topk // group_topk <= experts // groups,
                 f"--moe-router-group-topk ({group_topk}) must be between 1 and --moe-router-num-groups ({groups}) "
                 f"and divide --moe-router-topk ({topk}) into at most {experts // groups} experts per group")
    if m.moe_expert_capacity_factor is None:
        _require(not m.moe_pad_expert_input_to_capacity,
                 "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        _require(m.moe_token_drop_policy == "probs",
                 f"--moe-token-drop-policy {m.moe_token_drop_policy} needs --moe-expert-capacity-factor")
    _require(m.moe_token_dispatcher_type != "flex", "--moe-token-dispatcher-type flex needs DeepEP, which is not "
                                                    "built; use alltoall or allgather")
    _validate_moe_losses(config)


def _validate_moe_losses(config: Config) -> None:
    m = config.model
    types, coeffs = list(m.moe_router_load_balancing_type), list(m.moe_aux_loss_coeff)
    for kind in types:
        _require(kind in LOAD_BALANCING_TYPES, f"--moe-router-load-balancing-type {kind} is not built; use one of "
                                               f"{', '.join(LOAD_BALANCING_TYPES)}")
    _require(len(coeffs) in (1, len(types)), f"--moe-aux-loss-coeff has {len(coeffs)} values for the "
                                             f"{len(types)} --moe-router-load-balancing-type values {types}")
    uses_aux = any(c > 0 for c in coeffs) or m.moe_z_loss_coeff is not None
    _require(not (uses_aux and config.training.calculate_per_token_loss),
             "--calculate-per-token-loss with the MoE auxiliary losses (--moe-aux-loss-coeff, --moe-z-loss-coeff) "
             "is not built; drop one of them")
    if m.moe_router_enable_expert_bias:
        _require(m.moe_router_score_function == "sigmoid", "--moe-router-enable-expert-bias needs "
                                                           "--moe-router-score-function sigmoid (as Megatron-LM)")
