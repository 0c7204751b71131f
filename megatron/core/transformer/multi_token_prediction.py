"""Multi-token prediction (DeepSeek-V3; Megatron-Core's `--mtp-num-layers`).

After the last decoder layer, D modules each predict one token further ahead. Module k (1..D) reads
the previous depth's hidden state h (the decoder's output, after its final norm, for k = 1) and the
embedding of the tokens shifted left by k:

    e = embedding(tokens shifted by k)                      # [s, b, h], the model's shared embedding
    x = eh_proj(cat(enorm(e), hnorm(h)))                    # [s, b, 2h] -> [s, b, h]
    h = final_layernorm(transformer_layer(x))               # one decoder layer, its own norm
    logits = output_layer(h)                                # the model's shared output layer

and its loss is the cross entropy against the labels shifted left by k (position i of depth k
predicts token i + k + 1), masked by the loss mask shifted alike; the k positions shifted in at the
end are masked out. The model's loss becomes

    lm loss + mtp_loss_scaling_factor / D * sum_k mtp_k loss

where each mtp_k loss is the micro-batch mean over its mask (a sum with --calculate-per-token-loss),
as Megatron-Core adds it in backward. The modules sit on the last pipeline stage (Megatron-Core's
placement without a custom layout), which then holds a copy of the word embedding tied to the first
stage's. Tensor parallelism: eh_proj is column-parallel, its output gathered over the tensor ranks
(and scattered over the sequence again with sequence parallelism) before the layer.

Checkpoint names are Megatron-Core's: mtp.layers.{k-1}.{enorm,hnorm,eh_proj,transformer_layer,
final_layernorm}.
"""
import torch

from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megatron.core.transformer.layer import TransformerLayer
from megatron.core.transformer.norm import build_norm


def roll_left(tensor: torch.Tensor) -> torch.Tensor:
    """[b, s] -> [b, s] shifted one position left along the sequence, the last position 0 (Megatron-
    Core's roll_tensor without context parallelism)."""
    rolled = torch.roll(tensor, shifts=-1, dims=-1)
    rolled[..., -1] = 0
    return rolled


class MultiTokenPredictionLayer(torch.nn.Module):
    """One prediction depth: enorm, hnorm, eh_proj, a transformer layer and its final norm."""

    def __init__(self, config, execution, *, groups, rng_tracker, device, layer_number: int):
        super().__init__()
        common = dict(execution=execution, device=device, tp=groups.tensor_parallel)
        self.sequence_parallel = execution.sequence_parallel and groups.tp_size > 1
        self.tp_group = groups.tp
        self.enorm = build_norm(config, config.hidden_size, **common)
        self.hnorm = build_norm(config, config.hidden_size, **common)
        # [s, b, 2h] -> [s, b, h/tp], gathered to [s, b, h]: the layer reads the whole hidden state.
        self.eh_proj = ColumnParallelLinear(
            2 * config.hidden_size, config.hidden_size, tp=groups.tensor_parallel, bias=False,
            sequence_parallel=execution.sequence_parallel, gather_output=True,
            params_dtype=execution.params_dtype, device=device,
            gradient_accumulation_fusion=execution.gradient_accumulation_fusion)
        # Built as the last decoder layer is (Megatron-Core builds it from the last layer's spec).
        self.transformer_layer = TransformerLayer(
            config, execution=execution, groups=groups, rng_tracker=rng_tracker, device=device,
            layer_number=layer_number)
        self.final_layernorm = build_norm(config, config.hidden_size, **common)

    def forward(self, hidden_states, embedded, rotary=None, attention_mask=None):
        # hidden_states, embedded: [s, b, h] ([s/tp, b, h] with sequence parallelism)
        x = torch.cat((self.enorm(embedded), self.hnorm(hidden_states)), dim=-1)  # [s, b, 2h]
        x = self.eh_proj(x)  # [s, b, h]
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)  # [s/tp, b, h]
        x = self.transformer_layer(x, rotary, attention_mask)
        return self.final_layernorm(x)


class MultiTokenPredictionBlock(torch.nn.Module):
    """The D prediction depths, run in turn; each embeds the tokens shifted one further."""

    def __init__(self, config, execution, *, groups, rng_tracker, device):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            MultiTokenPredictionLayer(config, execution, groups=groups, rng_tracker=rng_tracker, device=device,
                                      layer_number=config.num_layers + depth)
            for depth in range(config.mtp_num_layers))

    def forward(self, hidden_states, tokens, position_ids, embedding, rotary=None, attention_mask=None) -> list:
        """hidden_states: the decoder's output [s, b, h]; tokens, position_ids: [b, s]; `embedding(tokens,
        position_ids, depth)` the model's. Returns each depth's hidden states [s, b, h] ([s/tp, b, h]
        with sequence parallelism)."""
        outputs = []
        for depth, layer in enumerate(self.layers):
            tokens, position_ids = roll_left(tokens), roll_left(position_ids)
            hidden_states = layer(hidden_states, embedding(tokens, position_ids, depth), rotary, attention_mask)
            outputs.append(hidden_states)
        return outputs


def mtp_loss(token_losses: torch.Tensor, loss_mask: torch.Tensor, scaling_factor: float,
             per_token: bool = False) -> tuple[torch.Tensor, dict]:
    """The multi-token-prediction term of the loss and its log values, from the model's per-token
    losses of each depth `token_losses` [D, b, s] (depth k against the labels shifted by k) and the
    micro-batch's `loss_mask` [b, s]: scaling_factor / D * sum over depths of each depth's mean over
    its mask (the mask shifted left by k, zeros shifted in), or of its sum with `per_token`.

    Logged as Megatron-Core logs it: "mtp_k loss" the depth's mean over the micro-batch, reported
    as [mean, 1] so the log line averages it over micro-batches and data-parallel ranks."""
    depths = token_losses.shape[0]
    mask = loss_mask.float()
    total = token_losses.new_zeros((), dtype=torch.float32)
    reported = {}
    one = torch.ones((), device=mask.device)
    for depth in range(depths):
        mask = roll_left(mask)
        summed = (token_losses[depth].float() * mask).sum()
        mean = summed / mask.sum().clamp(min=1.0)
        total = total + (summed if per_token else mean)
        reported[f"mtp_{depth + 1} loss"] = torch.stack([mean.detach(), one])
    return scaling_factor / depths * total, reported


def mtp_token_losses(hidden_list: list, labels: torch.Tensor, token_loss) -> torch.Tensor:
    """[D, b, s]: each depth's per-token loss from its hidden states, against the labels shifted
    left once more per depth (`token_loss(hidden, labels) -> [b, s]`: the shared output layer and
    cross entropy)."""
    losses = []
    for hidden in hidden_list:
        labels = roll_left(labels)
        losses.append(token_loss(hidden, labels))
    return torch.stack(losses)
