"""Memory per GPU, term by term, for an architecture, a layout and a pipeline stage.

Persistent terms (held for the whole run): weights, gradients, optimizer state (fp32 masters and
moments), FP8 weight copies, and FSDP2's gathered layers. Activations: the bytes autograd saves for
backward per layer and micro-batch, in this implementation (counted tensor by tensor below, and
checked against the saved-tensor hooks in tests/unit/test_planning_activations.py), times the
micro-batches a pipeline stage holds at once. Transient terms: the logits and the loss, and the
re-run of one recomputed group in backward.

Notation: t tokens of one micro-batch on this rank (micro-batch x sequence / CP), e bytes per
element of the compute dtype, h hidden size; the norms, residuals and dropout masks cover t/TP
tokens with sequence parallelism, t without.
"""
from dataclasses import dataclass, field

from megatron.training.planning import moe as moe_terms
from megatron.training.planning.architecture import Architecture, stage_expert_parameters, stage_parameters
from megatron.training.planning.layout import Layout

GIB = 1024 ** 3
FP32 = 4
_CE_CHUNK_ELEMENTS = 1 << 26  # tensor_parallel.cross_entropy.DEFAULT_CHUNK_ELEMENTS


def _norm_bytes(arch: Architecture, lay: Layout, tokens: float, width: int = None, stored: int = None) -> float:
    """What one norm over `width` channels (the hidden size unless given) saves for backward (its
    output, saved by the next linear, counted too). `stored`: the channels of the buffer its input
    is a view of (a latent split from a wider projection), when that buffer is what is kept."""
    e = lay.compute_bytes
    width = arch.hidden_size if width is None else width
    stored = width if stored is None else stored
    if arch.layernorm:  # the input, mean and rstd per token (fp32 on GPU, the input's dtype on CPU), the output
        return e * stored * tokens + 2 * (FP32 if lay.device == "gpu" else e) * tokens + e * width * tokens
    if lay.fused_elementwise:  # compiled RMSNorm: the input and 1/rms per token, and the output
        return e * stored * tokens + FP32 * tokens + e * width * tokens
    # eager RMSNorm: the fp32 input (the input itself in fp32, a new tensor otherwise), 1/rms per
    # token, the normalized value in the compute dtype (for the weight's multiply), and the output
    fp32_input = FP32 * (stored if e == FP32 else width) * tokens
    return fp32_input + FP32 * tokens + e * width * tokens + e * width * tokens


def _attention_core_bytes(arch: Architecture, lay: Layout, tokens: float, heads: int, q_local: int,
                          v_local: int = None) -> float:
    """What the attention kernel saves beyond q, k and v: the log-sum-exp (flash: its output is the
    storage the output projection saves), or the scaled q and k, the probabilities and the dropout
    mask and output (math: s x s per head). PyTorch's CPU math kernel works in fp32 (and then
    also keeps an fp32 copy of v) and keeps its dropout mask as an fp32 tensor. `v_local`: the
    values' channels when they differ from the queries' (multi-latent attention)."""
    e = lay.compute_bytes
    v_local = q_local if v_local is None else v_local
    if lay.attention_kernel == "flash":
        return FP32 * tokens * heads
    seq = lay.seq_length // lay.cp
    scores = heads * seq * tokens  # b x heads x s x s
    dropout = arch.attention_dropout > 0
    if lay.device == "cpu":
        copies = 2 * FP32 * tokens * q_local + (FP32 * tokens * v_local if e != FP32 else 0)
        return copies + FP32 * scores + (2 * FP32 * scores if dropout else 0)
    return 2 * e * tokens * q_local + e * scores + ((1 + e) * scores if dropout else 0)


def _dropout_mask_bytes(lay: Layout) -> int:
    """Bytes per element of a dropout mask: a bool on GPU; on CPU PyTorch keeps the scaled noise in
    the input's dtype."""
    return 1 if lay.device == "gpu" else lay.compute_bytes


def _self_attention_terms(a: Architecture, lay: Layout, tokens: float, norm_tokens: float, selective: bool) -> dict:
    """What the attention (one qkv projection) saves: the qkv buffer, the rotated q and k, the
    kernel's own tensors and the output projection's input."""
    e, tp = lay.compute_bytes, lay.tp
    heads = a.local_heads(tp)
    q_local = heads * a.kv_channels
    kv_local = a.local_kv_size(tp)
    terms = {"qkv": e * tokens * (q_local + 2 * kv_local)}  # one buffer; v (a view of it) keeps it alive
    a2a = lay.cp > 1 and lay.cp_comm_type == "a2a"
    if a.rope and not a2a:  # the rotated q and k are new tensors (a2a: only its exchanged q, k, v are kept)
        terms["rope"] = e * tokens * (q_local + kv_local)
    if not selective:
        terms["attention"] = _attention_core_bytes(a, lay, tokens, heads, q_local)
        if lay.cp > 1:  # the context-parallel kernels keep their output apart from the projection's input
            terms["attention"] += e * tokens * q_local
        if lay.attention_kernel == "math" and lay.device == "cpu" and e != FP32:
            del terms["qkv"]  # the CPU math kernel saves its fp32 copies of q, k and v instead
    terms["proj_input"] = e * tokens * q_local
    return terms


def _mla_terms(a: Architecture, lay: Layout, tokens: float, norm_tokens: float, selective: bool) -> dict:
    """What multi-latent attention saves: the latents' norms (--qk-layernorm; else the up
    projections' inputs), q and k (each a concatenation of its no-position and rotated parts: the
    rotated parts themselves are not kept), kv_up's output (v, a view of it, keeps it alive), the
    kernel's own tensors at the query/key and value widths, and the output projection's input. The
    latents' norms run on this rank's tokens (1/TP with sequence parallelism)."""
    e, heads = lay.compute_bytes, a.local_heads(lay.tp)
    qk, v = heads * (a.qk_head_dim + a.qk_pos_emb_head_dim), heads * a.v_head_dim
    kv_up = heads * (a.qk_head_dim + a.v_head_dim)
    terms = {}
    if a.q_lora_rank is not None:
        terms["q latent"] = (_norm_bytes(a, lay, norm_tokens, a.q_lora_rank) if a.qk_layernorm
                             else e * tokens * a.q_lora_rank)
    kv_down = a.kv_lora_rank + a.qk_pos_emb_head_dim  # the latent is a view of [latent, rotated key]
    terms["kv latent"] = (_norm_bytes(a, lay, norm_tokens, a.kv_lora_rank, kv_down) if a.qk_layernorm
                          else e * tokens * kv_down)
    terms["qkv"] = e * tokens * (2 * qk + kv_up)
    if not selective:
        terms["attention"] = _attention_core_bytes(a, lay, tokens, heads, qk, v)
        if lay.attention_kernel == "math":  # the kernel keeps its scaled copies of q and k, not them
            terms["qkv"] = e * tokens * kv_up
            if lay.device == "cpu" and e != FP32:
                del terms["qkv"]  # and in fp32 on CPU its copy of v
    terms["proj_input"] = e * tokens * v
    return terms


# Each attention kind's saved tensors (an architecture's kind: `Architecture.mla`).
ATTENTION_ACTIVATIONS = {"self": _self_attention_terms, "mla": _mla_terms}


def layer_activation_terms(arch: Architecture, lay: Layout, selective: bool = False, moe: bool = False) -> dict:
    """{part: bytes} one decoder layer saves for backward for one micro-batch on one rank, without
    full recomputation (`selective`: the attention core is re-run, its own saved tensors dropped).
    A mixture-of-experts layer (`moe`) saves its block's terms (planning/moe.py) in place of the
    MLP's, none with --moe-layer-recompute."""
    a, e, h, tp = arch, lay.compute_bytes, arch.hidden_size, lay.tp
    tokens = lay.micro_batch_size * lay.seq_length / lay.cp
    norm_tokens = tokens / tp if lay.sp else tokens
    terms = {"norms": 2 * _norm_bytes(a, lay, norm_tokens)}
    terms.update(ATTENTION_ACTIVATIONS["mla" if a.mla else "self"](a, lay, tokens, norm_tokens, selective))
    f_local = a.ffn_hidden_size // tp
    if moe:
        if not lay.moe_layer_recompute:
            terms.update(moe_terms.block_activation_terms(a, lay))
    elif a.gated_linear_unit:  # fc1's [gate, up] output, silu(gate) (eager only), the product
        terms["mlp"] = e * tokens * f_local * (3 if lay.fused_elementwise else 4)
    else:  # fc1's output (the activation's input) and the activation's output
        terms["mlp"] = 2 * e * tokens * f_local
    if a.hidden_dropout > 0:  # two masks
        terms["dropout"] = 2 * norm_tokens * h * _dropout_mask_bytes(lay)
    return terms


def layer_input_bytes(arch: Architecture, lay: Layout) -> float:
    """A layer's input [s, b, h] on this rank (what full recomputation keeps)."""
    tokens = lay.micro_batch_size * lay.seq_length / lay.cp
    return lay.compute_bytes * arch.hidden_size * (tokens / lay.tp if lay.sp else tokens)


def rope_table_bytes(arch: Architecture, lay: Layout) -> float:
    """RoPE's cos and sin [s/cp, b, 1, rotary dim] in fp32, made once per micro-batch, saved by every layer."""
    return 2 * FP32 * lay.micro_batch_size * lay.seq_length / lay.cp * arch.rotary_dim if arch.rope else 0.0


def stage_layer_activations(arch: Architecture, lay: Layout, num_layers: int, first_layer: int = 0) -> tuple:
    """(bytes saved by layers first_layer .. first_layer + num_layers - 1 for one micro-batch, bytes
    of the largest group that is re-run at once in backward under full recomputation (or of one
    mixture-of-experts block under --moe-layer-recompute), or 0)."""
    if num_layers == 0:
        return 0.0, 0.0
    selective = lay.recompute_granularity == "selective"
    moe = arch.moe_layers[first_layer:first_layer + num_layers] if arch.is_moe else (0,) * num_layers
    per_layer = [sum(layer_activation_terms(arch, lay, selective, bool(m)).values()) for m in moe]
    if lay.recompute_granularity != "full":
        rerun = sum(moe_terms.block_activation_terms(arch, lay).values()) if lay.moe_layer_recompute and any(moe) else 0
        return sum(per_layer) + rope_table_bytes(arch, lay), float(rerun)
    count = lay.recompute_num_layers or 1
    if lay.recompute_method == "block":
        recomputed = min(count, num_layers)
        kept = per_layer[recomputed:]
        saved = recomputed * layer_input_bytes(arch, lay) + sum(kept)
        return saved + (rope_table_bytes(arch, lay) if kept else 0.0), max(per_layer[:recomputed])
    groups = [per_layer[i:i + count] for i in range(0, num_layers, count)]
    return len(groups) * layer_input_bytes(arch, lay), max(sum(group) for group in groups)


def microbatches_in_flight(lay: Layout, stage: int) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak, in units of the stage's
    whole layer set: 1F1B holds PP - stage (the first stage the most); the interleaved schedule
    holds (PP - stage - 1) x 2 + (VPP - 1) x PP + 1 model-chunk micro-batches of 1/VPP of the layers."""
    m = lay.num_microbatches
    if lay.pp == 1:
        return 1
    if lay.vpp == 1:
        return min(lay.pp - stage, m)
    chunks = min((lay.pp - stage - 1) * 2 + (lay.vpp - 1) * lay.pp + 1, m * lay.vpp)
    return chunks / lay.vpp


def logits_and_loss_bytes(arch: Architecture, lay: Layout) -> float:
    """The last stage's logits [s, b, V/tp] saved for the loss's backward, the loss's per-token
    values, and its fp32 temporaries (one chunk at a time when fused; a full fp32 softmax if not)."""
    tokens = lay.micro_batch_size * lay.seq_length / lay.cp
    local = tokens * arch.vocab_size / lay.tp
    logits = lay.compute_bytes * local + (FP32 + 8 + 1) * tokens  # + lse, targets, mask
    if lay.cross_entropy_fusion:
        return logits + 2 * FP32 * min(local, _CE_CHUNK_ELEMENTS)
    return logits + 2 * FP32 * local


def fp8_layers(arch: Architecture, lay: Layout) -> int:
    if not lay.fp8:
        return 0
    return arch.num_layers if lay.fp8_layers is None else lay.fp8_layers


@dataclass
class StageMemory:
    stage: int
    layers: int
    terms: dict = field(default_factory=dict)   # {name: bytes}

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def persistent_terms(arch: Architecture, lay: Layout, layers: int, *, first: bool, last: bool,
                     first_layer: int = 0) -> dict:
    """Weights, gradients and optimizer state (masters and moments) of one stage on one GPU; the
    routed experts' apart (`expert_terms`)."""
    n = stage_parameters(arch, lay.tp, layers, first=first, last=last, pp=lay.pp, first_layer=first_layer)
    shards = lay.dp * lay.cp
    moments = 2 if lay.optimizer == "adam" else (1 if lay.sgd_momentum else 0)
    if lay.fsdp2:
        shard = n / shards
        gathered = 2 * lay.compute_bytes * n / max(1, layers) if layers else 0  # this layer and the next
        return {"weights": FP32 * shard, "gradients": FP32 * shard, "optimizer state": FP32 * moments * shard,
                "FSDP2 gathered layers": gathered}
    masters = FP32 if lay.compute_bytes != FP32 else 0
    state = (masters + FP32 * moments) * n
    terms = {"weights": lay.compute_bytes * n, "gradients": (2 if lay.grad_reduce_in_bf16 else FP32) * n,
             "optimizer state": state / shards if lay.distributed_optimizer else state}
    fp8 = fp8_layers(arch, lay)
    if fp8:  # the quantized weight and its transpose, cached per optimizer step (1 byte each)
        terms["FP8 weight copies"] = 2 * (n - (stage_parameters(arch, lay.tp, 0, first=first, last=last, pp=lay.pp)))
        terms["FP8 weight copies"] *= min(1.0, fp8 / arch.num_layers)
    return terms


def expert_terms(arch: Architecture, lay: Layout, layers: int, first_layer: int = 0, last: bool = False) -> dict:
    """The routed experts' weights, gradients and optimizer state on one GPU: E/EP experts split over
    ETP, replicated over the expert-data-parallel ranks, over which the distributed optimizer
    shards their state (`last`: the last stage, with the prediction modules' experts)."""
    n = stage_expert_parameters(arch, lay.ep, lay.etp, layers, first_layer, last=last)
    if not n:
        return {}
    moments = 2 if lay.optimizer == "adam" else (1 if lay.sgd_momentum else 0)
    masters = FP32 if lay.compute_bytes != FP32 else 0
    state = (masters + FP32 * moments) * n
    terms = {"expert weights": lay.compute_bytes * n, "expert gradients": (2 if lay.grad_reduce_in_bf16 else FP32) * n,
             "expert optimizer state": state / lay.edp if lay.distributed_optimizer else state}
    fp8 = fp8_layers(arch, lay)
    if fp8:  # each local expert's quantized weights and their transposes, cached per optimizer step
        cast = stage_expert_parameters(arch, lay.ep, lay.etp, layers, first_layer, weights_only=True, last=last)
        terms["expert FP8 weight copies"] = 2 * cast * min(1.0, fp8 / arch.num_layers)
    return terms


def stage_memory(arch: Architecture, lay: Layout, stage: int, layers: int) -> StageMemory:
    first, last = stage == 0, stage == lay.pp - 1
    first_layer = sum(lay.layers_per_stage(arch.num_layers)[:stage])
    terms = persistent_terms(arch, lay, layers, first=first, last=last, first_layer=first_layer)
    terms.update(expert_terms(arch, lay, layers, first_layer, last))
    saved, regroup = stage_layer_activations(arch, lay, layers, first_layer)
    in_flight = microbatches_in_flight(lay, stage)
    terms["activations"] = saved * in_flight
    if lay.pp > 1:  # the received input of each micro-batch in flight, kept for its backward
        terms["pipeline inputs"] = layer_input_bytes(arch, lay) * (0 if first else in_flight)
    if regroup:
        terms["recompute working set"] = regroup
    if last:
        terms["logits and loss"] = logits_and_loss_bytes(arch, lay)
    return StageMemory(stage=stage, layers=layers, terms={k: v for k, v in terms.items() if v})


def memory_per_stage(arch: Architecture, lay: Layout) -> list:
    stages = lay.layers_per_stage(arch.num_layers)
    return [stage_memory(arch, lay, stage, layers) for stage, layers in enumerate(stages)]


def worst_stage(arch: Architecture, lay: Layout) -> StageMemory:
    return max(memory_per_stage(arch, lay), key=lambda s: s.total)
