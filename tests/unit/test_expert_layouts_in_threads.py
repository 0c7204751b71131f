"""Expert-parallel layouts checked in one process, every rank a thread over PyTorch's threaded process
group (tests/threaded_ranks.py), in seconds rather than the minutes of the multi-process runs:

- the MoE layer at each layout equals one process on the same tokens: each rank's output and input
  gradient, and each expert's weight and bias gradients summed over the ranks holding that expert
  (dispatch and combine must be inverses, the all-to-all's return order included, and fc2's bias
  added once over the expert-tensor-parallel ranks);
- each parameter's gradient is reduced over the ranks that hold the same copy of it: an expert's
  over the ranks holding that expert (expert-data-parallel), a dense one over the data ranks;
- checkpoint keys name experts by their global index: the union of every rank's expert boxes is
  the one-process checkpoint, key for key and value for value.
The multi-process parity runs (tests/distributed/test_expert_parallel.py) stay the end-to-end proof.
"""
import collections
import dataclasses
import re

import pytest
import torch
import torch.distributed as dist

from megatron.core.checkpointing import state as ckpt_state
from megatron.core.checkpointing.sharded import ShardedState
from megatron.core.distributed.ddp import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import initialize_model_parallel, single_process
from megatron.core.transformer.config import ExecutionConfig, TransformerConfig, derive
from megatron.core.transformer.moe.moe_layer import MoELayer
from tests.threaded_ranks import run_ranks

HIDDEN, EXPERTS, SEQ, BATCH, SEED = 16, 4, 6, 2, 5
CPU = torch.device("cpu")


def moe_config(**overrides) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, padded_vocab_size=64, ffn_hidden_size=24,
                num_experts=EXPERTS, moe_ffn_hidden_size=12, moe_router_topk=2, swiglu=True,
                add_bias_linear=True, hidden_dropout=0.0, attention_dropout=0.0,
                moe_router_load_balancing_type="none", moe_shared_expert_intermediate_size=8,
                max_position_embeddings=SEQ)
    return derive(TransformerConfig(**(base | overrides)))


# (world size, tp, ep, etp): every way the experts' rows and hidden size are split over ranks.
LAYOUTS = {"ep2": (2, 1, 2, 1), "ep4": (4, 1, 4, 1), "tp2 sp etp2": (2, 2, 1, 2),
           "tp2 sp ep2 etp1": (4, 2, 2, 1), "tp2 sp ep2 etp2": (4, 2, 2, 2)}
LAYER_CASES = [(layout, dispatcher) for layout in LAYOUTS for dispatcher in ("alltoall", "allgather")]


def _full_parts(param: torch.Tensor, layout) -> dict:
    """A one-process parameter as the {part: full tensor} that TPLayout.full_to_local takes."""
    return {part.name: param.narrow(layout.dim, offset, length) for part, offset, length in layout.local_offsets()}


def _local(reference_param, reference_layout, param) -> torch.Tensor:
    """This rank's piece of a one-process tensor: its tensor-parallel slice, and for a routed expert
    tensor [E, ...] its experts' rows."""
    local = param.tp_layout.full_to_local(_full_parts(reference_param, reference_layout))
    if hasattr(param, "expert_offset"):
        local = local[param.expert_offset:param.expert_offset + param.shape[0]]
    return local


def _reference_layer(config):
    """The one-process layer, every parameter drawn from one seeded generator (biases nonzero)."""
    layer = MoELayer(config, execution=ExecutionConfig(params_dtype=torch.float64), layer_number=0,
                     groups=single_process(), device=CPU)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.3)
    return layer


def _tokens(world_size: int) -> torch.Tensor:
    """Every rank's tokens, rank-major: [world x SEQ, BATCH, h]."""
    generator = torch.Generator().manual_seed(SEED + 1)
    return torch.randn(world_size * SEQ, BATCH, HIDDEN, generator=generator, dtype=torch.float64)


def _layer_rank(rank, world_size, layout, config, reference):
    _, tp, ep, etp = layout
    groups = initialize_model_parallel(tp, 1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    layer = MoELayer(config, execution=ExecutionConfig(params_dtype=torch.float64, sequence_parallel=tp > 1),
                     layer_number=0, groups=groups, device=CPU)
    reference_params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(_local(reference_params[name], reference_params[name].tp_layout, param))
    x = _tokens(world_size)[rank * SEQ:(rank + 1) * SEQ].clone().requires_grad_(True)  # [SEQ, BATCH, h]
    out = layer(x)
    out.backward(_tokens(world_size)[rank * SEQ:(rank + 1) * SEQ] * 0.5)
    expert_grads = {}
    for name, param in layer.experts.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)  # fc2's bias off etp rank 0
        layout = dataclasses.replace(param.tp_layout, dim=param.tp_layout.dim - 1)
        for index in range(param.shape[0]):
            # One key per global expert and slice: the ranks sharing a key hold the same slice.
            key = (name, param.expert_offset + index,
                   tuple((part.name, *layout.local_range(part)) for part in layout.parts))
            expert_grads[key] = grad[index].clone()
    return out.detach(), x.grad, expert_grads


@pytest.mark.parametrize("layout_name, dispatcher", LAYER_CASES)
def test_moe_layer_at_each_layout_equals_one_process(layout_name, dispatcher):
    layout = LAYOUTS[layout_name]
    world_size = layout[0]
    config = moe_config(moe_token_dispatcher_type=dispatcher)
    reference = _reference_layer(config)
    x = _tokens(world_size).requires_grad_(True)
    out = reference(x)
    out.backward(_tokens(world_size) * 0.5)
    results = run_ranks(world_size, _layer_rank, layout, config, reference)
    summed = collections.defaultdict(float)
    for rank, (rank_out, rank_x_grad, expert_grads) in enumerate(results):
        rows = slice(rank * SEQ, (rank + 1) * SEQ)
        torch.testing.assert_close(rank_out, out.detach()[rows], rtol=1e-12, atol=1e-12, msg=f"rank {rank} output")
        torch.testing.assert_close(rank_x_grad, x.grad[rows], rtol=1e-12, atol=1e-12,
                                   msg=f"rank {rank} input gradient")
        for key, grad in expert_grads.items():
            summed[key] = summed[key] + grad
    reference_params = dict(reference.experts.named_parameters())
    for (name, expert, ranges), grad in summed.items():
        param = reference_params[name]
        layout = dataclasses.replace(param.tp_layout, dim=param.tp_layout.dim - 1)  # of one expert
        full = _full_parts(param.grad[expert], layout)
        want = torch.cat([full[part].narrow(layout.dim, start, length) for part, start, length in ranges],
                         dim=layout.dim)
        torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12, msg=f"{name} of expert {expert} {ranges}")
    assert {expert for _, expert, _ in summed} == set(range(EXPERTS))


# (world size, tp, ep, etp, distributed optimizer). At dp4 ep2 and tp2 dp2 ep2 etp2 fewer ranks hold
# an expert than a dense slice, so expert gradients reduced over the dense group fail there; at tp2
# dp4 ep2 etp1 the two groups have the same members (each expert on every other rank, as each dense
# slice), and the check is that the tp2 layouts assign both right.
GROUP_LAYOUTS = {"dp4 ep2": (4, 1, 2, 1, False), "dp4 ep2 distributed optimizer": (4, 1, 2, 1, True),
                 "tp2 dp2 ep2 etp2": (4, 2, 2, 2, False), "tp2 dp4 ep2 etp1": (8, 2, 2, 1, False)}


def _built_rank(rank, tp, ep, etp, distributed_optimizer):
    """A two-layer MoE GPT model at the layout, wrapped for data parallelism."""
    groups = initialize_model_parallel(tp, 1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model = GPTModel(moe_config(), groups, execution=ExecutionConfig(sequence_parallel=tp > 1))
    model.initialize_parameters(SEED)
    chunk = DistributedDataParallel(model, groups, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer))
    return groups, model, chunk


def _reduce_groups_rank(rank, world_size, tp, ep, etp, distributed_optimizer):
    groups, model, chunk = _built_rank(rank, tp, ep, etp, distributed_optimizer)
    reduced_over = {}
    for buffer in chunk.buffers:
        ranks = tuple(dist.get_process_group_ranks(buffer.dp_group)) if buffer.dp_group is not None else (rank,)
        for param in buffer.params:
            reduced_over[param] = ranks
    names = {param: name for name, param in model.named_parameters()}
    coordinates = (groups.tp_rank, groups.ep_rank, groups.etp_rank)
    return coordinates, {names[param]: (hasattr(param, "expert_offset"), ranks)
                         for param, ranks in reduced_over.items()}


@pytest.mark.parametrize("name", GROUP_LAYOUTS)
def test_each_gradient_is_reduced_over_the_ranks_holding_the_same_copy(name):
    world_size, *layout = GROUP_LAYOUTS[name]
    results = run_ranks(world_size, _reduce_groups_rank, *layout)
    coordinates = [coords for coords, _ in results]
    for rank, (coords, reduced) in enumerate(results):
        tp_rank, ep_rank, etp_rank = coords
        # A dense parameter's copies: the ranks with its tensor-parallel slice. An expert's: the
        # ranks with its experts (ep rank) and its expert-tensor-parallel slice.
        dense = tuple(r for r, c in enumerate(coordinates) if c[0] == tp_rank)
        expert = tuple(r for r, c in enumerate(coordinates) if c[1:] == (ep_rank, etp_rank))
        assert any(is_expert for is_expert, _ in reduced.values()), "the model must have routed experts"
        for param_name, (is_expert, ranks) in reduced.items():
            want = expert if is_expert else dense
            assert ranks == want, f"rank {rank}: {param_name}'s gradient reduced over ranks {ranks}, held by {want}"


def _checkpoint_rank(rank, world_size, tp, ep, etp):
    groups, model, chunk = _built_rank(rank, tp, ep, etp, False)
    state = ShardedState()
    ckpt_state.add_model(state, [chunk], groups)
    return {key: (boxes.size, [(offsets, tensor.clone()) for offsets, tensor in boxes.pieces])
            for key, boxes in state.sharded.items()}


def _assembled(rank_states: list) -> dict:
    """{key: full tensor} from every rank's boxes; each element must be written by some rank."""
    full, written = {}, {}
    for boxes_of_rank in rank_states:
        for key, (size, pieces) in boxes_of_rank.items():
            if key not in full:
                full[key] = torch.zeros(size, dtype=pieces[0][1].dtype)
                written[key] = torch.zeros(size, dtype=torch.bool)
            for offsets, tensor in pieces:
                where = tuple(slice(start, start + length) for start, length in zip(offsets, tensor.shape))
                full[key][where] = tensor
                written[key][where] = True
    for key, mask in written.items():
        assert mask.all(), f"{key}: {int((~mask).sum())} elements held by no rank"
    return full


@pytest.mark.parametrize("name", ["ep4", "tp2 sp ep2 etp2"])
def test_checkpoint_keys_name_experts_by_global_index(name):
    world_size, tp, ep, etp = LAYOUTS[name]
    want = _assembled(run_ranks(1, _checkpoint_rank, 1, 1, 1))
    got = _assembled(run_ranks(world_size, _checkpoint_rank, tp, ep, etp))
    experts = {int(match.group(1)) for key in want for match in [re.search(r"\.mlp\.experts\.(\d+)\.", key)] if match}
    assert experts == set(range(EXPERTS)), "the one-process checkpoint names every expert"
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=0, msg=key)
