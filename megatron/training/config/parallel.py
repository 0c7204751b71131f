"""Parallel layout and distributed-runtime flags."""
from dataclasses import dataclass
from typing import Literal, Optional

from megatron.core.transformer.config.fields import Flag, flag_field


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size: ranks that split each layer's weights."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size: stages the decoder layers are split into."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Layers per virtual stage (interleaved 1F1B schedule)."""
    num_virtual_stages_per_pipeline_rank: Optional[int] = None
    """Virtual stages per pipeline rank (alternative to --num-layers-per-virtual-pipeline-stage)."""
    decoder_first_pipeline_num_layers: Optional[int] = None
    """Layers on the first pipeline stage (uneven split); the rest are spread evenly."""
    decoder_last_pipeline_num_layers: Optional[int] = None
    """Layers on the last pipeline stage (uneven split); the rest are spread evenly."""
    expert_model_parallel_size: int = 1
    """Expert-parallel size: ranks that split the experts of each MoE layer, taken from the data- and context-parallel (and, with --expert-tensor-parallel-size 1, tensor-parallel) ranks."""
    expert_tensor_parallel_size: Optional[int] = None
    """Ranks that split each expert's hidden size: 1 or --tensor-model-parallel-size (the default)."""
    sequence_parallel: bool = False
    """Shard norms and dropout along the sequence across tensor-parallel ranks."""
    use_distributed_optimizer: bool = False
    """Shard fp32 master weights and optimizer state over data-parallel ranks (ZeRO-1)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with backward."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the next forward."""
    use_torch_fsdp2: bool = False
    """Shard parameters, gradients and optimizer state with PyTorch FSDP2."""
    ddp_bucket_size: Optional[int] = None
    """Elements per gradient-reduction bucket; default 40M (one bucket without overlap)."""
    grad_reduce_in_bf16: bool = False
    """Reduce gradients in bf16 instead of fp32."""
    ddp_average_in_collective: bool = False
    """Average gradients inside the collective instead of pre-scaling by 1/DP."""
    distributed_backend: Optional[Literal["nccl", "gloo"]] = None
    """Communication backend; default nccl when a GPU is present, else gloo."""
    distributed_timeout_minutes: float = 10
    """Timeout of every collective (all process groups, NCCL and gloo), in minutes (0.5 = 30 s): a rank that dies or hangs makes the others stop within it, naming it."""
    context_parallel_size: int = 1
    """Context-parallel size: ranks that split each sequence (2 chunks per rank, load-balanced for causal attention)."""
    cp_comm_type: Literal["p2p", "all_gather", "a2a", "a2a+p2p"] = "p2p"
    """Context-parallel attention: p2p (ring, overlapped), all_gather (K/V gathered) or a2a (heads split; heads and query groups per TP rank divisible by the CP size). a2a+p2p is not built."""
    overlap_param_gather_with_optimizer_step: bool = False
    """Start the first model chunk's parameter all-gathers while the other chunks' optimizer step runs (needs --overlap-param-gather and interleaved pipeline parallelism)."""
    overlap_p2p_comm: bool = flag_field(True, Flag(
        "--no-overlap-p2p-communication", "store_false",
        "Wait for each pipeline send/receive before computing (by default they overlap the computation)."))
    """Overlap pipeline point-to-point communication with computation: each receive is waited for just before its tensor is used (turned off with --no-overlap-p2p-communication)."""
    overlap_p2p_comm_warmup_flush: bool = flag_field(False, Flag("--overlap-p2p-communication-warmup-flush", "store_true"))
    """With the interleaved schedule, also post the warm-up's and cool-down's receives ahead of use."""
    microbatch_group_size_per_vp_stage: Optional[int] = flag_field(
        None, Flag("--microbatch-group-size-per-virtual-pipeline-stage"))
    """Interleaved schedule: micro-batches run on one virtual stage before moving to the next; default --pipeline-model-parallel-size."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one layer when splitting the decoder over pipeline stages (the first stage builds one layer fewer)."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer and loss as one layer when splitting the decoder over pipeline stages (the last stage builds one layer fewer)."""
