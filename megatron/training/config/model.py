"""The model section of the flags: the architecture (megatron.core's TransformerConfig, whose
fields are Megatron-LM's model flags) plus the flags that choose how the model runs (kernels, FP8),
which become its ExecutionConfig (builders.execution_config)."""
from argparse import BooleanOptionalAction
from dataclasses import dataclass
from typing import Literal, Optional

from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.config.fields import Flag, flag_field


@dataclass
class ModelConfig(TransformerConfig):
    use_flash_attn: bool = False
    """Use the flash-attn package if installed (otherwise SDPA's flash kernel)."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """Layer implementation: local (plain PyTorch) or transformer_engine."""
    no_torch_compile: bool = False
    """Run RMSNorm, RoPE and SwiGLU eagerly. By default they are torch.compile'd into fused kernels on GPU (never on CPU)."""
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local", "cudnn", "efficient", "math",
                               "flash_attn"] = "auto"
    """Attention kernel. auto: probed once at start-up on GPU (the fastest that runs; the log names it). Megatron's flash / fused / unfused|local map to SDPA's flash / cuDNN (then memory-efficient) / math kernels; cudnn, efficient, math pick one SDPA kernel; flash_attn the flash-attn package (FA3 on Hopper when installed)."""
    gradient_accumulation_fusion: bool = flag_field(True, Flag("--gradient-accumulation-fusion", BooleanOptionalAction))
    """Accumulate linear and embedding weight gradients straight into the fp32 main_grad buffers (no param.grad); off with --no-gradient-accumulation-fusion. Not with --use-torch-fsdp2 (no main_grad there)."""
    cross_entropy_loss_fusion: bool = flag_field(True, Flag("--cross-entropy-loss-fusion", BooleanOptionalAction))
    """Chunked fused cross entropy: no fp32 copy of the logits, gradient written in place; off with --no-cross-entropy-loss-fusion."""
    cross_entropy_fusion_impl: Literal["native", "te"] = "native"
    """Fused cross entropy implementation: native; te runs the native one too (with a note)."""
    fp8: Optional[Literal["e4m3", "hybrid"]] = flag_field(None, Flag("--fp8-format"))
    """Train the transformer layers' linears in FP8 (torch._scaled_mm): e4m3 everywhere, or hybrid (E5M2 gradients)."""
    fp8_recipe: Literal["delayed", "tensorwise", "rowwise", "blockwise", "mxfp8", "custom"] = "delayed"
    """FP8 scaling: delayed (amax history), tensorwise (current amax), rowwise (per-row scales, e4m3), blockwise (1x128 activation and gradient tiles, 128x128 weight blocks, e4m3; PyTorch's block-scaled GEMM, Hopper GPUs). mxfp8 and custom need Transformer Engine and are errors here."""
    fp8_margin: int = 0
    """FP8 scales are divided by 2^margin."""
    fp8_amax_history_len: int = 1
    """Micro-batches of amax history kept by the delayed recipe."""
    fp8_amax_compute_algo: Literal["most_recent", "max"] = "most_recent"
    """How the delayed recipe reduces the amax history: most_recent or max."""
    first_last_layers_bf16: bool = False
    """With FP8: keep the first --num-layers-at-start-in-bf16 and last --num-layers-at-end-in-bf16 layers in bf16."""
    num_layers_at_start_in_bf16: int = 1
    """Layers at the start kept in bf16 with --first-last-layers-bf16."""
    num_layers_at_end_in_bf16: int = 1
    """Layers at the end kept in bf16 with --first-last-layers-bf16."""
    moe_permute_fusion: bool = False
    """Mixture of experts: permute the tokens (one sort, one gather) and unpermute them (one probability-weighted scatter-add) as torch.compile'd functions, fused into fewer kernels (Megatron-Core uses Transformer Engine's); eager PyTorch ops otherwise, with the same result."""
    moe_router_fusion: bool = False
    """Mixture of experts: the router's score function, top-k, normalization and auxiliary-loss scores as one torch.compile'd function (Megatron-Core uses Transformer Engine's fused kernels); eager PyTorch ops otherwise, with the same result."""
    moe_router_padding_for_fp8: bool = False
    """Mixture of experts in FP8 (alltoall dispatcher): pad the routing map so that each expert's token count is a multiple of 16, routing to it with probability 0 the first tokens not routed to it (as Megatron-Core does), instead of padding the experts' rows; the FP8 experts then run with their row counts on the device (no host synchronization at expert-parallel size 1, tensorwise and delayed recipes). Needs the tokens per rank and micro-batch to be a multiple of 16."""
    moe_grouped_wgrad: Literal["auto", "grouped-mm", "triton", "per-expert"] = "auto"
    """Mixture of experts with --gradient-accumulation-fusion: how the grouped experts' weight gradients reach main_grad. auto (the default): on a GPU each kind of experts module is timed once at start-up with grouped-mm and with per-expert (one forward and backward of its weights on the rows a micro-batch gives each expert, into stand-in gradients) and takes the faster, per-expert only when at least 5% faster (FP8 experts also time per-expert with the weight gradients of a step's later micro-batches as bf16 GEMMs of the widened casts accumulating into main_grad, instead of FP8 products added to it); the start-up fast-paths line gives the times and the choice; the CPU runs grouped-mm. grouped-mm: one torch._grouped_mm product per weight and micro-batch, added into main_grad in one pass (compiled on GPU). triton: a Triton grouped GEMM that adds each expert's gradient into main_grad as it stores it (no product tensor, half the memory traffic; CUDA with Triton installed; bf16, and FP8 experts on --moe-router-padding-for-fp8 with tensorwise or delayed scaling, from their casts, where under hybrid the E5M2 input gradients run as a Triton grouped GEMM too, FP8 tiles widened to fp16 in registers). Measured on an H200: as fast as grouped-mm on Qwen3-30B-A3B's shapes, 5% slower on Mixtral 8x7B's. per-expert: one GEMM per local expert accumulating into its main_grad slice (on the GPU cuBLAS with an fp32 output, no product tensor and no pass after it), as Megatron-Core's grouped linear does; the row counts are copied to the host without waiting when the forward routes, so the backward reads them with no stall; the work grows with the local expert count, so it is for a few large experts (Mixtral). FP8 experts on --moe-router-padding-for-fp8 (tensorwise, delayed) take it for both gradient GEMMs: torch._scaled_mm per expert on the casts, so under hybrid cuBLAS multiplies the E5M2 gradients by the E4M3 casts at the FP8 rate (the grouped FP8 kernel takes E4M3 only). Not yet measured on a GPU. bench/gpu_check.sh compares them (this framework's own flag)."""
    moe_layer_recompute: bool = False
    """Recompute each mixture-of-experts block in backward instead of keeping its activations (how the model runs, not its architecture)."""
