"""tools/plan.py for mixture-of-experts models (Mixtral 8x7B, Qwen3-30B-A3B as the examples train
them) on H100 nodes: a fitting plan with the experts' memory terms and the flags' EP, a --top table
ranked over EP and ETP whose layouts all pass start-up validation, the whole model's and the active
parameter counts of the published models, and the token exchange's time against its definition."""
from pathlib import Path

import pytest

from megatron.training.arguments import parse_args
from megatron.training.planning.architecture import active_parameters, architecture, total_parameters
from megatron.training.planning.hardware import cluster
from megatron.training.planning.layout import Layout
from megatron.training.planning.plan import model_architecture
from megatron.training.planning.search import search
from megatron.training.planning.timing import layer_time
from megatron.training.validation import validate
from tests.unit.test_planning_tool import plan_tool

COMMON = ("--position-embedding-type rope --rotary-base 1000000 --normalization RMSNorm --swiglu --disable-bias-linear "
          "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --moe-grouped-gemm "
          "--moe-token-dispatcher-type alltoall --bf16 --seq-length 4096").split()
MIXTRAL_8X7B = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
                "--group-query-attention --num-query-groups 8 --num-experts 8 --moe-router-topk 2 "
                "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --vocab-size 32000 "
                "--max-position-embeddings 32768").split() + COMMON
QWEN3_30B_A3B = ("--num-layers 48 --hidden-size 2048 --num-attention-heads 32 --kv-channels 128 "
                 "--group-query-attention --num-query-groups 4 --num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8 "
                 "--ffn-hidden-size 6144 --qk-layernorm --moe-router-load-balancing-type global_aux_loss "
                 "--moe-aux-loss-coeff 1e-3 --vocab-size 151936 --max-position-embeddings 40960").split() + COMMON


def architecture_of(flags: list, tp: int = 1):
    config = parse_args(flags + ["--lr", "0", "--train-iters", "1", "--mock-data", "--micro-batch-size", "1"])
    return model_architecture(config, config.data.vocab_size, tp)


@pytest.mark.parametrize("flags, total, active, rounding", [
    (MIXTRAL_8X7B, 46.7e9, 12.9e9, 0.005),   # Mistral AI's Mixtral 8x7B announcement: 46.7B total, 12.9B per token
    (QWEN3_30B_A3B, 30.5e9, 3.3e9, 0.02),    # the Qwen3-30B-A3B model card: 30.5B in total, 3.3B activated
])
def test_parameters_of_the_published_models(flags, total, active, rounding):
    """The published counts, within their rounding (3.3B stands for 3.35B)."""
    arch = architecture_of(flags)
    assert total_parameters(arch) == pytest.approx(total, rel=rounding)
    assert active_parameters(arch) == pytest.approx(active, rel=rounding)


def test_mixtral_plan_at_the_flags_layout():
    result = plan_tool("--nodes", "8", "--", *MIXTRAL_8X7B, "--micro-batch-size", "1", "--global-batch-size", "256",
                       "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "4",
                       "--expert-model-parallel-size", "8", "--use-distributed-optimizer", "--overlap-grad-reduce",
                       "--overlap-param-gather", "--moe-layer-recompute", "--recompute-granularity", "selective")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    docs = (Path(__file__).resolve().parents[2] / "docs" / "planning.md").read_text()
    for line in out.splitlines():  # docs/planning.md prints this plan: it must stay the planner's
        assert line in docs, line
    assert "(64 GPUs used): TP1 PP4 x VPP2 CP1 DP16 EP8 ETP1 mbs 1 dist-opt" in out
    assert "32 mixture-of-experts layers of 8 experts, top-2" in out and "12.88 B active" in out
    for term in ("expert weights", "expert gradients", "expert optimizer state", "recompute working set"):
        assert f"    {term} " in out
    assert "verdict: fits on H100" in out


@pytest.mark.parametrize("flags, nodes, batch", [(MIXTRAL_8X7B, "2", "64"), (QWEN3_30B_A3B, "1", "64")])
def test_top_layouts_range_over_expert_parallelism_and_pass_validation(flags, nodes, batch):
    result = plan_tool("--nodes", nodes, "--top", "12", "--", *flags, "--micro-batch-size", "1",
                       "--global-batch-size", batch)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = lines[1].split()
    assert header[6:8] == ["EP", "ETP"]
    rows = [line.split() for line in lines[2:14]]
    assert len(rows) == 12 and all(row[0].isdigit() for row in rows)
    assert any(int(row[6]) > 1 for row in rows)
    for row in rows:  # every ranked layout starts: the flags it stands for pass start-up validation
        tp, pp, vpp, cp, dp, ep, etp, mbs = (int(value) for value in row[1:9])
        layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                  "--context-parallel-size", str(cp), "--expert-model-parallel-size", str(ep),
                  "--expert-tensor-parallel-size", str(etp), "--micro-batch-size", str(mbs)]
        if tp > 1:
            layout.append("--sequence-parallel")
        if vpp > 1:
            layout += ["--num-virtual-stages-per-pipeline-rank", str(vpp)]
        config = parse_args([*flags, *layout, "--global-batch-size", batch, "--lr", "0", "--train-iters", "1",
                             "--mock-data", "--use-distributed-optimizer"])
        validate(config, tp * pp * cp * dp)
    assert "the best layout in detail:" in result.stdout and "verdict: fits on H100" in result.stdout


def test_token_exchange_time_is_its_definition():
    """EP8 inside a node: each rank sends 7/8 of its T x k rows of h bf16 values to the others and
    gets as many back (dispatch and combine) over the node's links. EP8 x ETP2 over two nodes: the
    EP group's ranks are every second of 16 GPUs, 4 per node, so 4/8 of the rows cross the network
    (the slower part sets the time), and ETP all-gathers and reduce-scatters the rows inside a node.
    The allgather dispatcher: a ring all-gather of all EP ranks' tokens and a reduce-scatter back."""
    arch = architecture_of(MIXTRAL_8X7B)
    target = cluster("h100-80gb", nodes=2)
    lay = Layout(tp=1, pp=1, cp=1, dp=8, micro_batch_size=1, global_batch_size=8, seq_length=4096, ep=8)
    rows, h = 4096 * 2, 4096
    expected = 2 * 2 * rows * h * 7 / 8 / (450e9 * 0.8)
    assert layer_time(arch, lay, target, moe=True).ep_exchange == pytest.approx(expected, rel=1e-9)
    assert layer_time(arch, lay, target, moe=False).ep_exchange == 0.0
    across = lay.replace(tp=2, dp=8, etp=2, sequence_parallel=True)  # EP8 x ETP2 spans 16 GPUs: two nodes
    tokens = 4096 / 2
    exchange = 2 * max(2 * tokens * 2 * h * 3 / 8 / (450e9 * 0.8), 2 * tokens * 2 * h * 4 / 8 / (50e9 * 0.8))
    gather = 2 * (1 / 2) * 2 * (2 * tokens * 2) * h / (450e9 * 0.8)
    assert layer_time(arch, across, target, moe=True).ep_exchange == pytest.approx(exchange + gather, rel=1e-9)
    # allgather over EP 4 inside a node: every rank's tokens with their probabilities (bf16) and
    # routing (int64) over the 8 experts gathered, the outputs reduce-scattered
    allgather = lay.replace(ep=4, dp=4)
    arch_ag = architecture_of([flag if flag != "alltoall" else "allgather" for flag in MIXTRAL_8X7B])
    row = 2 * h + (2 + 8) * 8
    expected = 3 / 4 * 4 * 4096 * row / (450e9 * 0.8) + 3 / 4 * 4 * 4096 * 2 * h / (450e9 * 0.8)
    assert layer_time(arch_ag, allgather, target, moe=True).ep_exchange == pytest.approx(expected, rel=1e-9)


def test_expert_weight_gradients_cost_time_only_where_their_gemm_does_not_accumulate():
    """With --gradient-accumulation-fusion on a GPU that runs the grouped GEMMs, the grouped weight
    gradient's fp32 product is added into main_grad (16 bytes per local expert weight and
    micro-batch: the product written and read, main_grad read and written); with --moe-grouped-wgrad
    triton the GEMM accumulates into main_grad itself, whose traffic (8 bytes) an H200 measured on
    top of the GEMM; on a GPU without grouped GEMMs (A100) each expert's GEMM accumulates in place:
    nothing beyond the GEMM, as for the dense linears. Without the fusion,
    under FP8 (the GEMM's product in bf16) or FSDP2 (no main_grad buffer), 12 bytes: bf16 written
    and read, fp32 main_grad read and written. auto, the default, costs the cheaper of grouped-mm
    and per-expert, and under FP8 the cheaper of the product added and per-expert accumulation in bf16."""
    arch = architecture_of(MIXTRAL_8X7B)
    target = cluster("h100-80gb")
    lay = Layout(tp=1, pp=1, cp=1, dp=8, micro_batch_size=1, global_batch_size=8, seq_length=4096, ep=8)
    local_weights = 3 * 4096 * 14336  # one expert per rank at EP 8
    unfused = target.memory_seconds(12 * local_weights, 2)
    grouped = target.memory_seconds(16 * local_weights, 2)
    assert layer_time(arch, lay.replace(moe_grouped_wgrad="grouped-mm"), target,
                      moe=True).expert_grad_accumulation == pytest.approx(grouped, rel=1e-9)
    # auto (the default): the faster of the two, as the start-up probe picks; here per-expert's
    assert lay.moe_grouped_wgrad == "auto"
    assert layer_time(arch, lay, target, moe=True).expert_grad_accumulation == pytest.approx(
        min(grouped, target.memory_seconds(8 * local_weights, 0)), rel=1e-9)
    in_gemm = target.memory_seconds(8 * local_weights, 2)
    assert layer_time(arch, lay.replace(moe_grouped_wgrad="triton"), target,
                      moe=True).expert_grad_accumulation == pytest.approx(in_gemm, rel=1e-9)
    # per-expert: the same 8 bytes; at EP 8 one local expert, so its GEMM is the grouped one's size
    assert layer_time(arch, lay.replace(moe_grouped_wgrad="per-expert"), target,
                      moe=True).expert_grad_accumulation == pytest.approx(target.memory_seconds(8 * local_weights, 0),
                                                                          rel=1e-9)
    # ... and at EP 1 eight GEMMs an eighth the size each: slower than one grouped GEMM (a launch
    # each at least), counted on top
    ep1 = lay.replace(ep=1, moe_grouped_wgrad="per-expert")
    extra = layer_time(arch, ep1, target, moe=True).expert_grad_accumulation - target.memory_seconds(
        8 * 8 * local_weights, 0)
    assert extra >= (8 - 1) * 2 * target.table["launch_seconds"] - 1e-12
    assert layer_time(arch, lay, cluster("a100-80gb"), moe=True).expert_grad_accumulation == 0.0
    for other in (lay.replace(gradient_accumulation_fusion=False), lay.replace(fp8=True), lay.replace(fsdp2=True)):
        assert layer_time(arch, other, target, moe=True).expert_grad_accumulation == pytest.approx(unfused, rel=1e-9)
    # FP8 under auto: also the probe's per-expert bf16 accumulation (main_grad read and written, 8
    # bytes; the gradient's and input's rows widened, 1 byte read and 2 written; the weight-gradient
    # GEMMs at the bf16 rate instead of FP8's). At EP 8 (8192 rows per expert) the FP8 product added
    # stays cheaper (above); at EP 1 (1024 rows per expert, eight experts) the accumulation is.
    rows, f, h = 1024, 14336, 4096
    gemms = {fp8: 8 * (target.gemm_seconds(2 * rows * h * 2 * f, fp8) + target.gemm_seconds(2 * rows * f * h, fp8))
             for fp8 in (False, True)}
    accumulating = target.memory_seconds(8 * 8 * local_weights + 3 * rows * 8 * (2 * f + h + h + f), 2) + (
        gemms[False] - gemms[True])
    fp8_ep1 = layer_time(arch, lay.replace(ep=1, fp8=True), target, moe=True).expert_grad_accumulation
    assert fp8_ep1 == pytest.approx(accumulating, rel=1e-9)
    assert accumulating < target.memory_seconds(12 * 8 * local_weights, 2)
    assert layer_time(arch, lay.replace(ep=1, fp8=True, moe_grouped_wgrad="per-expert"), target,
                      moe=True).expert_grad_accumulation == pytest.approx(target.memory_seconds(12 * 8 * local_weights, 2),
                                                                          rel=1e-9)
    from megatron.training.planning.plan import plan_for_flags

    flags = [*MIXTRAL_8X7B, "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "0", "--train-iters", "1",
             "--mock-data", "--expert-model-parallel-size", "8"]
    for extra, fused in (([], True), (["--no-gradient-accumulation-fusion"], False)):
        plan = plan_for_flags(parse_args(flags + extra), 32000, 8, target)
        assert plan.layout.gradient_accumulation_fusion is fused
    for choice in ("triton", "per-expert", "grouped-mm"):
        assert plan_for_flags(parse_args(flags + ["--moe-grouped-wgrad", choice]), 32000, 8,
                              target).layout.moe_grouped_wgrad == choice


def test_search_sizes_come_from_the_validation_rules():
    arch = architecture_of(QWEN3_30B_A3B)
    base = Layout(tp=1, pp=1, cp=1, dp=8, micro_batch_size=1, global_batch_size=64, seq_length=4096)
    plans, tried = search(lambda tp: arch, base, cluster("h200"), top=400)
    assert plans and tried > 400
    for plan in plans:
        lay = plan.layout
        assert arch.num_experts % lay.ep == 0 and (lay.tp * lay.dp * lay.cp) % (lay.ep * lay.etp) == 0
        assert lay.etp in (1, lay.tp) and not lay.fsdp2


@pytest.mark.parametrize("flags", [["--bf16"], ["--bf16", "--use-distributed-optimizer", "--moe-layer-freq", "[0]+[1]"]])
def test_expert_terms_are_the_start_up_figures_of_the_built_run(flags):
    """Dense plus expert terms are the built run's parameter and optimizer bytes (one process)."""
    import pretrain_gpt
    from megatron.training.memory import theoretical_bytes
    from megatron.training.planning.layout import layout_from_config
    from megatron.training.planning.memory import expert_terms, persistent_terms
    from megatron.training.training import setup
    from tests.unit.test_memory_estimate import TINY

    config = parse_args(TINY + ["--num-experts", "4", "--moe-ffn-hidden-size", "32"] + flags)
    run = setup(config, pretrain_gpt.forward_step, 255)
    built = theoretical_bytes(run.model.chunks, run.model.optimizer)
    arch = architecture(run.model.config)
    lay = layout_from_config(config, run.model.config, 1)
    dense = persistent_terms(arch, lay, 2, first=True, last=True)
    experts = expert_terms(arch, lay, 2)
    assert dense["weights"] + experts["expert weights"] == built["parameters"]
    assert dense["optimizer state"] + experts["expert optimizer state"] == built["optimizer_state"]
    gradients = dense["gradients"] + experts["expert gradients"]
    assert gradients <= built["gradients"] <= gradients * 1.02


def test_a_moe_plan_that_does_not_fit_names_the_expert_flags():
    result = plan_tool("--nodes", "1", "--", *QWEN3_30B_A3B, "--micro-batch-size", "1", "--global-batch-size", "64",
                       "--expert-model-parallel-size", "2")
    assert result.returncode == 1 and "verdict: does not fit on H100" in result.stdout
    from megatron.training.planning.plan import plan_for_flags, reducing_flags

    config = parse_args(QWEN3_30B_A3B + ["--micro-batch-size", "1", "--global-batch-size", "64", "--lr", "0",
                                         "--train-iters", "1", "--mock-data", "--expert-model-parallel-size", "2"])
    hints = reducing_flags(plan_for_flags(config, 151936, 8, cluster("h100-80gb")))
    assert hints[0] == "--expert-model-parallel-size 4"  # the experts' state is most of the memory
    assert "--use-distributed-optimizer" in hints and not any("fsdp2" in hint for hint in hints)


def _fp8_cache_bytes(chunks) -> tuple:
    """(dense, routed experts) bytes of the FP8 weight casts the built model holds after a step."""
    from megatron.core.transformer.fp8 import FP8Linear

    seen, totals = set(), {"dense": 0, "experts": 0}

    def count(linear, kind):
        for tensor in (t for pair in (linear._weight or {}).values() for t in pair):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                totals[kind] += storage.nbytes()

    for chunk in chunks:
        for module in chunk.modules():
            fp8 = getattr(module, "fp8", None)
            if isinstance(fp8, FP8Linear):
                count(fp8, "dense")
            elif isinstance(fp8, dict):  # the routed experts: one FP8Linear per expert and stacked weight
                for experts in fp8.values():
                    for linear in experts.linears:
                        count(linear, "experts")
    return totals["dense"], totals["experts"]


def test_fp8_weight_copies_are_the_casts_the_built_run_caches():
    """With FP8 the plan counts each weight's cast and its transpose (1 byte each), the routed
    experts' as their own term; after a training step the built model holds that many bytes."""
    import pretrain_gpt
    from megatron.training.data import build_loader
    from megatron.core.datasets.mock_dataset import MockGPTDataset
    from megatron.training.planning.layout import layout_from_config
    from megatron.training.planning.memory import memory_per_stage
    from megatron.training.training import setup, train_step
    from tests.unit.test_memory_estimate import TINY

    config = parse_args(TINY + ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--bf16", "--fp8-format",
                                "hybrid", "--fp8-recipe", "tensorwise", "--disable-bias-linear"])
    run = setup(config, pretrain_gpt.forward_step, 255)
    dataset = MockGPTDataset(run.batches.global_batch_size, 16, 255, seed=1)
    train_step(run, [iter(build_loader(dataset, 0, 2, run.groups, 0))])
    dense, experts = _fp8_cache_bytes(run.model.chunks)
    lay = layout_from_config(config, run.model.config, 1)
    terms = memory_per_stage(architecture(run.model.config), lay)[0].terms
    # the casts hold a 4-byte scale each besides the 1-byte elements the plan counts (< 0.1% here)
    assert experts > 0 and abs(terms["expert FP8 weight copies"] / experts - 1) < 0.001
    # the dense term also counts the layers' norms and routers, which are never cast (a few % here)
    assert 0.999 * dense <= terms["FP8 weight copies"] <= 1.05 * dense
