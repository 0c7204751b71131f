"""One pre-norm transformer layer: x + attention(norm(x)), then x + mlp(norm(x)).

The first residual add and the norm after it are one call (`add_and_norm`: one kernel when the
fusions are compiled, forward and backward). With --parallel_attn (Falcon) attention and MLP read
the same input and both join the residual at once: x + attention(norm(x)) + mlp(norm(x)), the MLP
reading a norm of its own with --parallel_layernorm (Falcon-40B), the attention's otherwise
(Falcon-7B, which then has no `pre_mlp_layernorm`)."""
import torch
import torch.nn.functional as F

from megatron.core.parallel_state import ParallelGroups
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mla import MultiLatentAttention
from megatron.core.tensor_parallel.random import checkpoint
from megatron.core.transformer.config import DEFAULT_EXECUTION
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.norm import build_norm


class TransformerLayer(torch.nn.Module):
    def __init__(self, config, *, execution=DEFAULT_EXECUTION, groups: ParallelGroups, rng_tracker, device,
                 layer_number: int = 0):
        super().__init__()
        common = dict(execution=execution, tp=groups.tensor_parallel, device=device)
        self.input_layernorm = build_norm(config, config.hidden_size, **common)
        attention = MultiLatentAttention if config.multi_latent_attention else SelfAttention
        self.self_attention = attention(config, rng_tracker=rng_tracker, cp_group=groups.cp, **common)
        self.parallel_attn = config.parallel_attn
        self.pre_mlp_layernorm = (build_norm(config, config.hidden_size, **common)
                                  if not config.parallel_attn or config.parallel_layernorm else None)
        # Mixture-of-experts layers (per --moe-layer-freq) take the model's ParallelGroups: their
        # experts and tokens are laid out over the expert groups.
        # A multi-token prediction layer (numbered after the decoder's) is built as the last decoder
        # layer is, as Megatron-Core builds it from the last layer's spec.
        self.is_moe = self.kind(config, layer_number) == "moe"
        if self.is_moe:
            self.mlp = MoELayer(config, execution=execution, layer_number=layer_number, groups=groups, device=device)
        else:
            self.mlp = MLP(config, **common)
        self.recompute_mlp = False  # --moe-layer-recompute (set by parallelize.py)
        self.rng_tracker = rng_tracker
        self.hidden_dropout = config.hidden_dropout
        # Sequence-parallel activations differ per TP rank, so their dropout draws from the
        # per-rank stream; replicated activations draw from the shared default stream.
        self.dropout_rng = rng_tracker if (execution.sequence_parallel and groups.tp_size > 1) else None

    def forward(self, x, rotary=None, attention_mask=None):
        # x: [s, b, h] ([s/tp, b, h] with sequence parallelism)
        if self.parallel_attn:
            return self._parallel_forward(x, rotary, attention_mask)
        attention = self._dropout(self.self_attention(self.input_layernorm(x), rotary, attention_mask))
        x, normed = self.pre_mlp_layernorm.add_and_norm(x, attention)  # x + attention, and its norm
        x = x + self._dropout(self._mlp(normed))
        return x

    def _parallel_forward(self, x, rotary, attention_mask):
        normed = self.input_layernorm(x)
        mlp_input = normed if self.pre_mlp_layernorm is None else self.pre_mlp_layernorm(x)
        attention = self._dropout(self.self_attention(normed, rotary, attention_mask))
        mlp = self._dropout(self._mlp(mlp_input))
        return x + attention + mlp

    def _mlp(self, x):
        if self.recompute_mlp and self.training:
            return checkpoint(self.mlp, self.rng_tracker, x)  # --moe-layer-recompute
        return self.mlp(x)

    def _dropout(self, x):
        if not self.training or self.hidden_dropout == 0.0:
            return x
        if self.dropout_rng is not None:
            with self.dropout_rng.fork():
                return F.dropout(x, self.hidden_dropout, training=True)
        return F.dropout(x, self.hidden_dropout, training=True)

    @staticmethod
    def kind(config, layer_number: int) -> str:
        """What the layer numbered `layer_number` is built as: "moe" (a mixture of experts per
        --moe-layer-freq) or "dense"; layers of one kind have the same shapes (the planner builds
        one of each). A multi-token prediction layer, numbered after the decoder's, is of the last
        decoder layer's kind."""
        pattern_index = min(layer_number, config.num_layers - 1)
        return "moe" if config.num_experts is not None and config.moe_layers[pattern_index] == 1 else "dense"
