"""--moe-permute-fusion and --moe-router-fusion: the flags reach the layers' ExecutionConfig, and the
compiled permutation, unpermutation and routing they select give the eager layer's outputs and
gradients (fp32 at rtol 1e-5: the fused kernels add in another order; inductor's CPU code, one small
DeepSeek-like layer: about 35 s on 2 cores, nearly all of it compiling)."""
import dataclasses

import torch

from megatron.core.transformer.config import ExecutionConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.parallelize import compile_declared
from megatron.core.parallel_state import single_process
from megatron.core.utils import compiled
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.token_dispatcher import permute_rows, unpermute
from megatron.training.arguments import parse_args
from megatron.training.builders import execution_config
from tests.unit.test_moe_flags import MINIMAL, MOE
from tests.unit.test_moe_host_sync import CASES, HIDDEN, config


def test_flags_reach_the_execution_config():
    assert not execution_config(parse_args(MINIMAL + MOE)).moe_permute_fusion
    execution = execution_config(parse_args(MINIMAL + MOE + ["--moe-permute-fusion", "--moe-router-fusion"]))
    assert execution.moe_permute_fusion and execution.moe_router_fusion


def _layer(execution):
    layer = MoELayer(config(moe_ffn_hidden_size=16, **CASES["deepseek-like"]), execution=execution, layer_number=0,
                     groups=single_process(), device=torch.device("cpu"))
    compile_declared(layer, execution)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return layer


def _run(layer, x):
    x = x.clone().requires_grad_()
    out = layer(x)
    out.square().sum().backward()
    return [out.detach(), x.grad] + [param.grad for param in layer.parameters()]


def test_fused_layer_equals_the_eager_layer():
    eager = _layer(ExecutionConfig())
    fused = _layer(dataclasses.replace(ExecutionConfig(), moe_permute_fusion=True, moe_router_fusion=True))
    assert fused.router.route is compiled(moe_utils.route)
    assert fused.dispatcher.local.permute_rows is compiled(permute_rows)
    assert fused.dispatcher.local.unpermute is compiled(unpermute)
    x = torch.randn(6, 2, HIDDEN, generator=torch.Generator().manual_seed(1))
    for got, want in zip(_run(fused, x), _run(eager, x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fused kernels round differently


def test_the_experts_swiglu_is_compiled_with_dynamic_rows():
    """Under the elementwise fusions the experts' SwiGLU is the dense MLP's function compiled, with
    automatic dynamic shapes (the routed rows change between micro-batches at EP > 1 with the
    all-to-all dispatcher): rows of another count reuse the graph instead of recompiling each time,
    and the result equals the eager one."""
    import torch._dynamo.testing

    from megatron.core.transformer import fusions
    from megatron.core.transformer.moe.experts import GroupedMLP
    from megatron.core.utils import compiled

    assert GroupedMLP.compiled_dynamic == {"_swiglu"}
    eager, fused = _layer(ExecutionConfig()), _layer(ExecutionConfig(fuse_elementwise=True))
    assert fused.experts._swiglu is compiled(fusions.swiglu, None) and eager.experts._swiglu is fusions.swiglu
    for tokens in (6, 10):  # other routed row counts: the same graph, symbolic in the rows
        x = torch.randn(tokens, 2, HIDDEN, generator=torch.Generator().manual_seed(tokens))
        for got, want in zip(_run(fused, x), _run(eager, x)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    counter = torch._dynamo.testing.CompileCounter()
    function = torch.compile(fusions.swiglu, backend=counter, fullgraph=True, dynamic=None)
    for rows in (24, 40, 56, 72):
        x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(function(x), fusions.swiglu(x), rtol=1e-6, atol=1e-6)
    # At most the first shape, then once symbolic in the rows (once only when this process already
    # saw the rows change, as the layers above did): not a graph per row count.
    assert counter.frame_count <= 2
    assert compiled(fusions.swiglu, None) is not compiled(fusions.swiglu)
