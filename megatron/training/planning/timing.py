"""Step time: compute from per-shape throughput tables, communication from a bandwidth model with
this implementation's overlap rules, the pipeline bubble, and the optimizer step.

Per micro-batch and pipeline stage, forward and backward (backward = input gradient + weight
gradient, 2x the forward's GEMM work):
- GEMMs: each linear of each layer at its local shape (TP splits the output or input features),
  timed with the GPU's GEMM table; attention (causal, FLOPs halved) with the attention table;
- elementwise: the bytes the norms, RoPE, SwiGLU/GeLU, residuals and dropout read and write,
  at the HBM bandwidth (3x more kernels and traffic when they are not compiled);
- recomputation: full re-runs the recomputed layers' forward in backward; selective re-runs the
  attention core.

Communication (ring collectives: all-reduce moves 2(n-1)/n of the bytes, all-gather and
reduce-scatter (n-1)/n), and what hides it here:
- TP: per layer two all-reduces (or with sequence parallelism two all-gathers and two
  reduce-scatters) forward, the same backward. Forward ones are exposed; in backward the input
  gradient's reduction runs under the weight-gradient GEMM (tensor_parallel/layers.py), so only
  what exceeds that GEMM is exposed.
- CP: the ring exchanges key/value blocks while each block is attended; exposed is what exceeds
  the attention time (all_gather and a2a: not overlapped).
- DP: gradient reduction (all-reduce, or reduce-scatter with the distributed optimizer) and the
  distributed optimizer's parameter all-gather. With --overlap-grad-reduce all but the last
  bucket hides under the last micro-batch's backward; with --overlap-param-gather the gather hides
  under the first forward. FSDP2 gathers each layer's weights ahead of it and reduce-scatters its
  gradients after it, every micro-batch, hidden under the layer's compute where it fits.
- PP: one [s, b, h] activation (1/TP with SP) each way per micro-batch per stage boundary, all
  exposed with --no-overlap-p2p-communication, else only the warm-up's and cool-down's; the
  bubble is (PP - 1) / VPP micro-batch times.
- Mixture-of-experts layers (planning/moe.py): the router's and the experts' GEMMs at the rows
  each rank's experts run (top-k copies of the tokens, capacity padding when set), one GEMM per
  local expert; the permutation and the experts' activation through HBM; the token exchange
  (EP all-to-all, or all-gather / reduce-scatter over ETP x EP) each way, exposed (nothing here
  overlaps it), over the node's links or the network by where the group lies; only the attention's
  TP collectives (and the shared experts'); the experts' gradients reduced over the
  expert-data-parallel group like the dense ones over DP; --moe-layer-recompute re-runs each
  block's forward, exchange included, in backward. The experts' GEMMs run in the compute dtype
  (FP8 covers the attention's).
"""
from dataclasses import dataclass, field

from megatron.training.planning import built, moe as moe_time
from megatron.training.planning.architecture import (Architecture, flops_per_iteration, layer_parameters,
                                                     stage_expert_parameters, stage_parameters)
from megatron.training.planning.hardware import Cluster
from megatron.training.planning.layout import Layout
from megatron.training.planning.memory import fp8_layers

BUCKET_ELEMENTS = 40_000_000  # the gradient buffer's bucket size with overlap (distributed/ddp.py)


def _all_reduce(nbytes: float, n: int, bandwidth: float) -> float:
    return 2 * (n - 1) / n * nbytes / bandwidth if n > 1 else 0.0


def _gather(nbytes: float, n: int, bandwidth: float) -> float:
    """All-gather or reduce-scatter of a tensor of `nbytes` (the full size) over `n` ranks."""
    return (n - 1) / n * nbytes / bandwidth if n > 1 else 0.0


@dataclass
class LayerTime:
    """Seconds for one layer and one micro-batch on one rank."""
    gemm_forward: float
    attention_forward: float
    attention_backward: float
    elementwise_forward: float
    tp_forward: float           # exposed
    tp_backward: float          # before overlap with the weight-gradient GEMMs
    cp_forward: float           # exposed
    cp_backward: float          # exposed
    fsdp_exposed: float
    ep_exchange: float = 0.0    # a mixture-of-experts layer's token exchange, each direction (exposed)
    moe_block_forward: float = 0.0  # its router, experts and exchange (what --moe-layer-recompute re-runs)
    expert_grad_accumulation: float = 0.0  # the experts' weight gradients added into main_grad

    @property
    def forward(self) -> float:
        return (self.gemm_forward + self.attention_forward + self.elementwise_forward + self.tp_forward
                + self.cp_forward + self.ep_exchange)

    @property
    def backward(self) -> float:
        wgrad = self.gemm_forward  # the weight-gradient GEMMs hide the input gradient's reduction
        return (2 * self.gemm_forward + self.attention_backward + 2 * self.elementwise_forward
                + max(0.0, self.tp_backward - wgrad) + self.cp_backward + self.ep_exchange
                + self.expert_grad_accumulation)


def _gemm_forward(arch: Architecture, lay: Layout, cluster: Cluster, tokens: float, fp8: bool,
                  moe: bool = False) -> float:
    """Each matrix of the layer built for this TP rank (planning/built.py), at the micro-batch's
    rows; a mixture-of-experts block's GEMMs are planning/moe.py's."""
    shapes = built.layer_matrices(arch.model, arch.model_key, "moe" if moe else "dense", lay.tp)
    return sum(cluster.gemm_seconds(2 * tokens * weights, fp8) for weights in shapes)


def _attention(arch: Architecture, lay: Layout, cluster: Cluster) -> tuple:
    """(forward, backward) seconds of the attention core for one micro-batch on one rank."""
    heads = arch.local_heads(lay.tp)
    q_local = heads * arch.kv_channels
    seq, batch = lay.seq_length, lay.micro_batch_size
    forward_flops = 2 * batch * seq * seq * q_local / lay.cp  # causal: half of 4 b s^2 q
    if lay.attention_kernel == "flash":
        total = cluster.attention_seconds(3 * forward_flops)
        return total / 3.5, total * 2.5 / 3.5  # flash's backward takes about 2.5x its forward
    # math: full s x s products, then the scores through HBM (scale, mask, softmax, dropout)
    gemms = 2 * cluster.gemm_seconds(2 * forward_flops)
    scores = lay.compute_bytes * batch * heads * seq * seq / lay.cp
    return gemms + cluster.memory_seconds(6 * scores, 4), 2 * gemms + cluster.memory_seconds(10 * scores, 6)


def _elementwise_forward(arch: Architecture, lay: Layout, cluster: Cluster, tokens: float, fp8: bool = False,
                         moe: bool = False) -> float:
    """Norms, RoPE, the activation, residual adds and dropout: bytes read and written (with FP8,
    also each linear's input read twice in bf16, once for its amax and once to cast it, and written
    in FP8; backward, at twice the forward's elementwise traffic, covers the gradients' casts). The
    amax read is its own pass because the 2026-11-28 H200 profile shows one amax kernel per cast
    (1088 `linalg_vector_norm` kernels in a llama3.2-1b step); a GPU run that shows it taken inside
    the casting kernel removes it."""
    e, h = lay.compute_bytes, arch.hidden_size
    norm_tokens = tokens / lay.tp if lay.sp else tokens
    q_local = arch.query_size // lay.tp
    kv_local = arch.local_kv_size(lay.tp)
    f_local = arch.ffn_hidden_size // lay.tp
    nbytes = 2 * 2 * e * h * norm_tokens + 2 * 3 * e * h * norm_tokens  # two norms, two residual adds
    nbytes += 2 * e * tokens * (q_local + kv_local) if arch.rope else 0
    if moe:  # the router, permutation and experts' activation are never compiled
        nbytes += moe_time.elementwise_bytes(arch, lay, fp8) / (3 if not lay.fused_elementwise else 1)
    else:
        nbytes += 3 * e * tokens * f_local
    if arch.hidden_dropout > 0:
        nbytes += 2 * (2 * e + 1) * h * norm_tokens
    kernels = 8
    if not lay.fused_elementwise:  # eager chains: each intermediate goes through HBM
        nbytes, kernels = 3 * nbytes, 30
    if fp8:
        nbytes += (2 * e + 1) * tokens * (2 * h + q_local + f_local)
        kernels += 8
    return cluster.memory_seconds(nbytes, kernels)


def _tp_comm(arch: Architecture, lay: Layout, cluster: Cluster, tokens: float, moe: bool = False) -> float:
    """Seconds of one direction's tensor-parallel collectives of one layer (a mixture-of-experts
    layer: the attention's, and the shared experts' when there are some)."""
    if lay.tp == 1:
        return 0.0
    nbytes = lay.compute_bytes * tokens * arch.hidden_size
    bandwidth = cluster.link_bandwidth(lay.tp)
    blocks = 2 if not moe or arch.moe_shared_expert_size else 1
    if lay.sp:
        return blocks * (_gather(nbytes, lay.tp, bandwidth) + _gather(nbytes, lay.tp, bandwidth))
    return blocks * _all_reduce(nbytes, lay.tp, bandwidth)


def _cp_comm(arch: Architecture, lay: Layout, cluster: Cluster, tokens: float, attention: tuple) -> tuple:
    """(forward, backward) exposed seconds of context parallelism's exchanges for one layer."""
    if lay.cp == 1:
        return 0.0, 0.0
    kv_local = arch.local_kv_size(lay.tp)
    bandwidth = cluster.link_bandwidth(lay.tp * lay.cp)
    kv_bytes = lay.compute_bytes * tokens * 2 * kv_local
    if lay.cp_comm_type == "a2a":
        q_local = arch.query_size // lay.tp
        moved = lay.compute_bytes * tokens * (2 * q_local + 2 * kv_local) * (lay.cp - 1) / lay.cp / bandwidth
        return moved, moved
    exchange = (lay.cp - 1) * kv_bytes / bandwidth
    if lay.cp_comm_type == "all_gather":
        return exchange, 2 * exchange
    return max(0.0, exchange - attention[0]), max(0.0, 2 * exchange - attention[1])  # the ring overlaps


def layer_time(arch: Architecture, lay: Layout, cluster: Cluster, fp8: bool = False, moe: bool = False) -> LayerTime:
    """One layer's times; `moe`: a mixture-of-experts layer."""
    tokens = lay.micro_batch_size * lay.seq_length / lay.cp
    attention = _attention(arch, lay, cluster)
    cp = _cp_comm(arch, lay, cluster, tokens, attention)
    fsdp = 0.0
    gemm = _gemm_forward(arch, lay, cluster, tokens, fp8, moe)
    exchange = block = accumulation = 0.0
    if moe:
        accumulation = moe_time.grad_accumulation_seconds(arch, lay, cluster)
        exchange = moe_time.dispatch_seconds(arch, lay, cluster)
        experts = moe_time.gemm_forward_seconds(arch, lay, cluster, fp8)
        block = experts + exchange + cluster.memory_seconds(moe_time.elementwise_bytes(arch, lay, fp8), 12)
        gemm += experts
    if lay.fsdp2:  # gather the layer's weights (forward, backward), reduce-scatter its gradients
        shards = lay.dp * lay.cp
        weights = layer_parameters(arch, lay.tp, moe)  # a mixture-of-experts layer: its dense part
        bandwidth = cluster.link_bandwidth(lay.tp * lay.cp * lay.dp)
        moved = 2 * _gather(lay.compute_bytes * weights, shards, bandwidth)
        moved += _gather((2 if lay.grad_reduce_in_bf16 else 4) * weights, shards, bandwidth)
        fsdp = max(0.0, moved - 3 * gemm)
    tp = _tp_comm(arch, lay, cluster, tokens, moe)
    return LayerTime(gemm_forward=gemm, attention_forward=attention[0], attention_backward=attention[1],
                     elementwise_forward=_elementwise_forward(arch, lay, cluster, tokens, fp8, moe),
                     tp_forward=tp, tp_backward=tp, cp_forward=cp[0], cp_backward=cp[1], fsdp_exposed=fsdp,
                     ep_exchange=exchange, moe_block_forward=block, expert_grad_accumulation=accumulation)


def _recompute_seconds(lay: Layout, times: list) -> float:
    """Seconds of one micro-batch's recomputation over a stage's layers (their LayerTimes, in order)."""
    if lay.recompute_granularity == "selective":
        return sum(layer.attention_forward for layer in times)
    if lay.recompute_granularity == "full":
        count = len(times) if lay.recompute_method == "uniform" else min(lay.recompute_num_layers or 1, len(times))
        return sum(layer.forward for layer in times[:count])
    return sum(layer.moe_block_forward for layer in times) if lay.moe_layer_recompute else 0.0


def _head_seconds(arch: Architecture, lay: Layout, cluster: Cluster) -> tuple:
    """(forward, backward) of the output layer and the loss for one micro-batch (last stage)."""
    tokens = lay.micro_batch_size * lay.seq_length / lay.cp
    local_vocab = arch.vocab_size // lay.tp
    gemm = cluster.gemm_seconds(2 * tokens * arch.hidden_size * local_vocab)
    logits = lay.compute_bytes * tokens * local_vocab
    comm = _tp_comm(arch, lay, cluster, tokens) / 2
    return gemm + cluster.memory_seconds(logits, 2) + comm, 2 * gemm + cluster.memory_seconds(2 * logits, 2) + comm


@dataclass
class StepTime:
    seconds: float
    parts: dict = field(default_factory=dict)   # {name: seconds} that add up to `seconds`
    tokens_per_second: float = 0.0
    tokens_per_second_per_gpu: float = 0.0
    tflops_per_gpu: float = 0.0
    mfu: float = 0.0


def _stage_microbatch(arch: Architecture, lay: Layout, cluster: Cluster, stage: int, layers: int) -> dict:
    """Seconds of one micro-batch's forward, backward and recomputation on pipeline stage `stage`,
    and its exposed FSDP2 communication."""
    first_layer = sum(lay.layers_per_stage(arch.num_layers)[:stage])
    fp8_count = fp8_layers(arch, lay)
    skipped = (arch.num_layers - fp8_count) // 2 if lay.fp8 and fp8_count < arch.num_layers else 0
    kinds = {}
    times = []
    for index in range(first_layer, first_layer + layers):
        kind = (lay.fp8 and skipped <= index < skipped + fp8_count, arch.is_moe and arch.moe_layers[index] == 1)
        if kind not in kinds:
            kinds[kind] = layer_time(arch, lay, cluster, fp8=kind[0], moe=kind[1])
        times.append(kinds[kind])
    forward = sum(layer.forward for layer in times)
    backward = sum(layer.backward for layer in times)
    recompute = _recompute_seconds(lay, times)
    if stage == lay.pp - 1:
        head = _head_seconds(arch, lay, cluster)
        forward, backward = forward + head[0], backward + head[1]
    return {"forward": forward, "backward": backward, "recompute": recompute,
            "fsdp": sum(layer.fsdp_exposed for layer in times)}


def _reduction(lay: Layout, n: float, shards: int, bandwidth: float) -> tuple:
    """(gradient reduction, parameter gather) seconds of `n` parameters replicated over `shards` ranks."""
    if shards == 1 or not n:
        return 0.0, 0.0
    grad_bytes = (2 if lay.grad_reduce_in_bf16 else 4) * n
    if lay.distributed_optimizer:
        return _gather(grad_bytes, shards, bandwidth), _gather(lay.compute_bytes * n, shards, bandwidth)
    return _all_reduce(grad_bytes, shards, bandwidth), 0.0


def _data_parallel_seconds(arch: Architecture, lay: Layout, cluster: Cluster, stage: int, layers: int,
                           microbatch: dict) -> tuple:
    """(exposed gradient reduction, exposed parameter gather, optimizer step) seconds of one stage:
    the dense parameters over the data- and context-parallel ranks, the routed experts' over the
    expert-data-parallel ranks (both groups span the stage's TP x CP x DP ranks)."""
    first_layer = sum(lay.layers_per_stage(arch.num_layers)[:stage])
    n = stage_parameters(arch, lay.tp, layers, first=stage == 0, last=stage == lay.pp - 1, pp=lay.pp,
                         first_layer=first_layer)
    experts = stage_expert_parameters(arch, lay.ep, lay.etp, layers, first_layer, last=stage == lay.pp - 1)
    shards = lay.dp * lay.cp
    sharded = lay.distributed_optimizer or lay.fsdp2
    stepped = (n / shards + experts / lay.edp) if sharded else n + experts
    optimizer = cluster.memory_seconds(32 * stepped, 4)
    if lay.fsdp2:
        return 0.0, 0.0, optimizer
    bandwidth = cluster.link_bandwidth(lay.tp * lay.cp * lay.dp)
    dense = _reduction(lay, n, shards, bandwidth)
    expert = _reduction(lay, experts, lay.edp, bandwidth)
    reduce, gather = dense[0] + expert[0], dense[1] + expert[1]
    buckets = max(1, (n + experts) // BUCKET_ELEMENTS)
    if lay.overlap_grad_reduce:
        reduce = max(reduce / buckets, reduce - microbatch["backward"])
    if lay.overlap_param_gather:
        gather = max(gather / buckets, gather - microbatch["forward"])
    return reduce, gather, optimizer


def step_time(arch: Architecture, lay: Layout, cluster: Cluster) -> StepTime:
    """Predicted seconds per iteration, split into parts, and the throughput they give."""
    m = lay.num_microbatches
    stages = lay.layers_per_stage(arch.num_layers)
    best = None
    for stage, layers in enumerate(stages):
        mb = _stage_microbatch(arch, lay, cluster, stage, layers)
        reduce, gather, optimizer = _data_parallel_seconds(arch, lay, cluster, stage, layers, mb)
        per_microbatch = mb["forward"] + mb["backward"] + mb["recompute"] + mb["fsdp"]
        parts = {"forward": m * mb["forward"], "backward": m * mb["backward"], "recompute": m * mb["recompute"],
                 "FSDP2 exposed": m * mb["fsdp"], "DP gradient reduction": reduce, "DP parameter gather": gather,
                 "optimizer": optimizer}
        if lay.pp > 1:
            tokens = lay.micro_batch_size * lay.seq_length / lay.cp
            boundary = lay.compute_bytes * tokens * arch.hidden_size / (lay.tp if lay.sp else 1)
            span = lay.tp * lay.cp * lay.dp * 2
            # overlapped, only the warm-up's and the cool-down's transfers wait on the link
            transfers = 2 * (lay.pp - 1) if lay.overlap_p2p_comm else 2 * m
            parts["PP send/receive"] = transfers * boundary / cluster.link_bandwidth(span)
            parts["pipeline bubble"] = (lay.pp - 1) / lay.vpp * per_microbatch
        total = sum(parts.values())
        if best is None or total > best[0]:
            best = (total, parts)
    seconds, parts = best
    tokens = lay.global_batch_size * lay.seq_length
    flops = flops_per_iteration(arch, lay.global_batch_size, lay.seq_length)
    tflops = flops / seconds / lay.world_size / 1e12
    return StepTime(seconds=seconds, parts={k: v for k, v in parts.items() if v}, tokens_per_second=tokens / seconds,
                    tokens_per_second_per_gpu=tokens / seconds / lay.world_size, tflops_per_gpu=tflops,
                    mfu=tflops * 1e12 / cluster.gpu.bf16_flops)
