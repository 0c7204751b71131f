"""A stack of transformer layers (this pipeline stage's share), with the final norm on the last."""
import torch

from megatron.core.transformer.layer import TransformerLayer
from megatron.core.transformer.norm import build_norm


class TransformerBlock(torch.nn.Module):
    def __init__(self, config, *, layer_numbers: list, post_process: bool, tp_group, tp_size: int,
                 tp_rank: int, rng_tracker, device):
        super().__init__()
        self.config = config
        self.layer_numbers = list(layer_numbers)  # global index of each local layer
        self.layers = torch.nn.ModuleList(
            TransformerLayer(config, tp_group=tp_group, tp_size=tp_size, tp_rank=tp_rank,
                             rng_tracker=rng_tracker, device=device)
            for _ in self.layer_numbers)
        self.final_layernorm = (build_norm(config, config.hidden_size, tp_size=tp_size, tp_rank=tp_rank,
                                           device=device) if post_process else None)

    def forward(self, x, rotary=None, attention_mask=None):
        for layer in self.layers:
            x = layer(x, rotary, attention_mask)
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x
