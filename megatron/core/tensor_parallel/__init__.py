from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    Part,
    RowParallelLinear,
    TPLayout,
    VocabParallelEmbedding,
    initialize_param,
    replicated_layout,
    set_layout,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from megatron.core.tensor_parallel.random import RNGStatesTracker, build_tracker
