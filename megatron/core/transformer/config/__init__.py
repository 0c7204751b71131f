"""The one model description: `TransformerConfig` (the architecture, Megatron-LM's argument names,
each field's flag, checkpoint role and Hugging Face keys in its metadata), `derive` (defaults and
checks, once), and `ExecutionConfig` (how the layers run it), handed to the layers beside it."""
from megatron.core.transformer.config.architecture import TransformerConfig
from megatron.core.transformer.config.derive import derive, padded_vocab_size, swiglu_ffn_hidden_size
from megatron.core.transformer.config.execution import DEFAULT_EXECUTION, ExecutionConfig
from megatron.core.transformer.config.fields import ARCHITECTURE, NUMERICS, RUN

__all__ = ["TransformerConfig", "ExecutionConfig", "DEFAULT_EXECUTION", "derive", "padded_vocab_size",
           "swiglu_ffn_hidden_size", "ARCHITECTURE", "NUMERICS", "RUN"]
