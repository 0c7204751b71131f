"""Builds this rank's model chunks, wraps them for data parallelism, and builds the optimizer.

The order in which wrappers are applied is fixed here and nowhere else:
  1. the model is built with tensor/sequence parallelism inside it (its layers take the TP group);
  2. pipeline parallelism decides which layers (and which chunks, when interleaved) this rank builds;
  3. parameters are initialized from the seed by global name (layout-independent);
  4. data parallelism wraps each chunk (gradient buffer and reduction);
  5. the optimizer is built over the wrapped chunks.
"""
import dataclasses
import importlib.util

import torch

from megatron.core.distributed.ddp import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    validate_data_parallel,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import LRScheduleConfig, OptimizerConfig, OptimizerParamScheduler, get_megatron_optimizer
from megatron.core.parallel_layout import ParallelLayout, PipelineSplit
from megatron.core.parallel_state import ParallelGroups
from megatron.core.pipeline_parallel.layout import split_layer_numbers
from megatron.core.transformer.attention import resolve_attention_backend, runs_batch_first
from megatron.core.transformer.config import ExecutionConfig, TransformerConfig, derive
from megatron.training.state import global_batch_size
from megatron.training.config import Config


def params_dtype(config: Config) -> torch.dtype:
    if config.training.bf16:
        return torch.bfloat16
    if config.training.fp16:
        return torch.float16
    return torch.float32


def fuse_elementwise(config: Config) -> bool:
    """torch.compile the elementwise chains: on GPU with Triton present, unless --no-torch-compile.
    (The device follows the hardware, not --distributed-backend.)"""
    from megatron.core.utils import accelerator_available

    return (not config.model.no_torch_compile and accelerator_available()
            and importlib.util.find_spec("triton") is not None)


def attention_backend(config: Config) -> str:
    """--attention-backend, with --use-flash-attn meaning flash_attn when the backend is left on auto."""
    m = config.model
    return "flash_attn" if m.use_flash_attn and m.attention_backend == "auto" else m.attention_backend


def transformer_config(config: Config, vocab_size: int) -> TransformerConfig:
    """The architecture the flags describe, derived (padded vocabulary, kv channels, FFN size, max
    positions) for this run's tensor-parallel size."""
    return derive(config.model, vocab_size=vocab_size, tp_size=config.parallel.tensor_model_parallel_size,
                  seq_length=config.training.seq_length)


def execution_config(config: Config) -> ExecutionConfig:
    """How this run computes the model: each field from the flag of its name (in whichever section
    holds it), and the few that the flags only imply."""
    sections = (config.model, config.parallel, config.training)
    values = {field.name: next(getattr(s, field.name) for s in sections if hasattr(s, field.name))
              for field in dataclasses.fields(ExecutionConfig) if any(hasattr(s, field.name) for s in sections)}
    values.update(params_dtype=params_dtype(config), fuse_elementwise=fuse_elementwise(config),
                  attention_backend=attention_backend(config),
                  gradient_accumulation_fusion=config.model.gradient_accumulation_fusion
                  and not config.parallel.use_torch_fsdp2)
    return ExecutionConfig(**values)


def resolve_attention(model_config: TransformerConfig, execution: ExecutionConfig, config: Config,
                      groups: ParallelGroups) -> tuple[ExecutionConfig, str]:
    """The attention kernel for this run (probed once on GPU for --attention-backend auto) and the
    log line naming it."""
    backend, report = resolve_attention_backend(
        execution.attention_backend, batch=config.training.micro_batch_size,
        heads=model_config.local_heads(groups.tp_size), groups=model_config.local_query_groups(groups.tp_size),
        seq=config.training.seq_length, head_dim=model_config.kv_channels, dtype=execution.params_dtype,
        device=groups.device,
        batch_first=runs_batch_first(config.training.micro_batch_size, config.training.seq_length,
                                     model_config.hidden_size,
                                     sequence_parallel=execution.sequence_parallel and groups.tp_size > 1,
                                     context_parallel=groups.cp_size > 1, fp8=bool(execution.fp8)))
    return dataclasses.replace(execution, attention_backend=backend), report


def parallel_layout(config: Config, world_size: int) -> ParallelLayout:
    """The layout the flags ask for on `world_size` ranks: the one place that reads the parallel
    sizes and the pipeline split from the flags. Raises ValueError, naming the flags, for sizes
    that do not make a layout. A dense model has no expert layout (its expert flags are checked,
    and refused, by validation)."""
    p, moe = config.parallel, config.model.num_experts is not None
    split = PipelineSplit(
        first_stage_layers=p.decoder_first_pipeline_num_layers, last_stage_layers=p.decoder_last_pipeline_num_layers,
        account_for_embedding=p.account_for_embedding_in_pipeline_split,
        account_for_loss=p.account_for_loss_in_pipeline_split,
        num_layers_per_virtual_stage=p.num_layers_per_virtual_pipeline_stage,
        num_virtual_stages_per_rank=p.num_virtual_stages_per_pipeline_rank,
        microbatch_group_size=p.microbatch_group_size_per_vp_stage)
    return ParallelLayout(world_size=world_size, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                          cp=p.context_parallel_size, ep=p.expert_model_parallel_size if moe else 1,
                          etp=p.expert_tensor_parallel_size if moe else None, sequence_parallel=p.sequence_parallel,
                          pipeline_split=split)


def build_model_chunks(config: Config, groups: ParallelGroups, model_config: TransformerConfig,
                       execution: ExecutionConfig, rng_tracker) -> list:
    """This rank's model chunks: the embedding goes to chunk 0 of the first pipeline rank, the final
    norm, output layer and loss to the last chunk of the last rank. With FSDP2 they are built on the
    meta device (no memory) and initialized shard by shard when wrapped (`wrap_data_parallel`)."""
    chunks = []
    layer_lists = split_layer_numbers(config.model.num_layers, groups.pp_size, groups.pp_rank, groups.layout.pipeline_split)
    device = torch.device("meta") if config.parallel.use_torch_fsdp2 else groups.device
    for index, layers in enumerate(layer_lists):
        first = groups.is_first_stage and index == 0
        last = groups.is_last_stage and index == len(layer_lists) - 1
        model = GPTModel(model_config, groups, execution=execution, rng_tracker=rng_tracker, pre_process=first,
                         post_process=last, layer_numbers=layers, device=device)
        if not config.parallel.use_torch_fsdp2:
            model.initialize_parameters(config.training.seed)
        chunks.append(model)
    return chunks


def wrap_data_parallel(chunks: list, config: Config, groups: ParallelGroups) -> list:
    """DDP with gradient buckets (and the distributed optimizer's parameter buffer), or FSDP2."""
    p = config.parallel
    if p.use_torch_fsdp2:
        from megatron.core.distributed.fsdp import FullyShardedDataParallel

        reduce_dtype = torch.bfloat16 if p.grad_reduce_in_bf16 else torch.float32
        return [FullyShardedDataParallel(chunk, groups, reduce_dtype=reduce_dtype, init_seed=config.training.seed)
                for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_bf16=p.grad_reduce_in_bf16, overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather, use_distributed_optimizer=p.use_distributed_optimizer,
        bucket_size=p.ddp_bucket_size, average_in_collective=p.ddp_average_in_collective,
        overlap_param_gather_with_optimizer_step=p.overlap_param_gather_with_optimizer_step)
    return [DistributedDataParallel(chunk, groups, ddp_config=ddp_config) for chunk in chunks]


def optimizer_config(config: Config) -> OptimizerConfig:
    o, t = config.optimizer, config.training
    return OptimizerConfig(
        optimizer=o.optimizer, lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, sgd_momentum=o.sgd_momentum, clip_grad=o.clip_grad,
        fp16=t.fp16, bf16=t.bf16, loss_scale=t.loss_scale, initial_loss_scale=t.initial_loss_scale,
        min_loss_scale=t.min_loss_scale, loss_scale_window=t.loss_scale_window, hysteresis=t.hysteresis,
        decoupled_lr=o.decoupled_lr, decoupled_min_lr=o.decoupled_min_lr)


def lr_schedule_config(config: Config, global_batch_size: int) -> LRScheduleConfig:
    """The schedule in samples (Megatron's unit): iteration-based flags times the global batch size."""
    o, t = config.optimizer, config.training
    if t.train_samples is None:
        decay_steps = (o.lr_decay_iters or t.train_iters) * global_batch_size
        warmup = o.lr_warmup_iters * global_batch_size
        wsd = o.lr_wsd_decay_iters * global_batch_size if o.lr_wsd_decay_iters is not None else None
    else:
        decay_steps = o.lr_decay_samples or t.train_samples
        warmup, wsd = o.lr_warmup_samples, o.lr_wsd_decay_samples
    if o.lr_warmup_fraction is not None:
        warmup = o.lr_warmup_fraction * decay_steps
    return LRScheduleConfig(max_lr=o.lr, min_lr=o.min_lr, warmup_steps=warmup, decay_steps=decay_steps,
                            decay_style=o.lr_decay_style, wsd_decay_steps=wsd, wsd_decay_style=o.lr_wsd_decay_style,
                            init_lr=o.lr_warmup_init)


def build_optimizer(config: Config, wrapped_chunks: list, groups: ParallelGroups):
    """The optimizer follows the wrapping: distributed (ZeRO-1) for chunks wrapped with
    --use-distributed-optimizer, sharded for FSDP2, else full fp32 masters on every rank."""
    optimizer = get_megatron_optimizer(optimizer_config(config), wrapped_chunks, groups)
    global_batch = global_batch_size(config.training, groups.dp_size)
    scheduler = OptimizerParamScheduler(optimizer, lr_schedule_config(config, global_batch))
    return optimizer, scheduler


def validate_data_parallel_config(config: Config, virtual_pipeline_size: int) -> None:
    """The data-parallel flag checks (`ddp.validate_data_parallel`) for a full config."""
    p = config.parallel
    validate_data_parallel(ddp_bucket_size=p.ddp_bucket_size, use_distributed_optimizer=p.use_distributed_optimizer,
                           overlap_param_gather=p.overlap_param_gather, use_torch_fsdp2=p.use_torch_fsdp2,
                           overlap_param_gather_with_optimizer_step=p.overlap_param_gather_with_optimizer_step,
                           virtual_pipeline_size=virtual_pipeline_size)
