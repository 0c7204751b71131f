"""A stack of transformer layers (this pipeline stage's share), with the final norm on the last.

The block runs its layers in `segments`, each kept or re-run in backward; `parallelize.py` sets
them (and wraps the attention cores) from the execution config (Megatron's flags):

- `--recompute-granularity full --recompute-method uniform --recompute-num-layers N`: the layers are
  cut into groups of N; only each group's input is kept, and the group is re-run in backward.
- `--recompute-granularity full --recompute-method block --recompute-num-layers N`: the first N
  layers of this block (per pipeline stage / virtual stage) are each re-run in backward; the rest
  keep their activations.
- `--recompute-granularity selective`: only the attention core (softmax(QK^T)V, whose
  activations grow with s^2 and cost little to recompute) is re-run.

Re-runs restore the RNG states (default generator and the tracker's streams), so dropout masks match.
"""
import torch

from megatron.core.tensor_parallel.random import checkpoint
from megatron.core.transformer.config import DEFAULT_EXECUTION
from megatron.core.transformer.layer import TransformerLayer
from megatron.core.transformer.norm import build_norm


class TransformerBlock(torch.nn.Module):
    def __init__(self, config, execution, *, layer_numbers: list, post_process: bool, groups, rng_tracker, device):
        super().__init__()
        self.config = config
        self.layer_numbers = list(layer_numbers)  # global index of each local layer
        self.rng_tracker = rng_tracker
        self.layers = torch.nn.ModuleList(
            TransformerLayer(config, execution=execution, groups=groups, rng_tracker=rng_tracker, device=device,
                             layer_number=number)
            for number in self.layer_numbers)
        self.final_layernorm = (build_norm(config, config.hidden_size, execution=execution, tp=groups.tensor_parallel,
                                           device=device) if post_process else None)
        self.segments = recompute_segments(DEFAULT_EXECUTION, len(self.layers))  # all kept, until parallelized

    def forward(self, x, rotary=None, attention_mask=None):
        # x: [s, b, h] ([s/tp, b, h] with sequence parallelism)
        for start, end, recompute in self.segments:
            if recompute and self.training:
                x = checkpoint(self._run_layers, self.rng_tracker, start, end, x, rotary, attention_mask)
            else:
                x = self._run_layers(start, end, x, rotary, attention_mask)
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x

    def _run_layers(self, start, end, x, rotary, attention_mask):
        for layer in self.layers[start:end]:
            x = layer(x, rotary, attention_mask)
        return x


class RecomputedCoreAttention(torch.nn.Module):
    """Selective recomputation: keeps q, k, v and re-runs the attention core in backward."""

    def __init__(self, core_attention: torch.nn.Module, rng_tracker):
        super().__init__()
        self.core_attention = core_attention
        self.rng_tracker = rng_tracker

    def forward(self, q, k, v, attention_mask=None):
        if not self.training:
            return self.core_attention(q, k, v, attention_mask)
        return checkpoint(self.core_attention, self.rng_tracker, q, k, v, attention_mask)


def recompute_segments(execution, num_layers: int) -> list:
    """(start, end, recompute) runs of local layers, from the recompute flags of `execution`."""
    granularity, method, count = (execution.recompute_granularity, execution.recompute_method,
                                  execution.recompute_num_layers)
    if granularity not in (None, "full", "selective"):
        raise ValueError(f"`recompute_granularity` must be full or selective, got {granularity!r}")
    if granularity != "full":
        if method is not None:
            raise ValueError(f"--recompute-method {method} needs --recompute-granularity full "
                             f"(got {granularity})")
        return [(0, num_layers, False)] if num_layers else []
    if method not in ("uniform", "block"):
        raise ValueError(f"--recompute-granularity full needs --recompute-method uniform or block, got {method!r}")
    if count is None or count < 1:
        raise ValueError(f"--recompute-granularity full needs --recompute-num-layers >= 1, got {count}")
    if method == "uniform":
        return [(start, min(start + count, num_layers), True) for start in range(0, num_layers, count)]
    recomputed = min(count, num_layers)
    segments = [(index, index + 1, True) for index in range(recomputed)]
    if recomputed < num_layers:
        segments.append((recomputed, num_layers, False))
    return segments
