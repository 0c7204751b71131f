"""One pre-norm transformer layer: x + attention(norm(x)), then x + mlp(norm(x))."""
import torch
import torch.nn.functional as F

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.config import DEFAULT_EXECUTION
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.norm import build_norm


class TransformerLayer(torch.nn.Module):
    def __init__(self, config, *, execution=DEFAULT_EXECUTION, tp_group, tp_size: int, tp_rank: int, rng_tracker,
                 device, cp_group=None):
        super().__init__()
        common = dict(execution=execution, tp_size=tp_size, tp_rank=tp_rank, device=device)
        self.input_layernorm = build_norm(config, config.hidden_size, **common)
        self.self_attention = SelfAttention(config, tp_group=tp_group, rng_tracker=rng_tracker, cp_group=cp_group,
                                            **common)
        self.pre_mlp_layernorm = build_norm(config, config.hidden_size, **common)
        self.mlp = MLP(config, tp_group=tp_group, **common)
        self.hidden_dropout = config.hidden_dropout
        # Sequence-parallel activations differ per TP rank, so their dropout draws from the
        # per-rank stream; replicated activations draw from the shared default stream.
        self.dropout_rng = rng_tracker if (execution.sequence_parallel and tp_size > 1) else None

    def forward(self, x, rotary=None, attention_mask=None):
        # x: [s, b, h] ([s/tp, b, h] with sequence parallelism)
        x = x + self._dropout(self.self_attention(self.input_layernorm(x), rotary, attention_mask))
        x = x + self._dropout(self.mlp(self.pre_mlp_layernorm(x)))
        return x

    def _dropout(self, x):
        if not self.training or self.hidden_dropout == 0.0:
            return x
        if self.dropout_rng is not None:
            with self.dropout_rng.fork():
                return F.dropout(x, self.hidden_dropout, training=True)
        return F.dropout(x, self.hidden_dropout, training=True)
