"""Fused linear and fused cross entropy over real gloo tensor-parallel groups, one 4-process run.

- The fused linear Function (column then row parallel, TP=2, with and without sequence parallelism,
  fp32 and bf16) equals the mapping-based plain path (`mappings.py` collectives around `F.linear`,
  weight gradients summed over 3 micro-batches): outputs, input gradients and `main_grad`.
- With sequence parallelism the column-parallel linear saves (tp-1)/tp fewer bytes of its input.
- The fused cross entropy over TP=2 and TP=4 equals `F.cross_entropy` on the full logits in value
  and gradient (fp32 and bf16), with masked tokens.
"""
import torch
import torch.nn.functional as F

from tests.distributed.harness import run_distributed

MICRO_BATCHES = 3


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _plain_path(groups, sequence_parallel, dtype, inputs, grads):
    """mappings + F.linear on this rank's weight slices; weight gradients summed in fp32."""
    from megatron.core.tensor_parallel import mappings
    from tests.unit.test_fused_linear_and_loss import TwoLinears

    sliced = TwoLinears(dtype, fusion=False, tp_size=groups.tp_size, tp_rank=groups.tp_rank)
    params = {"w1": sliced.fc1.weight, "b1": sliced.fc1.bias, "w2": sliced.fc2.weight}
    main = {name: torch.zeros(p.shape) for name, p in params.items()}
    outputs, input_grads = [], []
    for x, g in zip(inputs, grads):
        x = x.clone().requires_grad_()
        if sequence_parallel:
            h = mappings.gather_from_sequence_parallel_region(x, groups.tp)
        else:
            h = mappings.copy_to_tensor_parallel_region(x, groups.tp)
        y = F.linear(F.gelu(F.linear(h, params["w1"], params["b1"])), params["w2"])
        if sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel_region(y, groups.tp)
        else:
            y = mappings.reduce_from_tensor_parallel_region(y, groups.tp)
        y.backward(g)
        for name, p in params.items():
            main[name] += p.grad.float()
            p.grad = None
        outputs.append(y.detach())
        input_grads.append(x.grad)
    return outputs, input_grads, main


def _fused_linear_cases(groups):
    from megatron.core.distributed.ddp import DistributedDataParallel
    from tests.unit.test_fused_linear_and_loss import TOLERANCE, TwoLinears

    for dtype in (torch.float32, torch.bfloat16):
        for sequence_parallel in (False, True):
            seq = 8 // groups.tp_size if sequence_parallel else 8
            shard = groups.tp_rank if sequence_parallel else 0
            inputs = [_randn(8, 2, 16, seed=10 + i, dtype=dtype)[shard * seq:(shard + 1) * seq]
                      for i in range(MICRO_BATCHES)]
            grads = [_randn(8, 2, 16, seed=20 + i, dtype=dtype)[shard * seq:(shard + 1) * seq]
                     for i in range(MICRO_BATCHES)]
            want_out, want_dx, want_main = _plain_path(groups, sequence_parallel, dtype, inputs, grads)
            model = TwoLinears(dtype, fusion=True, tp_group=groups.tp, tp_size=groups.tp_size,
                               tp_rank=groups.tp_rank, sequence_parallel=sequence_parallel)
            ddp = DistributedDataParallel(model, groups)  # main_grad buffers (no reduction is run here)
            ddp.zero_grad_buffer()
            case = f"fused linear {dtype} sp={sequence_parallel}"
            for x, g, out, dx in zip(inputs, grads, want_out, want_dx):
                x = x.clone().requires_grad_()
                y = ddp(x)
                y.backward(g)
                torch.testing.assert_close(y.detach(), out, **TOLERANCE[dtype], msg=lambda m: f"{case} output: {m}")
                torch.testing.assert_close(x.grad, dx, **TOLERANCE[dtype], msg=lambda m: f"{case} dgrad: {m}")
            for name, param in (("w1", model.fc1.weight), ("b1", model.fc1.bias), ("w2", model.fc2.weight)):
                torch.testing.assert_close(param.main_grad, want_main[name], **TOLERANCE[dtype],
                                           msg=lambda m: f"{case} main_grad {name}: {m}")


def _saved_bytes(function) -> int:
    total = []

    def pack(tensor):
        total.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return sum(total)


def _saved_bytes_case(groups) -> None:
    """Column-parallel linear under sequence parallelism: the fused Function keeps the local
    [s/tp, b, h] shard; the plain path (gather mapping + F.linear) keeps the gathered [s, b, h]."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    linear = ColumnParallelLinear(16, 32, bias=False, tp=groups.tensor_parallel, sequence_parallel=True)
    x = _randn(64 // groups.tp_size, 2, 16, seed=1).requires_grad_()
    fused = _saved_bytes(lambda: linear(x))
    plain = _saved_bytes(lambda: F.linear(mappings.gather_from_sequence_parallel_region(x, groups.tp), linear.weight))
    gathered = 64 * 2 * 16 * 4
    assert plain - fused == gathered * (groups.tp_size - 1) // groups.tp_size, (plain, fused)


def _cross_entropy_cases(groups) -> None:
    from megatron.core.tensor_parallel.cross_entropy import fused_vocab_parallel_cross_entropy

    vocab = 48
    local = vocab // groups.tp_size
    target = torch.randint(0, vocab, (7, 3), generator=torch.Generator().manual_seed(2))
    mask = (torch.rand(7, 3, generator=torch.Generator().manual_seed(3)) > 0.3).float()
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        full = (_randn(7, 3, vocab, seed=1) * 4).to(dtype)
        reference = full.float().clone().requires_grad_()
        want = F.cross_entropy(reference.view(-1, vocab), target.view(-1), reduction="none").view(7, 3)
        ((want * mask).sum() / mask.sum()).backward()
        start = groups.tp_rank * local
        logits = full[..., start:start + local].clone().requires_grad_()
        got = fused_vocab_parallel_cross_entropy(logits * 1, target, groups.tp, start, chunk_elements=4 * local)
        ((got * mask).sum() / mask.sum()).backward()
        case = f"cross entropy tp={groups.tp_size} {dtype}"
        torch.testing.assert_close(got, want.detach(), rtol=tolerance, atol=tolerance,
                                   msg=lambda m: f"{case} loss: {m}")
        torch.testing.assert_close(logits.grad.float(), reference.grad[..., start:start + local], rtol=tolerance,
                                   atol=tolerance * 0.1, msg=lambda m: f"{case} grad: {m}")


def _all_cases(rank, world_size):
    from megatron.core.parallel_state import initialize_model_parallel

    tp4 = initialize_model_parallel(4, 1)
    _cross_entropy_cases(tp4)
    tp2 = initialize_model_parallel(2, 1)
    _cross_entropy_cases(tp2)
    _fused_linear_cases(tp2)
    _saved_bytes_case(tp2)
    _saved_bytes_case(tp4)
    return True


def test_fused_linear_and_cross_entropy_match_plain_paths_over_tp_groups():
    assert all(run_distributed(4, _all_cases))
