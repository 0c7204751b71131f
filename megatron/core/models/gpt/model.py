"""GPTModel: Llama 2, Llama 3/3.1 and GPT-2/3 from one TransformerConfig (what the model is) and
one ExecutionConfig (how it runs: sequence parallelism, recompute, kernels, FP8, dtype).

    tokens [b, s] -> embedding [s, b, h] -> decoder layers -> final norm -> logits [s, b, V/tp]
                  -> per-token loss [b, s] (when labels are given)

With pipeline parallelism a stage builds only its part: `pre_process` (the embedding, first stage),
`post_process` (final norm, output layer and loss, last stage) and `layer_numbers` (the global
indices of its decoder layers). Stages after the first take `hidden_states` instead of tokens.

With --mtp-num-layers the last stage also holds the multi-token prediction modules
(transformer.multi_token_prediction) and, off the first stage, a copy of the word embedding tied to
the first stage's; in training it returns their per-token losses beside the main one.
"""
import re
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.context_parallel.documents import context_parallel_document_mask
from megatron.core.parallel_state import ParallelGroups
from megatron.core.tensor_parallel.cross_entropy import fused_vocab_parallel_cross_entropy, vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import (
    ALL_REDUCE_INPUT_GRAD,
    GATHER_INPUT,
    TPLayout,
    VocabParallelEmbedding,
    initial_values,
    initialize_param,
    linear_with_grad_accumulation,
    replicated_layout,
    set_layout,
    split_layout,
)
from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megatron.core.tensor_parallel.random import RNGStatesTracker
from megatron.core.transformer.attention import document_attention_mask
from megatron.core.transformer.block import TransformerBlock
from megatron.core.transformer.config import DEFAULT_EXECUTION, ExecutionConfig, TransformerConfig, derive
from megatron.core.transformer.moe.experts import initialize_expert_param
from megatron.core.transformer.moe.router import share_moe_state
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock, mtp_token_losses
from megatron.core.transformer.parallelize import parallelize
from megatron.core.transformer.rope import RotaryEmbedding

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


class GPTModel(torch.nn.Module):
    compilable = {"compiled_loss": "fuse_elementwise"}  # parallelize.py

    def __init__(self, config: TransformerConfig, groups: ParallelGroups, *,
                 execution: ExecutionConfig = DEFAULT_EXECUTION, rng_tracker: Optional[RNGStatesTracker] = None,
                 pre_process: bool = True, post_process: bool = True, layer_numbers: Optional[list] = None,
                 device=None):
        super().__init__()
        config = derive(config)  # a given description works too (derived ones pass unchanged)
        config.check_tensor_parallel(groups.tp_size)
        self.config = config
        self.execution = execution
        self.groups = groups
        self.pre_process = pre_process
        self.post_process = post_process
        self.sequence_parallel = execution.sequence_parallel and groups.tp_size > 1
        self.share_embeddings = not config.untie_embeddings_and_output_weights
        device = device if device is not None else groups.device
        layer_numbers = list(range(config.num_layers)) if layer_numbers is None else list(layer_numbers)

        # Multi-token prediction runs on the last stage (Megatron-Core's placement) and embeds tokens there.
        self.mtp_process = config.mtp_num_layers is not None and post_process
        if config.mtp_num_layers is not None and groups.cp_size > 1:
            raise ValueError("--mtp-num-layers with --context-parallel-size > 1 is not built (shifting the tokens "
                             "would cross the context-parallel chunks); use --context-parallel-size 1")
        if pre_process or self.mtp_process:
            self.embedding = _Embedding(config, execution, groups, rng_tracker, device)
        self.rotary = RotaryEmbedding(config, device) if config.position_embedding_type == "rope" else None
        self.decoder = TransformerBlock(config, execution, layer_numbers=layer_numbers, post_process=post_process,
                                        groups=groups, rng_tracker=rng_tracker, device=device)
        self.mtp = (MultiTokenPredictionBlock(config, execution, groups=groups, rng_tracker=rng_tracker, device=device)
                    if self.mtp_process else None)
        # The routers of the decoder and of mixture-of-experts prediction modules share one scale and tracker.
        self.moe_aux_loss_scale, self.moe_aux_losses = share_moe_state(self, config)
        self.compiled_loss = False  # the loss's chunks as compiled kernels (--no-torch-compile off: parallelize.py)
        self.input_tensor = None  # set by the pipeline schedule on stages after the first
        if self.mtp_process and not pre_process:
            _check_mtp_embedding_copy(config)
            # The last stage's copy of the word embedding (tied to the first stage's, as below).
            self.embedding.word_embeddings.weight.shared_embedding = True
        if post_process and (not self.share_embeddings or not hasattr(self, "embedding")):
            # Untied output layer, or the last stage's copy of the tied embedding (kept equal to the
            # first stage's by an all-reduce of gradients over the embedding group).
            weight = torch.empty(config.padded_vocab_size // groups.tp_size, config.hidden_size,
                                 dtype=execution.params_dtype, device=device)
            self.output_layer = torch.nn.Parameter(weight)
            layout = split_layout(0, config.padded_vocab_size, groups.tp_size, groups.tp_rank, "padded vocabulary size")
            set_layout(self.output_layer, layout, "normal")
            self.output_layer.shared_embedding = self.share_embeddings
        for weight in self.vocabulary_weights():
            weight.is_embedding_or_output_parameter = True  # their own LR with --decoupled-lr
        # Built; now FP8, compile and recompute as `execution` asks, from outside the layers.
        # `fp8_scaling` holds the delayed recipe's amax history (None otherwise).
        self.fp8_scaling = parallelize(self, execution, device=device)

    # ----------------------------------------------------------------------------------------
    def global_param_name(self, local_name: str) -> str:
        """The layout-independent name of a parameter: global layer numbers, tied copies unified."""
        if local_name == "output_layer" and self.share_embeddings:
            return WORD_EMBEDDINGS
        if local_name == "output_layer":
            return "output_layer.weight"
        match = re.match(r"decoder\.layers\.(\d+)\.(.*)", local_name)
        if match:
            return f"decoder.layers.{self.decoder.layer_numbers[int(match.group(1))]}.{match.group(2)}"
        return local_name

    @torch.no_grad()
    def initialize_parameters(self, seed: int) -> None:
        """Deterministic, layout-independent initialization (see tensor_parallel.layers)."""
        for name, param in self.named_parameters():
            init = initialize_expert_param if hasattr(param, "expert_offset") else initialize_param
            init(param, self.global_param_name(name), seed, self.config.init_method_std, self.config.num_layers)

    def initial_values(self, local_name: str, param: torch.nn.Parameter, seed: int, device) -> dict:
        """{part: full fp32 tensor} that `param`'s initial value is cut from (for wrappers that
        initialize shards themselves, as FSDP2 does)."""
        return initial_values(param, self.global_param_name(local_name), seed, self.config.init_method_std,
                              self.config.num_layers, device)

    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        """The activation received from the previous pipeline stage, used as `hidden_states`."""
        self.input_tensor = tensor

    def vocabulary_weights(self) -> list:
        """The word embedding and output layer weights held by this stage."""
        weights = [self.embedding.word_embeddings.weight] if hasattr(self, "embedding") else []
        return weights + ([self.output_layer] if hasattr(self, "output_layer") else [])

    def output_weight(self) -> torch.Tensor:
        if hasattr(self, "embedding") and self.share_embeddings:
            return self.embedding.word_embeddings.weight
        return self.output_layer

    # ----------------------------------------------------------------------------------------
    def forward(self, tokens: Optional[torch.Tensor], position_ids: torch.Tensor,
                labels: Optional[torch.Tensor] = None, hidden_states: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, document_ids: Optional[torch.Tensor] = None):
        """tokens/position_ids/labels: [b, s]. Returns the per-token loss [b, s] when labels are
        given on the last stage, logits [s, b, V/tp] on the last stage otherwise, else the hidden
        states [s, b, h] ([s/tp, b, h] with sequence parallelism) for the next stage. With
        multi-token prediction, in training, the loss comes with the MTP depths' per-token losses:
        ([b, s], [D, b, s]) (transformer.multi_token_prediction.mtp_loss combines them).

        `document_ids` [b, s] (packed documents, --reset-attention-mask, --sft): each token attends
        only to earlier tokens of its own document; the mask is built once here for all layers
        (under context parallelism, [b, s/C] of this rank's chunks, and the mask spans the whole
        sequence's keys)."""
        if document_ids is not None and self.groups.cp_size > 1:  # this rank's chunks: ids gathered over CP
            attention_mask = context_parallel_document_mask(document_ids, self.groups.cp)
        elif document_ids is not None:
            attention_mask = document_attention_mask(document_ids)
        if self.fp8_scaling is not None:
            self.fp8_scaling.recording = self.training  # evaluation leaves the amax history alone
            self.fp8_scaling.roll()  # one amax-history entry per training micro-batch
        if not self.pre_process:
            x = hidden_states if hidden_states is not None else self.input_tensor
        else:
            x = self.embedding(tokens, position_ids)
        rotary = self.rotary(position_ids) if self.rotary is not None else None
        x = self.decoder(x, rotary, attention_mask)
        if not self.post_process:
            return x
        if labels is None:
            return self._logits(x)
        run_mtp = self.mtp is not None and self.training
        # As Megatron-Core orders it: the MTP modules run before the output layer, so in backward every
        # output-layer gradient is in before the MTP modules' embedding lookups add theirs.
        hidden = self.mtp(x, tokens, position_ids, self._mtp_embedding, rotary, attention_mask) if run_mtp else []
        tied_here = self.share_embeddings and (self.pre_process or run_mtp)
        loss = self._token_loss(x, labels, notify=not tied_here)
        if not run_mtp:
            return loss
        # [b, s] and [D, b, s]; only the main loss's output GEMM, the last in backward, signals readiness.
        return loss, mtp_token_losses(hidden, labels, partial(self._token_loss, notify=False))

    def _mtp_embedding(self, tokens, position_ids, depth: int):
        """The embedding of an MTP depth's shifted tokens. Only the lookup whose backward runs last
        signals that the embedding's gradient is complete: the first stage's own, else depth 1's."""
        if tokens is None:
            raise ValueError("multi-token prediction needs the tokens on the last pipeline stage")
        return self.embedding(tokens, position_ids, notify=not self.pre_process and depth == 0)

    def _token_loss(self, x, labels, notify: bool = True):
        """Per-token cross entropy [b, s] of the hidden states x [s, b, h] against labels [b, s]."""
        logits = self._logits(x, notify)
        vocab_start = self.groups.tp_rank * logits.shape[-1]
        if self.execution.cross_entropy_loss_fusion:
            loss = fused_vocab_parallel_cross_entropy(logits, labels.t(), self.groups.tp, vocab_start,
                                                      compiled=self.compiled_loss)  # [s, b]
        else:
            loss = vocab_parallel_cross_entropy(logits, labels.t(), self.groups.tp, vocab_start)
        # [b, s] as a tensor of its own, not a transposed view of the [s, b] loss: a module wrapped by
        # FSDP2 must not return a view (its pre-backward hook, which re-gathers the parameters, would
        # be lost to an in-place op on it), and PyTorch warns about one.
        return loss.t().clone(memory_format=torch.contiguous_format)

    def _logits(self, x, notify: Optional[bool] = None):
        # With tied embeddings on this stage the embedding's backward, which runs later, signals
        # that the shared weight's gradient is complete.
        if notify is None:
            notify = not (self.pre_process and self.share_embeddings)
        return linear_with_grad_accumulation(
            x, self.output_weight(), group=self.groups.tp,
            input_comm=GATHER_INPUT if self.sequence_parallel else ALL_REDUCE_INPUT_GRAD,
            gradient_accumulation_fusion=self.execution.gradient_accumulation_fusion,
            notify=notify)  # [s, b, V/tp]


class _Embedding(torch.nn.Module):
    """Word embeddings (vocab-parallel), optional learned positions, embedding dropout."""

    def __init__(self, config, execution, groups, rng_tracker, device):
        super().__init__()
        self.groups = groups
        self.sequence_parallel = execution.sequence_parallel and groups.tp_size > 1
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size, config.hidden_size, tp=groups.tensor_parallel,
            sequence_parallel=execution.sequence_parallel,
            params_dtype=execution.params_dtype, device=device,
            gradient_accumulation_fusion=execution.gradient_accumulation_fusion)
        if config.position_embedding_type == "learned_absolute":
            if config.max_position_embeddings is None:
                raise ValueError("learned absolute position embeddings need `max_position_embeddings` (or `seq_length`)")
            self.position_embeddings = torch.nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                          dtype=execution.params_dtype, device=device)
            layout: TPLayout = replicated_layout(self.position_embeddings.weight.shape, groups.tp_size, groups.tp_rank)
            set_layout(self.position_embeddings.weight, layout, "normal")
        else:
            self.position_embeddings = None
        self.dropout = config.hidden_dropout
        self.rng_tracker = rng_tracker if self.sequence_parallel else None

    def forward(self, tokens, position_ids, notify: bool = True):
        x = self.word_embeddings(tokens, notify)  # [s, b, h] or [s/tp, b, h]
        if self.position_embeddings is not None:
            positions = self.position_embeddings(position_ids.t())  # [s, b, h]
            if self.sequence_parallel:
                positions = scatter_to_sequence_parallel_region(positions, self.groups.tp)
            x = x + positions
        if self.training and self.dropout > 0.0:
            if self.rng_tracker is not None:
                with self.rng_tracker.fork():
                    return F.dropout(x, self.dropout, training=True)
            return F.dropout(x, self.dropout, training=True)
        return x


def _check_mtp_embedding_copy(config) -> None:
    """The last stage's copy of the embedding is kept in step with the first stage's for the word
    embedding only; a learned position table there would drift."""
    if config.position_embedding_type == "learned_absolute":
        raise ValueError("--mtp-num-layers with --pipeline-model-parallel-size > 1 needs --position-embedding-type "
                         "rope or none: the last stage's copy of a learned position table is not kept in step "
                         "with the first stage's")
