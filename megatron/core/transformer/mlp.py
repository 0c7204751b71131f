"""The feed-forward block: fc1 (column-parallel), activation, fc2 (row-parallel)."""
import torch
import torch.nn.functional as F

from megatron.core.parallel_state import TensorParallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, Part, RowParallelLinear
from megatron.core.transformer.config import DEFAULT_EXECUTION
from megatron.core.transformer.fusions import swiglu

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class MLP(torch.nn.Module):
    """GeLU MLP, or SwiGLU (fc1 holds gate and up projections fused: silu(gate) * up)."""

    compilable = {"_swiglu": "fuse_elementwise"}  # parallelize.py

    def __init__(self, config, *, execution=DEFAULT_EXECUTION, tp: TensorParallel = TensorParallel(), device):
        super().__init__()
        self.gated = config.swiglu
        self.activation = _ACTIVATIONS[config.activation]
        self._swiglu = swiglu if config.activation == "silu" else None
        ffn = config.ffn_hidden_size
        parts = (Part("gate", ffn, tp.size), Part("up", ffn, tp.size)) if self.gated else None
        common = dict(tp=tp, bias=config.add_bias_linear,
                      sequence_parallel=execution.sequence_parallel, params_dtype=execution.params_dtype,
                      device=device, gradient_accumulation_fusion=execution.gradient_accumulation_fusion)
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, ffn, parts=parts, **common)
        self.linear_fc2 = RowParallelLinear(ffn, config.hidden_size, **common)

    def forward(self, x):
        h = self.linear_fc1(x)  # [s, b, ffn/tp] (x2 when gated)
        if self.gated and self._swiglu is not None:
            h = self._swiglu(h)
        elif self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.activation(gate) * up
        else:
            h = self.activation(h)
        return self.linear_fc2(h)
