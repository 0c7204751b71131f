"""Predicted step time of the single-GPU benchmark presets on an H100, from counted work and measured ceilings.

    python bench/cost_model.py              # the tables of docs/performance.md ("Cost model")
    python bench/cost_model.py --json       # the same figures as JSON (bench/gpu_plan.py takes its step times)

The mixture-of-experts presets (`MOE_PRESETS`: a few layers of Mixtral 8x7B and Qwen3-30B-A3B, EP1)
are predicted the same way, their FLOPs per expert GEMM counted at the rows each expert gets with
tokens spread evenly (--moe-router-force-load-balancing), the dispatch's passes over the routed rows
added to the glue, and MFU from Megatron's FLOPs with the active parameters (top-k experts per token,
megatron/training/reporting/logging.py). Their host time is predicted too, from counted operators: the
operators of one micro-batch's forward + backward, counted on the CPU on a narrow copy of the preset
(the count depends on the layers, experts and top-k, not the width) times the host time of one
operator measured on the H200 (`HOST_SECONDS_PER_OP`); a step is host-bound when that exceeds the
GPU's time, which the MoE layer's old per-expert loop and host reads made Qwen3-MoE's.

Nothing here runs on a GPU. Per optimizer step (8 micro-batches, seq 4096, the presets of
bench/bench_pretrain.py) the step is cut into parts, each with the work it does and a time from the
H100 ceilings below:

- GEMMs and attention: FLOPs counted by `torch.utils.flop_counter` on meta tensors of each
  layer's shapes (forward and backward; causal attention counted as half, as Megatron's formula
  does), timed at the measured GEMM and SDPA rates.
- glue (norms, RoPE, SwiGLU, residual adds and their backward), loss, FP8 casts and optimizer:
  bytes read and written, per the passes the code makes (those of the loss, the FP8 casts and
  the optimizer are counted by tests/unit/test_loss_passes.py, test_fp8_work.py and
  test_optimizer_passes.py), timed at the HBM rate.
- launches: kernels per step; not added to the time (each kernel runs longer than its launch, so
  launches overlap the GPU's work when the host runs ahead, as it does without a per-step sync).

"before" is the code as it was before the one-pass loss backward, the FP8 casts done once, the
residual add fused into the next norm and the clipping folded into the update; "after" is this
version. Both are predictions.
"""
import argparse
import functools
import json

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megatron.core.transformer.moe.wgrad_choice import ACCUMULATING

# H100 80GB SXM ceilings measured at these shapes (middle of each measured range), bytes/s and FLOP/s.
GEMM_BF16, GEMM_FP8 = 630e12, 1000e12            # measured 545-715 and 742-1280 TFLOP/s
ATTENTION = {64: 338e12, 128: 414e12}           # SDPA causal flash forward+backward, by head dim
HBM = 2.9e12                                    # 2.8-3.0 TB/s in practice
PEAK = {"bf16": 989e12, "fp8": 1979e12}         # dense peaks MFU is reported against (BF16 for both)
LAUNCH_SECONDS = 4e-6
MICRO_BATCHES, SEQ = 8, 4096
PRESETS = {  # as bench/bench_pretrain.py and docs/performance.md
    "llama3.2-1b": dict(h=2048, layers=16, heads=32, groups=8, f=8192, vocab=128256, tied=True, micro=2),
    "llama3-8b-8layers": dict(h=4096, layers=8, heads=32, groups=8, f=14336, vocab=128256, tied=False, micro=1),
}


def _meta_flops(function) -> int:
    with FlopCounterMode(display=False) as counter:
        function()
    return counter.get_total_flops()


def linear_shapes(p: dict) -> list:
    """(in, out) of one layer's linears: QKV, attention output, fc1 (gate and up), fc2."""
    d = p["h"] // p["heads"]
    return [(p["h"], p["h"] + 2 * d * p["groups"]), (p["h"], p["h"]), (p["h"], 2 * p["f"]), (p["f"], p["h"])]


def gemm_flops(tokens: int, fan_in: int, fan_out: int) -> int:
    """Forward and backward FLOPs of x [tokens, in] @ W^T, counted on meta tensors."""
    def run():
        x = torch.empty(tokens, fan_in, device="meta", requires_grad=True)
        w = torch.empty(fan_out, fan_in, device="meta", requires_grad=True)
        (x @ w.t()).backward(torch.empty(tokens, fan_out, device="meta"))
    return _meta_flops(run)


def attention_flops(p: dict) -> int:
    """Forward and backward of one layer's causal attention for one micro-batch, counted on meta
    tensors (the counter counts the full square) and halved for causality; backward as 2x forward,
    Megatron's convention."""
    d = p["h"] // p["heads"]
    q = torch.empty(p["micro"], p["heads"], SEQ, d, device="meta")
    forward = _meta_flops(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
    return 3 * forward // 2


def glue_bytes(p: dict, after: bool, fp8: bool = False) -> float:
    """Elementwise traffic of one layer, one micro-batch, forward and backward (bf16, compiled
    fusions): A = one [tokens, h] activation, F = one [tokens, f], R = the rotated q and k. After:
    the first residual add inside the next norm (forward 4A instead of 3A + 2A; backward, the
    norm's gradient and the residual's summed in one 4A pass instead of 3A + 3A), and the attention
    output batch-first (`attention_output_bytes`)."""
    tokens = p["micro"] * SEQ
    d = p["h"] // p["heads"]
    a, f, r = 2 * tokens * p["h"], 2 * tokens * p["f"], 2 * tokens * (p["h"] + d * p["groups"])
    forward = 2 * a + 2 * r + 3 * a + 2 * a + 3 * f + 3 * a        # norm, rope, add, norm, swiglu, add
    backward = 3 * a + 2 * r + 3 * a + 5 * f + 2 * 3 * a           # norms, rope, swiglu, residual sums
    return forward + backward - (3 * a if after else 0) + attention_output_bytes(p, after, fp8)


def attention_output_bytes(p: dict, after: bool, fp8: bool = False) -> float:
    """Per layer and micro-batch, what the attention output's layout costs at micro-batch b > 1.
    Sequence-first (before): PyTorch's flash backward copies the output and its gradient, each a
    bf16 [tokens, nq*d] read and written. Batch-first (after, where b*s > (b - 1)*h, as
    `SelfAttention._batch_first` decides): no copy (tests/unit/test_attention_output_layout.py
    counts none, forward and backward), but the projection's weight gradient is accumulated into
    the fp32 main_grad once per sample, b - 1 more passes of 8 bytes per weight. An FP8 projection
    stays sequence-first."""
    b, h = p["micro"], p["h"]
    q = h  # nq * d for these presets
    if b == 1:
        return 0.0
    if after and not fp8 and b * SEQ > (b - 1) * h:
        return 8.0 * (b - 1) * h * q
    return 2 * (2 + 2) * b * SEQ * q


def fp8_cast_bytes(p: dict, after: bool) -> float:
    """Per micro-batch and layer: casting each linear's input and output gradient (bf16 read, FP8
    written), with the amax pass of current scaling counted as a read; weights once per step."""
    tokens = p["micro"] * SEQ
    total = 0.0
    for fan_in, fan_out in linear_shapes(p):
        x, g = tokens * fan_in, tokens * fan_out
        if after:   # x: amax + cast with its transpose; g: amax + cast with its transpose
            total += (2 * x + 2 * x + 2 * x) + (2 * g + 2 * g + 2 * g)
        else:       # x cast in forward and again in backward, plus its FP8 transpose; g cast twice + transpose
            total += 2 * (2 * x + 2 * x + x) + 2 * x + 2 * (2 * g + 2 * g + g) + 2 * g
        total += fp8_weight_gradient_bytes(fan_in * fan_out, after) / MICRO_BATCHES
    return total


def fp8_weight_gradient_bytes(weights: int, after: bool) -> float:
    """Per step, the traffic of one FP8 linear's weight gradients into the fp32 main_grad beyond the
    GEMM's reads: per micro-batch a bf16 product written (2 bytes per weight), read (2) and added
    into main_grad (4 read, 4 written); after, the step's first micro-batch has the GEMM write its
    fp32 output into main_grad instead (4), as tests/unit/test_fp8_wgrad.py counts (one direct
    write, M - 1 products and adds per step of M micro-batches)."""
    product_then_add = 2 + 2 + 4 + 4
    if not after:
        return MICRO_BATCHES * product_then_add * weights
    return (4 + (MICRO_BATCHES - 1) * product_then_add) * weights


def parameters(p: dict) -> int:
    per_layer = sum(i * o for i, o in linear_shapes(p)) + 2 * p["h"]
    return p["layers"] * per_layer + p["vocab"] * p["h"] * (1 if p["tied"] else 2) + p["h"]


def step_parts(name: str, precision: str, after: bool) -> dict:
    """{part: (seconds, work)} for one optimizer step of preset `name`."""
    p = PRESETS[name]
    tokens, layers, m = p["micro"] * SEQ, p["layers"], MICRO_BATCHES
    d = p["h"] // p["heads"]
    layer_gemm = sum(gemm_flops(tokens, i, o) for i, o in linear_shapes(p))
    output_gemm = gemm_flops(tokens, p["h"], p["vocab"])
    layer_rate = GEMM_FP8 if precision == "fp8" else GEMM_BF16
    gemm_seconds = m * (layers * layer_gemm / layer_rate + output_gemm / GEMM_BF16)
    attention = m * layers * attention_flops(p)
    glue = m * layers * glue_bytes(p, after, precision == "fp8")
    loss = m * tokens * p["vocab"] * (2 + (4 if after else 12))  # forward read; backward one pass or three
    # Bytes per parameter: norm 4, clipping 8 (before only), AdamW 28 (+4 after), copy 6, zeroing 4.
    optimizer = parameters(p) * (46 if after else 50)
    parts = {
        "GEMMs": (gemm_seconds, f"{m * (layers * layer_gemm + output_gemm) / 1e12:.0f} TFLOP"),
        "attention": (attention / ATTENTION[d], f"{attention / 1e12:.0f} TFLOP"),
        "glue": (glue / HBM, f"{glue / 1e9:.0f} GB"),
        "loss": (loss / HBM, f"{loss / 1e9:.1f} GB"),
        "optimizer": (optimizer / HBM, f"{optimizer / 1e9:.1f} GB"),
    }
    if precision == "fp8":
        casts = m * layers * fp8_cast_bytes(p, after)
        parts["FP8 casts"] = (casts / HBM, f"{casts / 1e9:.0f} GB")
    kernels = m * layers * (40 + (24 if precision == "fp8" else 0)) + 20
    parts["launches"] = (0.0, f"~{kernels} kernels (x {LAUNCH_SECONDS * 1e6:.0f} us, overlapped)")
    return parts


def dense_config(name: str):
    """The dense preset's model description, as bench/bench_pretrain.py builds it."""
    from megatron.core.transformer.config import TransformerConfig, derive

    p = PRESETS[name]
    return derive(TransformerConfig(
        num_layers=p["layers"], hidden_size=p["h"], num_attention_heads=p["heads"], num_query_groups=p["groups"],
        group_query_attention=True, ffn_hidden_size=p["f"], padded_vocab_size=p["vocab"], swiglu=True,
        add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope",
        untie_embeddings_and_output_weights=not p["tied"], max_position_embeddings=SEQ))


def megatron_flops(name: str) -> float:
    """Megatron's FLOPs per iteration for the preset (what TFLOP/s/GPU and MFU are computed from):
    the log line's count (megatron/training/reporting/logging.py), on the model built on the meta device."""
    from megatron.training.reporting.logging import flops_per_iteration

    return flops_per_iteration(dense_config(name), MICRO_BATCHES * PRESETS[name]["micro"], SEQ)


def prediction(name: str, precision: str, after: bool) -> dict:
    parts = step_parts(name, precision, after)
    seconds = sum(t for t, _ in parts.values())
    tokens = MICRO_BATCHES * PRESETS[name]["micro"] * SEQ
    return {"preset": name, "precision": precision, "version": "after" if after else "before",
            "step_seconds": seconds, "tokens_per_second": tokens / seconds,
            "mfu_bf16_peak": 100 * megatron_flops(name) / seconds / PEAK["bf16"],
            "parts": {part: {"seconds": t, "work": work} for part, (t, work) in parts.items()}}


def predictions() -> list:
    return [prediction(name, precision, after) for name in PRESETS for precision in ("bf16", "fp8")
            for after in (False, True)]


def markdown(rows: list) -> str:
    lines = []
    for name in PRESETS:
        mine = [r for r in rows if r["preset"] == name]
        parts = list(mine[-1]["parts"])
        lines += [f"**{name}** (predicted, ms per step of {MICRO_BATCHES} micro-batches; work of the 'after' column)",
                  "", "| part | " + " | ".join(f"{r['precision']} {r['version']}" for r in mine) + " | work |",
                  "|---|" + "---|" * (len(mine) + 1)]
        for part in parts:
            cells = [f"{r['parts'][part]['seconds'] * 1e3:.0f}" if part in r["parts"] else "" for r in mine]
            lines.append(f"| {part} | " + " | ".join(cells) + f" | {mine[-1]['parts'][part]['work']} |")
        lines.append("| **step** | " + " | ".join(f"**{r['step_seconds'] * 1e3:.0f}**" for r in mine) + " | |")
        lines.append("| MFU (BF16 peak) | " + " | ".join(f"{r['mfu_bf16_peak']:.1f}%" for r in mine) + " | |")
        lines.append("| tokens/s | " + " | ".join(f"{r['tokens_per_second']:.0f}" for r in mine) + " | |")
        lines.append("")
    return "\n".join(lines)


# -- mixture-of-experts presets (bench/bench_pretrain.py; a few layers of each model, EP1, one H100) ----
MOE_PRESETS = {
    "mixtral-8x7b-2layers": dict(h=4096, layers=2, heads=32, groups=8, kv=128, experts=8, topk=2, expert_f=14336,
                                 vocab=32000, micro=1),
    "qwen3-30b-a3b-4layers": dict(h=2048, layers=4, heads=32, groups=4, kv=128, experts=128, topk=8, expert_f=768,
                                  vocab=151936, micro=1),
    "deepseek-v3-4layers": dict(h=2048, layers=4, heads=16, groups=8, kv=128, experts=256, topk=8, expert_f=448,
                                vocab=129280, micro=1, shared_f=448,
                                routing=dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                             moe_router_num_groups=8, moe_router_group_topk=4,
                                             moe_shared_expert_intermediate_size=448)),
}
# Passes over the routed rows [tokens x topk, h] per MoE layer and micro-batch, forward and backward,
# as megatron/core/transformer/moe/token_dispatcher.py (alltoall, EP1) and experts.py make them:
# permute's gather, the sort into expert order, the probs product, the return to token order and
# the combine's scatter-add, each a read and a write forward (10) and about 1.5x that backward (15).
DISPATCH_PASSES = 25
# The host's time per operator: the 2026-11-28 H200 run's Qwen3-MoE step (899 ms, host-bound, 4
# micro-batches) over the operators the code of then made (its per-expert weight-gradient loop and
# host reads: about 10,300 per micro-batch, counted as `moe_host_ops` counts), 22 us each.
HOST_SECONDS_PER_OP = 22e-6
# Bytes per parameter held across a step: bf16 weight 2, fp32 main_grad 4, fp32 master 4, Adam's two
# moments 8; FP8 adds the cached weight casts (forward and transposed, 1 byte each).
STATE_BYTES = {"bf16": 18, "fp8": 20}


def moe_config(name: str):
    """The preset's model description, as bench/bench_pretrain.py builds it (all layers MoE)."""
    from megatron.core.transformer.config import TransformerConfig, derive

    p = MOE_PRESETS[name]
    return derive(TransformerConfig(
        num_layers=p["layers"], hidden_size=p["h"], num_attention_heads=p["heads"], num_query_groups=p["groups"],
        group_query_attention=True, kv_channels=p["kv"], ffn_hidden_size=p["expert_f"], padded_vocab_size=p["vocab"],
        swiglu=True, add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, max_position_embeddings=SEQ, num_experts=p["experts"],
        moe_ffn_hidden_size=p["expert_f"], moe_router_topk=p["topk"], moe_grouped_gemm=True, **p.get("routing", {})))


def moe_parameters(name: str) -> int:
    """Parameters of the preset's model, counted on a meta-device GPTModel."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.parallel_state import single_process

    model = GPTModel(moe_config(name), single_process(), device=torch.device("meta"))
    return sum(param.numel() for param in model.parameters())


@functools.lru_cache(maxsize=None)
def moe_host_ops(name: str) -> int:
    """Operators of one micro-batch's forward + backward of the preset's model (aten ops under a
    dispatch mode, as tests/unit/test_moe_op_count.py counts a layer's), counted on the CPU at width
    32 with the preset's layers, experts and top-k: the grouped experts' count does not depend on
    the width or the expert count."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.parallel_state import single_process
    from megatron.core.transformer.config import TransformerConfig, derive
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    p = MOE_PRESETS[name]
    narrow = derive(TransformerConfig(
        num_layers=p["layers"], hidden_size=32, num_attention_heads=4, num_query_groups=2, group_query_attention=True,
        ffn_hidden_size=16, padded_vocab_size=64, swiglu=True, add_bias_linear=False, normalization="RMSNorm",
        position_embedding_type="rope", max_position_embeddings=64, num_experts=p["experts"],
        moe_ffn_hidden_size=16, moe_router_topk=p["topk"], moe_token_dispatcher_type="alltoall",
        untie_embeddings_and_output_weights=True,
        **{**p.get("routing", {}), **({"moe_shared_expert_intermediate_size": 16} if "shared_f" in p else {})}))
    model = GPTModel(narrow, single_process())
    model.initialize_parameters(1)
    tokens = torch.randint(0, 64, (1, 33), generator=torch.Generator().manual_seed(0))
    with Count():
        model(tokens[:, :-1], torch.arange(32).unsqueeze(0), labels=tokens[:, 1:]).mean().backward()
    return Count.ops


def moe_layer_flops(p: dict) -> dict:
    """Forward and backward FLOPs of one MoE layer and micro-batch, counted on meta tensors: the
    attention linears, the router, each expert's GEMMs at its share of the routed rows, attention."""
    tokens, q, kv = p["micro"] * SEQ, p["heads"] * p["kv"], p["kv"] * p["groups"]
    per_expert = tokens * p["topk"] // p["experts"]
    shared = p.get("shared_f", 0)  # the shared expert, every token
    return {"linears": gemm_flops(tokens, p["h"], q + 2 * kv) + gemm_flops(tokens, q, p["h"])
            + (gemm_flops(tokens, p["h"], 2 * shared) + gemm_flops(tokens, shared, p["h"]) if shared else 0),
            "router": gemm_flops(tokens, p["h"], p["experts"]),
            "experts": p["experts"] * (gemm_flops(per_expert, p["h"], 2 * p["expert_f"])
                                       + gemm_flops(per_expert, p["expert_f"], p["h"])),
            "attention": attention_flops(dict(micro=p["micro"], heads=p["heads"], h=q))}


def fp8_padding_rows(rows: int, experts: int, multiple: int = 16) -> int:
    """Rows --moe-router-padding-for-fp8 adds to `rows` spread evenly over `experts`: each expert's
    count up to the next multiple of `multiple`."""
    return experts * (-(rows // experts) % multiple)


def moe_step_parts(name: str, precision: str, wgrad: str = "grouped-mm") -> dict:
    """{part: (seconds, work)} for one optimizer step of MoE preset `name` (tokens spread evenly over
    the experts, as --moe-router-force-load-balancing makes them); `wgrad`: --moe-grouped-wgrad."""
    p = MOE_PRESETS[name]
    tokens, layers, m = p["micro"] * SEQ, p["layers"], MICRO_BATCHES
    rows, q, kv = tokens * p["topk"], p["heads"] * p["kv"], p["kv"] * p["groups"]
    flops = moe_layer_flops(p)
    layer_gemm = flops["linears"] + flops["router"] + flops["experts"]
    output = gemm_flops(tokens, p["h"], p["vocab"])
    if precision == "fp8":
        # FP8 is `hybrid` (as gpu_check.sh runs it): no FP8 grouped kernel of PyTorch multiplies the
        # experts' E5M2 gradients, so their two gradient GEMMs run in bf16 on the widened casts,
        # unless --moe-grouped-wgrad triton, whose kernels multiply E5M2 by E4M3 (at the FP8 rate
        # assumed here, unmeasured).
        # With --moe-grouped-wgrad per-expert, cuBLAS's `_scaled_mm` per expert multiplies them (FP8
        # rate, a GEMM per expert); accumulating in bf16 (ACCUMULATING, which auto may choose), the
        # weight gradients of a step's later micro-batches are bf16 GEMMs of the widened casts.
        widened = {"triton": 0, "per-expert": 0,
                   ACCUMULATING: flops["experts"] / 3 * (m - 1) / m}.get(wgrad, flops["experts"] * 2 / 3)
        gemm_seconds = m * (layers * ((layer_gemm - widened) / GEMM_FP8 + widened / GEMM_BF16) + output / GEMM_BF16)
    else:
        gemm_seconds = m * (layers * layer_gemm / GEMM_BF16 + output / GEMM_BF16)
    attention = m * layers * flops["attention"]
    a, r, f = 2 * tokens * p["h"], 2 * tokens * (q + 2 * kv), 2 * rows * p["expert_f"]
    expert_weights = p["experts"] * 3 * p["h"] * p["expert_f"]
    glue_layer = (2 * a + 2 * r + 3 * a + 3 * f + 3 * a) + (3 * a + 2 * r + 5 * f + 2 * 3 * a)  # as glue_bytes
    # The dispatch's passes over the routed rows. The experts' weight gradients (bf16): one grouped
    # GEMM per weight writes an fp32 product [E, n, k] (4 bytes per element), added into main_grad
    # in one pass (read 4, read and write main_grad 8); with --moe-grouped-wgrad triton the GEMM
    # adds into main_grad itself (read and write 8; its GEMM rate assumed cuBLAS's, unmeasured); with
    # --moe-grouped-wgrad per-expert one cuBLAS GEMM per expert accumulates into main_grad (read and
    # written, 8, not assumed hidden under its compute: the Triton kernel's was not on an H200).
    # FP8's products are counted with its casts below.
    wgrad_bytes = (8 if wgrad in ("triton", "per-expert") else 16) if precision == "bf16" else 0
    glue_layer += DISPATCH_PASSES * 2 * rows * p["h"] + wgrad_bytes * expert_weights
    glue = m * layers * glue_layer
    loss = m * tokens * p["vocab"] * 6
    optimizer = moe_parameters(name) * 46
    parts = {
        "GEMMs": (gemm_seconds, f"{m * (layers * layer_gemm + output) / 1e12:.0f} TFLOP"),
        "attention": (attention / ATTENTION[p["kv"]], f"{attention / 1e12:.0f} TFLOP"),
        "glue and dispatch": (glue / HBM, f"{glue / 1e9:.0f} GB"),
        "loss": (loss / HBM, f"{loss / 1e9:.1f} GB"),
        "optimizer": (optimizer / HBM, f"{optimizer / 1e9:.1f} GB"),
    }
    if precision == "fp8":
        # Per micro-batch and layer: each GEMM input and output gradient read for its amax, read and
        # written with its transpose (6 bytes per element); the attention linears' and the experts'
        # weight gradients, which FP8 GEMMs write in bf16, added to main_grad (12 bytes). Per step:
        # each weight's amax, cast and transpose
        # (6 bytes). The experts run as with --moe-router-padding-for-fp8 (tensorwise or delayed): the
        # routing is padded, so no row is copied, each tensor is cast once for all experts and the
        # host's operators do not grow with the expert count (tests/unit/test_moe_router_padding_fp8.py),
        # so the bf16 count below stands for FP8's too. The padding adds rows up to the next multiple
        # of 16 per expert (none when balanced rows per expert are multiples of 16, as in these presets).
        rows += fp8_padding_rows(rows, p["experts"])
        attention_weights = p["h"] * (2 * q + 2 * kv)
        x = tokens * (p["h"] + q) + rows * (p["h"] + p["expert_f"])
        g = tokens * (q + 2 * kv + p["h"]) + rows * (2 * p["expert_f"] + p["h"])
        # The Triton kernel adds into main_grad itself; per expert, `_scaled_mm` writes a step's first
        # micro-batch into main_grad (fp32, 4 bytes), the later ones' bf16 products are added (12),
        # or, accumulating in bf16, cuBLAS reads and writes main_grad (8, as bf16's per-expert path).
        expert_wgrad_bytes = {"triton": 8, "per-expert": (4 + 12 * (m - 1)) / m,
                              ACCUMULATING: (4 + 8 * (m - 1)) / m}.get(wgrad, 12)
        casts = m * layers * (6 * (x + g) + 12 * attention_weights + expert_wgrad_bytes * expert_weights)
        casts += layers * 6 * (expert_weights + attention_weights)
        # hybrid's widened gradient GEMMs: the input gradient's operands (the experts' weight casts and
        # the gradient's rows, 1 byte read and 2 written each) and the weight gradient's (the
        # gradient's and input's rows); none with the Triton kernels, which take the casts as they are.
        expert_g, expert_x = rows * (2 * p["expert_f"] + p["h"]), rows * (p["h"] + p["expert_f"])
        if wgrad == ACCUMULATING:   # the later micro-batches' gradient and input rows widened (the
            # gradient's from its cast as it is: no transpose of it, 2 bytes, on those micro-batches)
            casts += (m - 1) * layers * (3 * (expert_g + expert_x) - 2 * expert_g)
        elif wgrad not in ("triton", "per-expert"):
            casts += m * layers * 3 * (expert_weights + 2 * expert_g + expert_x)
        parts["FP8 casts"] = (casts / HBM, f"{casts / 1e9:.0f} GB")
    # The host runs ahead of the GPU (no read-back in the MoE layer at EP 1): only host time beyond
    # the GPU's adds to the step.
    ops = m * moe_host_ops(name)
    if wgrad in ("per-expert", ACCUMULATING):  # a weight-gradient GEMM per expert and weight (FP8: the input gradient's too)
        ops += m * layers * 2 * p["experts"] * (2 if precision == "fp8" else 1)
    host, gpu = ops * HOST_SECONDS_PER_OP, sum(t for t, _ in parts.values())
    parts["host beyond the GPU"] = (max(0.0, host - gpu), f"{ops} ops, {host * 1e3:.0f} ms of CPU")
    return parts


def moe_prediction(name: str, precision: str, wgrad: str = "grouped-mm") -> dict:
    """Predicted step time, tokens/s and MFU against the BF16 peak, Megatron's FLOPs with the
    active parameters (megatron/training/reporting/logging.py: top-k experts per token)."""
    from megatron.training.reporting.logging import flops_per_iteration

    parts = moe_step_parts(name, precision, wgrad)
    seconds = sum(t for t, _ in parts.values())
    batch = MICRO_BATCHES * MOE_PRESETS[name]["micro"]
    flops = flops_per_iteration(moe_config(name), batch, SEQ)
    return {"preset": name, "precision": precision, "wgrad": wgrad, "step_seconds": seconds,
            "tokens_per_second": batch * SEQ / seconds, "mfu_bf16_peak": 100 * flops / seconds / PEAK["bf16"],
            "parameters": moe_parameters(name), "state_gb": moe_parameters(name) * STATE_BYTES[precision] / 1e9,
            "parts": {part: {"seconds": t, "work": work} for part, (t, work) in parts.items()}}


RUNS = (("bf16", "grouped-mm"), ("bf16", "triton"), ("bf16", "per-expert"), ("fp8", "per-expert"),
        ("fp8", ACCUMULATING), ("fp8", "grouped-mm"))  # the columns of `moe_markdown`


def moe_markdown() -> str:
    lines = []
    for name in MOE_PRESETS:
        rows = [moe_prediction(name, precision, wgrad) for precision, wgrad in RUNS]
        lines += [f"**{name}** ({rows[0]['parameters'] / 1e9:.2f} B parameters, {rows[0]['state_gb']:.0f} / "
                  f"{rows[-1]['state_gb']:.0f} GB of weights, gradients and optimizer state in bf16 / FP8, "
                  f"before activations; predicted, ms per step of {MICRO_BATCHES} micro-batches)", "",
                  "| part | bf16, --moe-grouped-wgrad grouped-mm | bf16, --moe-grouped-wgrad triton "
                  "| bf16, --moe-grouped-wgrad per-expert | fp8, --moe-grouped-wgrad per-expert "
                  f"| fp8, {ACCUMULATING} (auto) | fp8, --moe-grouped-wgrad grouped-mm | work (fp8) |",
                  "|---|---|---|---|---|---|---|---|"]
        for part in rows[-1]["parts"]:
            cells = [f"{r['parts'][part]['seconds'] * 1e3:.0f}" if part in r["parts"] else "" for r in rows]
            lines.append(f"| {part} | " + " | ".join(cells) + f" | {rows[-1]['parts'][part]['work']} |")
        lines.append("| **step** | " + " | ".join(f"**{r['step_seconds'] * 1e3:.0f}**" for r in rows) + " | |")
        lines.append("| MFU (BF16 peak, active parameters) | " + " | ".join(f"{r['mfu_bf16_peak']:.1f}%" for r in rows)
                     + " | |")
        lines.append("| tokens/s | " + " | ".join(f"{r['tokens_per_second']:.0f}" for r in rows) + " | |")
        auto = {precision: min(r["step_seconds"] for r, (p, wgrad) in zip(rows, RUNS) if p == precision
                               and wgrad != "triton") for precision in ("bf16", "fp8")}
        lines += ["", f"The default, --moe-grouped-wgrad auto, runs whichever of grouped-mm and per-expert (FP8: "
                      f"also {ACCUMULATING}) its start-up probe times fastest: {auto['bf16'] * 1e3:.0f} ms in "
                      f"bf16 and {auto['fp8'] * 1e3:.0f} in FP8 on these predictions.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the predictions as JSON")
    args = parser.parse_args()
    rows = predictions()
    moe = [moe_prediction(name, precision, wgrad) for name in MOE_PRESETS
           for precision, wgrad in (("bf16", "grouped-mm"), ("bf16", "triton"), ("bf16", "per-expert"),
                                    ("fp8", "grouped-mm"), ("fp8", "per-expert"), ("fp8", ACCUMULATING))]
    print(json.dumps(rows + moe, indent=1) if args.json else markdown(rows) + "\n" + moe_markdown())


if __name__ == "__main__":
    main()
