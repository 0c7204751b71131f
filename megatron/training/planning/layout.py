"""How a run is laid out and trained (everything the planner needs besides the architecture and
the hardware), read from the training flags in one place."""
import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron.core.parallel_layout import PipelineSplit
from megatron.core.pipeline_parallel.layout import decoder_layers_per_stage, split_virtual_size

_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    cp: int
    dp: int
    micro_batch_size: int
    global_batch_size: int
    seq_length: int
    precision: str = "bf16"                 # compute dtype: bf16, fp16 or fp32
    vpp: int = 1                            # model chunks per pipeline rank (interleaved schedule)
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    fsdp2: bool = False
    grad_reduce_in_bf16: bool = False
    optimizer: str = "adam"
    sgd_momentum: float = 0.9
    recompute_granularity: Optional[str] = None   # None, "selective" or "full"
    recompute_method: Optional[str] = None        # "uniform" or "block" (full)
    recompute_num_layers: Optional[int] = None
    fp8: bool = False
    fp8_layers: Optional[int] = None        # layers run in FP8 (None: all, with fp8)
    fused_elementwise: bool = True          # torch.compile'd RMSNorm/RoPE/SwiGLU (GPU default)
    attention_kernel: str = "flash"         # flash (no s x s tensor) or math (scores saved)
    cp_comm_type: str = "p2p"               # context parallelism: p2p (ring), all_gather, a2a, a2a+p2p
    device: str = "gpu"                     # "cpu": PyTorch's CPU kernels save some tensors wider
    cross_entropy_fusion: bool = True
    gradient_accumulation_fusion: bool = True  # weight-gradient GEMMs accumulate into main_grad
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    overlap_p2p_comm: bool = True           # pipeline sends/receives under compute (on by default here)
    split: PipelineSplit = PipelineSplit()  # uneven stages, embedding/loss counted as layers
    ep: int = 1                             # expert parallelism (folded from the TP x CP x DP ranks)
    etp: int = 1                            # expert tensor parallelism (1 or TP)
    moe_layer_recompute: bool = False       # each mixture-of-experts block re-run in backward
    moe_grouped_wgrad: str = "auto"         # the grouped experts' weight gradients into main_grad

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the copies of each expert, over which its gradients are
        reduced and the distributed optimizer shards its state."""
        return max(1, self.tp * self.cp * self.dp // (self.ep * self.etp))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def compute_bytes(self) -> int:
        return _BYTES[self.precision]

    @property
    def num_microbatches(self) -> int:
        return max(1, self.global_batch_size // (self.micro_batch_size * self.dp))

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    def layers_per_stage(self, num_layers: int) -> list:
        """Decoder layers built on each pipeline stage."""
        return decoder_layers_per_stage(num_layers, self.pp, self.split)

    def replace(self, **changes) -> "Layout":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}" + (f" x VPP{self.vpp}" if self.vpp > 1 else ""), f"CP{self.cp}",
                 f"DP{self.dp}"]
        if self.ep > 1 or self.etp > 1:
            parts.append(f"EP{self.ep} ETP{self.etp}")
        parts.append(f"mbs {self.micro_batch_size}")
        if self.sp:
            parts.append("SP")
        parts.append("FSDP2" if self.fsdp2 else ("dist-opt" if self.distributed_optimizer else "DDP"))
        if self.recompute_granularity == "full":
            parts.append(f"recompute full/{self.recompute_method}/{self.recompute_num_layers}")
        elif self.recompute_granularity == "selective":
            parts.append("recompute selective")
        if self.moe_layer_recompute:
            parts.append("MoE recompute")
        return " ".join(parts)


def layout_from_config(config, model_config, world_size: int) -> Layout:
    """The layout of a run with these flags on `world_size` GPUs (DP is what TP x PP x CP leaves).
    On the target GPU the elementwise chains are compiled unless --no-torch-compile, whatever the
    planning machine has."""
    from megatron.training.builders import parallel_layout

    t, m = config.training, model_config
    parallel = parallel_layout(config, world_size)
    precision = "bf16" if t.bf16 else ("fp16" if t.fp16 else "fp32")
    fp8_layers = None
    run = config.model  # how the layers run (FP8, loss fusion, attention kernel): the flags, not the architecture
    if run.fp8 and run.first_last_layers_bf16:
        fp8_layers = max(0, m.num_layers - run.num_layers_at_start_in_bf16 - run.num_layers_at_end_in_bf16)
    p = config.parallel
    return Layout(
        tp=parallel.tp, pp=parallel.pp, cp=parallel.cp, dp=parallel.dp, micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size or t.micro_batch_size * parallel.dp, seq_length=t.seq_length,
        precision=precision, vpp=split_virtual_size(m.num_layers, parallel.pp, parallel.pipeline_split), sequence_parallel=parallel.sequence_parallel,
        distributed_optimizer=p.use_distributed_optimizer, fsdp2=p.use_torch_fsdp2,
        grad_reduce_in_bf16=p.grad_reduce_in_bf16, optimizer=config.optimizer.optimizer,
        sgd_momentum=config.optimizer.sgd_momentum, recompute_granularity=t.recompute_granularity,
        recompute_method=t.recompute_method, recompute_num_layers=t.recompute_num_layers,
        fp8=bool(run.fp8), fp8_layers=fp8_layers, fused_elementwise=not config.model.no_torch_compile,
        cross_entropy_fusion=run.cross_entropy_loss_fusion, cp_comm_type=p.cp_comm_type,
        gradient_accumulation_fusion=run.gradient_accumulation_fusion,
        attention_kernel="math" if run.attention_backend in ("unfused", "local", "math") else "flash",
        overlap_grad_reduce=p.overlap_grad_reduce, overlap_p2p_comm=p.overlap_p2p_comm,
        overlap_param_gather=p.overlap_param_gather, split=parallel.pipeline_split,
        moe_grouped_wgrad=run.moe_grouped_wgrad,
        **_expert_layout(parallel, model_config, config.model.moe_layer_recompute))


def _expert_layout(parallel, model_config, moe_layer_recompute: bool) -> dict:
    """EP, ETP and --moe-layer-recompute of a mixture-of-experts run."""
    if model_config.num_experts is None:
        return {}
    return dict(ep=parallel.ep, etp=parallel.etp, moe_layer_recompute=moe_layer_recompute)
