"""The mixture-of-experts layer in the plan: what its router, dispatcher, routed and shared experts
save for backward, and what they cost in time, on one rank for one micro-batch.

Notation: T tokens of this rank enter the layer (micro-batch x sequence / CP, / TP with sequence
parallelism, which mixture of experts with TP > 1 requires); E experts, k = top-k, h hidden size,
f = --moe-ffn-hidden-size / ETP, e bytes per element of the compute dtype. Routing is taken to be
balanced (what --moe-router-force-load-balancing gives, and what the auxiliary losses aim at):
- rows sent: each rank's tokens leave once per chosen expert, T x k rows; with a capacity factor
  each expert takes at most C = ceil(T k / E x factor) of them (Megatron-Core's per-rank rule), so
  E x C rows with --moe-pad-expert-input-to-capacity and T k min(1, factor) without;
- rows computed: a rank receives as many rows as it sends, and ETP ranks all hold every row of
  their experts, so N = ETP x rows sent.

Saved for backward (counted tensor by tensor from megatron/core/transformer/moe/, checked against
saved-tensor hooks in tests/distributed/test_planning_moe.py):
- router: the top-k indices (int64) and their softmax (fp32), T x k each; the probabilities, T x E,
  and the slots' expert indices, T x k int64, which the dispatcher's permutation keeps (the
  allgather dispatcher keeps them for all EP x ETP ranks' tokens; with
  --moe-pad-expert-input-to-capacity the routing mask, T x E bool, instead of the slots); a load-balancing loss keeps its scores
  (fp32, T x E) and top-k; capacity keeps the kept rows' indices (int64, C x E); --moe-router-dtype
  keeps an fp32 copy of the input and of the router weight;
- dispatcher: the permutation's row indices and order (int64, two per row); without an exchange
  (the allgather dispatcher, or alltoall at EP x ETP 1) every slot is a row, N = permuted tokens x k
  (at EP > 1 the slots of other ranks' experts too: static shapes); alltoall with an exchange also
  the experts' order (int64, N) and the returned rows [T k, h] (the combine weights them);
- experts: their input [N, h], fc1's output, the activation's output and (gated) the product
  [N, 4f or 2f], the probabilities [N], fc2's output [N, h] and one more [N, h]: the weighted
  output where the combine scatters (`index_add` keeps its source: capacity padding); none where
  the combine gathers each token's rows (it keeps only indices; the experts' activation is never
  compiled);
- shared experts: a dense MLP of their size (the dense MLP's terms, over the TP group's gathered
  tokens with sequence parallelism), and with the gate its output [T, h] and the gate [T].
--moe-layer-recompute keeps none of these (the block's input is the norm's output, already counted)
and re-runs one block at a time in backward.
"""
import math

from megatron.training.planning.architecture import expert_layer_parameters

FP32, INT64 = 4, 8


def tokens_in(lay) -> float:
    """T: tokens of one micro-batch entering a mixture-of-experts layer on one rank."""
    tokens = lay.micro_batch_size * lay.seq_length / lay.cp
    return tokens / lay.tp if lay.sp else tokens


def capacity(arch, tokens: float) -> int:
    return math.ceil(tokens * arch.moe_router_topk / arch.num_experts * arch.moe_capacity_factor)


def rows_sent(arch, lay) -> float:
    """Rows this rank's permutation sends to the experts (balanced routing)."""
    tokens = tokens_in(lay)
    if arch.moe_capacity_factor is None:
        return tokens * arch.moe_router_topk
    if arch.moe_pad_to_capacity:
        return arch.num_experts * capacity(arch, tokens)
    return tokens * arch.moe_router_topk * min(1.0, arch.moe_capacity_factor)


def rows_computed(arch, lay) -> float:
    """N: rows this rank's experts run (each of width f)."""
    return lay.etp * rows_sent(arch, lay)


def _dense_mlp_bytes(arch, lay, ffn_hidden_size: int, tokens: float) -> float:
    e, f_local = lay.compute_bytes, ffn_hidden_size / lay.tp
    if arch.gated_linear_unit:
        return e * tokens * f_local * (3 if lay.fused_elementwise else 4)
    return 2 * e * tokens * f_local


def block_activation_terms(arch, lay) -> dict:
    """{part: bytes} a mixture-of-experts block (router, dispatch, experts, shared experts) saves
    for backward, beyond its input."""
    a, e, h = arch, lay.compute_bytes, arch.hidden_size
    T, E, k = tokens_in(lay), arch.num_experts, arch.moe_router_topk
    probs = FP32 if a.moe_router_fp32 else e
    sent, n = rows_sent(a, lay), rows_computed(a, lay)
    f = a.moe_ffn_hidden_size / lay.etp
    permuted = T * lay.ep * lay.etp if a.moe_dispatcher == "allgather" else T  # the tokens permute sees
    static = not a.moe_pad_to_capacity  # the sort of top-k slots; padding to capacity keeps nonzero's mask
    exchanges = a.moe_dispatcher == "alltoall" and lay.ep * lay.etp > 1
    if static and not exchanges:  # every gathered slot is a row, those of other ranks' experts too
        n = permuted * k
    router = (INT64 + FP32) * T * k + ((probs * E + INT64 * k) if static else (1 + probs) * E) * permuted
    if a.moe_router_fp32 and e != FP32:
        router += FP32 * (T + E) * h - (0 if a.moe_shared_expert_size else e * T * h)
    if a.moe_aux_loss:
        router += FP32 * T * E + INT64 * T * k
    if a.moe_capacity_factor is not None:
        router += INT64 * capacity(a, T) * E + (0 if a.moe_pad_to_capacity else T * E)
    dispatch = 2 * INT64 * (sent if exchanges else n)
    if exchanges:  # the experts' order, and the returned rows the combine weights by the probabilities
        dispatch += INT64 * n + e * sent * h
    experts = e * n * ((2 if static else 3) * h + (4 if a.gated_linear_unit else 2) * f + 1)
    terms = {"router": router, "dispatch": dispatch, "experts": experts}
    if a.moe_shared_expert_size:  # a dense MLP: over the TP group's gathered tokens with SP
        terms["shared experts"] = _dense_mlp_bytes(a, lay, a.moe_shared_expert_size, T * lay.tp if lay.sp else T)
        if a.moe_shared_expert_gate:
            terms["shared experts"] += e * T * (h + 1)
    return terms


def _a2a_seconds(nbytes: float, group: int, span: int, cluster) -> float:
    """An all-to-all in which each of `group` ranks (spread over `span` consecutive GPUs) sends
    `nbytes`, spread evenly over the group: the parts to ranks on the same node over the node's
    links and the rest over the network, at the same time."""
    if group == 1:
        return 0.0
    on_node = group * min(1.0, cluster.gpus_per_node / span)
    inside = nbytes * (on_node - 1) / group / cluster.link_bandwidth(1)
    outside = nbytes * (group - on_node) / group / cluster.link_bandwidth(cluster.gpus_per_node + 1)
    return max(inside, outside)


def dispatch_seconds(arch, lay, cluster) -> float:
    """One direction's token exchange of one layer (dispatch + combine; backward moves the same):
    alltoall sends each rank's rows over EP and all-gathers / reduce-scatters them over ETP;
    allgather all-gathers the tokens (with their probabilities and routing) over ETP x EP and
    reduce-scatters the outputs. Not overlapped with compute here."""
    e, h, T = lay.compute_bytes, arch.hidden_size, tokens_in(lay)
    group = lay.ep * lay.etp
    if group == 1:
        return 0.0
    if arch.moe_dispatcher == "allgather":
        row = e * h + (e + INT64) * arch.num_experts  # hidden, probabilities, routing (gathered as int64)
        gathered = group * T * row
        bandwidth = cluster.link_bandwidth(group)
        return (group - 1) / group * gathered / bandwidth + (group - 1) / group * group * T * e * h / bandwidth
    moved = 2 * _a2a_seconds(e * rows_sent(arch, lay) * h, lay.ep, group, cluster)
    if lay.etp > 1:
        full = e * rows_computed(arch, lay) * h
        moved += 2 * (lay.etp - 1) / lay.etp * full / cluster.link_bandwidth(lay.etp)
    return moved


def gemm_forward_seconds(arch, lay, cluster, fp8: bool = False) -> float:
    """Forward GEMMs of the router, the routed experts and the shared experts. Where the GPU runs
    `torch._grouped_mm` (whatever --moe-grouped-gemm says, as the experts do) the local experts'
    rows run as one grouped GEMM per linear, at the throughput of one GEMM of their total work;
    elsewhere, one GEMM per local expert and linear.
    `fp8`: the experts' and shared experts' GEMMs at the FP8 rate (the router stays in bf16)."""
    h, T = arch.hidden_size, tokens_in(lay)
    seconds = cluster.gemm_seconds(2 * T * h * arch.num_experts)
    seconds += _routed_expert_gemm_seconds(arch, lay, cluster, cluster.gpu.grouped_gemm, fp8)
    if arch.moe_shared_expert_size:
        # the shared experts see the whole sequence of the TP group (gathered like the dense MLP)
        tokens = T * lay.tp if lay.sp else T
        shared = arch.moe_shared_expert_size / lay.tp
        sfc1 = (2 if arch.gated_linear_unit else 1) * shared
        seconds += cluster.gemm_seconds(2 * tokens * h * sfc1, fp8) + cluster.gemm_seconds(2 * tokens * shared * h, fp8)
    return seconds


def _routed_expert_gemm_seconds(arch, lay, cluster, grouped: bool, fp8: bool = False) -> float:
    """One GEMM pass (forward, or one of the two gradients) of the local experts' two linears: one
    grouped GEMM per linear at the throughput of one GEMM of their total work (`grouped`), else one
    GEMM per local expert and linear."""
    h = arch.hidden_size
    local_experts = arch.num_experts // lay.ep
    rows = rows_computed(arch, lay) / local_experts
    f = arch.moe_ffn_hidden_size / lay.etp
    fc1 = (2 if arch.gated_linear_unit else 1) * f
    if grouped:
        return cluster.gemm_seconds(2 * local_experts * rows * h * fc1, fp8) + cluster.gemm_seconds(
            2 * local_experts * rows * f * h, fp8)
    return local_experts * (cluster.gemm_seconds(2 * rows * h * fc1, fp8) + cluster.gemm_seconds(2 * rows * f * h, fp8))


def grad_accumulation_seconds(arch, lay, cluster) -> float:
    """The routed experts' weight gradients per micro-batch, beyond their GEMMs. With
    --gradient-accumulation-fusion (and a main_grad buffer: not FSDP2): where the GPU runs the
    grouped GEMMs, one grouped GEMM per weight writes its fp32 product [E, n, k] and one pass adds it
    into main_grad (written and read 8 bytes, main_grad read and written 8), unless
    --moe-grouped-wgrad triton, whose GEMM adds into main_grad itself: main_grad read and written, 8
    bytes, which an H200 showed it does not hide under its GEMM (its time at the presets' shapes was
    the GEMM's plus that traffic's), or --moe-grouped-wgrad per-expert, one GEMM per expert
    accumulating into main_grad: the same 8 bytes, plus what the per-expert GEMMs take beyond the
    grouped one (smaller GEMMs, a launch each), or auto (the default), the faster of grouped-mm and
    per-expert, as the start-up probe picks; elsewhere each expert's GEMM accumulates in place
    (nothing more). Under FP8, or
    without the fusion, the GEMM writes its product in the compute dtype and it is added to
    main_grad: written and read in the compute dtype, main_grad read and written (the FP8 loop's
    direct write on a step's first micro-batch is not counted); under FP8 with the fusion and auto,
    where the GPU runs grouped GEMMs, the cheaper of that and the probe's third path: per expert,
    bf16 GEMMs of the widened casts accumulating into main_grad (8 bytes, the weight gradient at the
    bf16 rate instead of FP8's, the gradient's and input's rows widened: 1 byte read, 2 written)."""
    weights = expert_layer_parameters(arch, lay.ep, lay.etp, weights_only=True)
    product = cluster.memory_seconds((2 * lay.compute_bytes + 2 * FP32) * weights, 2)
    if (lay.fp8 and lay.gradient_accumulation_fusion and not lay.fsdp2 and lay.moe_grouped_wgrad == "auto"
            and cluster.gpu.grouped_gemm):
        n, h, f = rows_computed(arch, lay), arch.hidden_size, arch.moe_ffn_hidden_size / lay.etp
        fc1 = (2 if arch.gated_linear_unit else 1) * f
        accumulating = (cluster.memory_seconds(2 * FP32 * weights + 3 * n * (fc1 + h + h + f), 2)
                        + _routed_expert_gemm_seconds(arch, lay, cluster, False)
                        - _routed_expert_gemm_seconds(arch, lay, cluster, False, fp8=True))
        return min(product, accumulating)
    if lay.gradient_accumulation_fusion and not lay.fsdp2 and not lay.fp8:
        if not cluster.gpu.grouped_gemm:
            return 0.0
        per_expert = cluster.memory_seconds(2 * FP32 * weights, 0) + max(
            0.0, _routed_expert_gemm_seconds(arch, lay, cluster, False)
            - _routed_expert_gemm_seconds(arch, lay, cluster, True))
        grouped = cluster.memory_seconds((2 if lay.moe_grouped_wgrad == "triton" else 4) * FP32 * weights, 2)
        if lay.moe_grouped_wgrad == "auto":  # the start-up probe takes the faster
            return min(per_expert, grouped)
        return per_expert if lay.moe_grouped_wgrad == "per-expert" else grouped
    return product


def elementwise_bytes(arch, lay, fp8: bool = False) -> float:
    """Bytes the router's softmax and top-k, the permutation, the experts' activation and the
    weighting and un-permutation, and the shared experts' activation read and write in one forward
    (`fp8`: also each expert linear's input read in bf16 and written in FP8)."""
    e, h, T = lay.compute_bytes, arch.hidden_size, tokens_in(lay)
    n, f = rows_computed(arch, lay), arch.moe_ffn_hidden_size / lay.etp
    router = 3 * FP32 * T * arch.num_experts
    permutation = 2 * e * rows_sent(arch, lay) * h * (2 if arch.moe_dispatcher == "alltoall" else 1)
    experts = 3 * e * n * f + 3 * e * n * h  # activation (gate, up -> product), weighting by the probabilities
    shared = 3 * e * (T * lay.tp if lay.sp else T) * arch.moe_shared_expert_size / lay.tp
    casts = (e + 1) * n * (h + f) if fp8 else 0.0
    return router + 2 * permutation + experts + shared + casts
