"""Reading Megatron-LM / Megatron-Core GPT checkpoints into the logical state.

`read_megatron_checkpoint(path)` returns the model weights of a checkpoint that Megatron-LM's
`pretrain_gpt.py` saved, as this framework's logical state ({global parameter name: {part name: full
fp32 tensor}}, the form `hf_mapping.load_logical_into_model` loads into any TP rank / PP stage),
together with an equivalent `TransformerConfig`. Optimizer, scheduler and RNG state are not read.

Where: `path` is a save directory (`latest_checkpointed_iteration.txt` naming an iteration, or
"release") or one iteration's directory (`iter_0000100/`, `release/`).

Formats (Megatron-LM's `--ckpt-format`):
- `torch_dist`: Megatron-Core's dist_checkpointing on torch.distributed.checkpoint (`.metadata`,
  `__*_*.distcp`, `common.pt` with the arguments, `metadata.json`). Tensors are stored whole
  (global shapes, any TP/PP layout), the decoder's tensors stacked with a leading layer dimension
  (`decoder.layers.mlp.linear_fc2.weight` is [num_layers, h, ffn]). Only the model's tensors are
  read, without a process group.
- `torch` (legacy): one `mp_rank_XX/model_optim_rng.pt` per TP rank, `mp_rank_XX_YYY/` per TP rank
  XX and PP stage YYY, `mp_rank_XX[_YYY]_ZZZ/` per expert-parallel rank ZZZ (mixture of experts:
  each file holds its rank's experts; the dense tensors are read from rank 0's); the model under
  `model`, or `model0`, `model1`, ... per virtual pipeline stage. Shards are merged: column-parallel
  weights (linear_qkv, linear_fc1, the vocabulary-parallel embedding and output layer) along dim 0,
  row-parallel ones (linear_proj, linear_fc2) along dim 1, norms and row-parallel biases taken from
  TP rank 0. Layers are numbered per model chunk; chunks are laid out in pipeline order (virtual
  stage 0 of stages 0..PP-1, then virtual stage 1, ...), each chunk's layer count taken from its
  own shard.

Layouts undone:
- linear_qkv interleaves q, k and v per query group ([q heads of group 0, k0, v0, q heads of group 1,
  k1, v1, ...]); ours is [q | k | v], kept as the parts "q", "k", "v".
- linear_fc1 with SwiGLU is [gate; up] on each TP shard (legacy) or over the whole tensor
  (torch_dist); ours keeps the parts "gate" and "up".
- The Transformer Engine spec fuses the layer norms into the next linear layer
  (`self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`, and `_bias`);
  torch_dist checkpoints use those names for every spec. They become `input_layernorm` and
  `pre_mlp_layernorm`; `_extra_state` entries (FP8 metadata) are skipped.
- A tied output layer (no `--untie-embeddings-and-output-weights`) is the word embedding: the last
  pipeline stage's copy in legacy files is not read.
- Mixture of experts (router, expert bias, routed experts in each form Megatron-Core writes, shared
  experts and their gate): see megatron_lm_moe.py. The router's expert bias, a buffer, is a logical
  entry `decoder.layers.i.mlp.router.expert_bias` of its own.
- Multi-latent attention and multi-token prediction (`mtp.layers.k.*`, the depth's layer read as a
  decoder layer is): see megatron_lm_mla.py.

The model's arguments are read by name: TransformerConfig's fields are Megatron-LM's argument names,
so the config is a loop over them (`config_from_megatron_args`).

Refused with a ValueError naming the option: what GPTModel cannot represent (sliding-window
attention, non-vanilla softmax, squared ReLU, quick GeGLU, post-layernorm residuals, rotary sequence
interpolation, position embeddings other than rope / learned_absolute / none; for multi-latent
attention and multi-token prediction see megatron_lm_mla.py; for experts: a router bias, the
sqrtsoftplus score function, probabilities applied to the experts' input, latent experts,
interleaved gate/up rows, legacy files with an expert-tensor-parallel size other than the
tensor-parallel one), Megatron-LM's pre-Core models
(`--use-legacy-models`, keys under `language_model`), checkpoint versions before 3.0, and formats
other than the two above.

Safety: nothing in the files is executed (see safe_pickle: `.pt` files are read with
`torch.load(weights_only=True)`, Megatron's own classes arrive as inert `MegatronObject`s, and
torch.distributed.checkpoint's `.metadata` is unpickled with an allow-list). A corrupt or truncated
file is a ValueError naming the file.
"""
import dataclasses
import json
import os
import re
import warnings
from argparse import Namespace
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.core.checkpointing import megatron_lm_mla as mla
from megatron.core.checkpointing import megatron_lm_moe as moe
from megatron.core.checkpointing.safe_pickle import check_dcp_files, first_line, load_pickled
from megatron.core.checkpointing.safe_reader import SafeFileSystemReader
from megatron.core.models.gpt.hf_mapping import OUTPUT_LAYER
from megatron.core.models.gpt.model import WORD_EMBEDDINGS, GPTModel
from megatron.core.parallel_state import single_process
from megatron.core.transformer.config import TransformerConfig, derive

TRACKER = "latest_checkpointed_iteration.txt"
FORMATS = ("torch_dist", "torch")
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_ROUTER_BIAS = ".mlp.router.expert_bias"
_STACKED_LAYERS = "decoder.layers."
_MODEL_ROOTS = ("embedding.", "decoder.", "output_layer.", "mtp.")
# A decoder layer or a multi-token prediction depth's layer: (its prefix, the name within the layer).
_ANY_LAYER = re.compile(rf"({moe.LAYER_PREFIX})\.(.+)")

# The Transformer Engine spec's fused layer-norm names -> the local spec's (and ours).
_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
    **mla.FUSED_NORMS,
}
# How legacy files split each tensor over TP ranks: the dim its shards are concatenated along, or
# None for tensors every rank holds whole.
_LAYER_SPLIT = {
    "input_layernorm.weight": None, "input_layernorm.bias": None,
    "self_attention.linear_qkv.weight": 0, "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1, "self_attention.linear_proj.bias": None,
    "pre_mlp_layernorm.weight": None, "pre_mlp_layernorm.bias": None,
    "self_attention.q_layernorm.weight": None, "self_attention.q_layernorm.bias": None,
    "self_attention.k_layernorm.weight": None, "self_attention.k_layernorm.bias": None,
    "mlp.linear_fc1.weight": 0, "mlp.linear_fc1.bias": 0,
    "mlp.linear_fc2.weight": 1, "mlp.linear_fc2.bias": None,
    **mla.LAYER_SPLIT,
    **moe.LAYER_SPLIT,
}
_MODEL_SPLIT = {
    WORD_EMBEDDINGS: 0, "embedding.position_embeddings.weight": None,
    "decoder.final_layernorm.weight": None, "decoder.final_layernorm.bias": None,
    OUTPUT_LAYER: 0,
}


@dataclass
class MegatronCheckpoint:
    iteration: int
    args: dict                 # Megatron argument name -> value
    config: TransformerConfig  # ours, equivalent
    logical: dict              # {global name: {part: full fp32 tensor}}
    format: str                # "torch_dist" or "torch" (legacy)
    directory: str             # the iteration's directory that was read


def read_megatron_checkpoint(path, iteration: Optional[int] = None) -> MegatronCheckpoint:
    """Reads a Megatron-LM GPT checkpoint (see the module docstring). `iteration`: which `iter_*`
    of a save directory to read instead of the one its tracker file names."""
    directory = iteration_directory(path, iteration)
    fmt = checkpoint_format(directory)
    if fmt == "torch_dist":
        common = _read_common(load_pickled(os.path.join(directory, "common.pt")), directory)
        num_layers = _required(vars(common["args"]), "num_layers", directory)
        tensors = _unstack_layers(_read_torch_dist(directory), num_layers, directory)
    else:
        common, tensors = _read_legacy(directory)
    args = dict(vars(common["args"]))
    vocab_rows = _vocab_rows(tensors, directory)
    config = config_from_megatron_args(args, vocab_rows, source=directory)
    logical = _to_logical(tensors, config, directory)
    _check_against_model(logical, config, directory)
    found = common.get("iteration")
    return MegatronCheckpoint(iteration=int(found) if found is not None else 0, args=args, config=config,
                              logical=logical, format=fmt, directory=directory)


# ------------------------------------------------------------------------------------------------
# Where and which format
# ------------------------------------------------------------------------------------------------
def iteration_directory(path, iteration: Optional[int] = None) -> str:
    """The directory of one iteration: `path` itself, or the one its tracker file (or
    `iteration`) names."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Megatron checkpoint directory {path} does not exist")
    if _holds_one_iteration(path):
        if iteration is not None and os.path.basename(os.path.normpath(path)) != f"iter_{iteration:07d}":
            raise ValueError(f"{path} is the directory of one iteration; iteration={iteration} asks for another: "
                             "pass the save directory above it")
        return path
    tracker = os.path.join(path, TRACKER)
    if iteration is not None:
        name, named_by = f"iter_{iteration:07d}", f"iteration={iteration}"
    elif os.path.isfile(tracker):
        name, named_by = _read_tracker(tracker), tracker
    else:
        raise ValueError(f"{path} is not a Megatron checkpoint: no {TRACKER}, and no metadata.json or mp_rank_* "
                         "directories of one iteration")
    directory = os.path.join(path, name)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory} (named by {named_by}) does not exist")
    return directory


def _read_tracker(tracker: str) -> str:
    with open(tracker) as f:
        text = f.read().strip()
    if text == "release":
        return "release"
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected an iteration number or 'release', found {text!r}")
    return f"iter_{int(text):07d}"


def _holds_one_iteration(path: str) -> bool:
    names = os.listdir(path)
    return any(n in ("metadata.json", ".metadata") or _RANK_DIR.fullmatch(n) for n in names)


def checkpoint_format(directory: str) -> str:
    """"torch_dist" or "torch" (legacy): the format of one iteration's directory."""
    config_file = os.path.join(directory, "metadata.json")
    if os.path.isfile(config_file):
        try:
            with open(config_file) as f:
                backend = json.load(f).get("sharded_backend")
        except (OSError, ValueError, AttributeError) as error:
            raise ValueError(f"{config_file}: not a Megatron dist_checkpointing metadata file ({error})") from error
        if backend != "torch_dist":
            raise ValueError(f"{directory}: --ckpt-format {backend} cannot be imported; supported: {FORMATS}")
        return "torch_dist"
    if os.path.isfile(os.path.join(directory, ".metadata")):
        raise ValueError(f"{directory}: a torch.distributed.checkpoint directory without Megatron's metadata.json "
                         f"(--ckpt-format torch_dcp or fsdp_dtensor?) cannot be imported; supported: {FORMATS}")
    if any(_RANK_DIR.fullmatch(name) for name in os.listdir(directory)):
        return "torch"
    raise ValueError(f"{directory}: neither a torch_dist checkpoint (metadata.json) nor a legacy one (mp_rank_*/)")


# ------------------------------------------------------------------------------------------------
# torch_dist
# ------------------------------------------------------------------------------------------------
def _read_torch_dist(directory: str) -> dict:
    """{Megatron tensor name: full tensor}, the decoder's tensors stacked."""
    reader = SafeFileSystemReader(directory)
    metadata = reader.read_metadata()
    check_dcp_files(directory, metadata)
    tensors = {name: torch.empty(meta.size, dtype=meta.properties.dtype)
               for name, meta in metadata.state_dict_metadata.items()
               if isinstance(meta, TensorStorageMetadata) and name.startswith(_MODEL_ROOTS)}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as error:  # the latter derives from BaseException
        raise ValueError(f"{directory}: reading the torch_dist checkpoint failed: {first_line(error)}") from error
    return tensors


def _unstack_layers(tensors: dict, num_layers: int, directory: str) -> dict:
    """decoder.layers.X [num_layers, ...] -> decoder.layers.{i}.X for each layer (local names); the
    experts' [E, ...] tensors one per expert. Models with layers of more than one kind (a
    --moe-layer-freq pattern) are saved per layer, `decoder.layers.{i}.X`."""
    out = {}
    for name, tensor in tensors.items():
        if _LAYER.fullmatch(name):
            out[_canonical_name(name)] = tensor
            continue
        if not name.startswith(_STACKED_LAYERS):  # the multi-token prediction depths are saved one by one
            out[_canonical_name(name)] = tensor
            continue
        if tensor.ndim == 0 or tensor.shape[0] != num_layers:
            raise ValueError(f"{directory}: {name} has shape {tuple(tensor.shape)}; expected the layers stacked in "
                             f"its first dimension (num_layers={num_layers})")
        suffix = name[len(_STACKED_LAYERS):]
        for layer in range(num_layers):
            out[_canonical_name(f"decoder.layers.{layer}.{suffix}")] = tensor[layer]
    return moe.split_torch_dist_experts(out)


# ------------------------------------------------------------------------------------------------
# Legacy (mp_rank_XX[_YYY]/model_optim_rng.pt)
# ------------------------------------------------------------------------------------------------
def _read_legacy(directory: str) -> tuple[dict, dict]:
    """(args, iteration and version of the first file, {Megatron tensor name (global layer numbers,
    global expert indices): full tensor}). Stage by stage: one stage's shards are in memory at a time."""
    first_rank = min(name for name in os.listdir(directory) if _RANK_DIR.fullmatch(name))
    first = os.path.join(directory, first_rank, "model_optim_rng.pt")
    loaded = {first: load_pickled(first)}
    common = _read_common(loaded[first], directory)
    args = vars(common["args"])
    files, tp_size, pp_size, ep_size = _legacy_files(directory, args)
    _check_layout(common, tp_size, pp_size, ep_size, directory)
    whole_rows = mla.down_projection_rows(args)
    num_local = args["num_experts"] // ep_size if args.get("num_experts") else 0
    chunks = {}   # (virtual stage, pipeline stage) -> {name with local layer number: full tensor}
    for stage in range(pp_size):
        for ep_rank in range(ep_size):
            shards = []
            for tp_rank in range(tp_size):
                file = files[(tp_rank, stage, ep_rank)]
                state = loaded.pop(file) if file in loaded else load_pickled(file)
                shards.append([moe.global_experts(chunk, ep_rank, num_local, args.get("hidden_size"))
                               for chunk in _model_chunks(state, file)])
                del state
            for virtual, chunk_shards in enumerate(zip(*shards, strict=True)):
                merged = _merge_tensor_parallel(list(chunk_shards), args, whole_rows, files[(0, stage, ep_rank)])
                if ep_rank > 0:  # the dense tensors are the same on every expert-parallel rank
                    merged = {name: tensor for name, tensor in merged.items() if ".mlp.experts." in name}
                chunks.setdefault((virtual, stage), {}).update(merged)
    return common, _number_layers_globally(chunks, pp_size, directory)


def _legacy_files(directory: str, args: dict) -> tuple[dict, int, int, int]:
    """{(TP rank, PP stage, EP rank): file}, and the three sizes. Megatron-LM names a rank's directory
    mp_rank_TT, then _PPP with pipeline parallelism, then _EEE with expert parallelism: a name with
    one suffix is a pipeline stage or an expert-parallel rank as the arguments say."""
    expert_parallel = (args.get("expert_model_parallel_size") or 1) > 1
    pipeline_parallel = (args.get("pipeline_model_parallel_size") or 1) > 1
    files = {}
    for entry in os.listdir(directory):
        match = _RANK_DIR.fullmatch(entry)
        if not match:
            continue
        suffixes = [int(group) for group in match.groups()[1:] if group is not None]
        if len(suffixes) != pipeline_parallel + expert_parallel:
            raise ValueError(f"{os.path.join(directory, entry)}: a shard directory of another layout than the "
                             f"arguments' (pipeline_model_parallel_size={args.get('pipeline_model_parallel_size')}, "
                             f"expert_model_parallel_size={args.get('expert_model_parallel_size')})")
        stage = suffixes.pop(0) if pipeline_parallel else 0
        ep_rank = suffixes.pop(0) if expert_parallel else 0
        files[(int(match.group(1)), stage, ep_rank)] = os.path.join(directory, entry, "model_optim_rng.pt")
    sizes = [1 + max(key[axis] for key in files) for axis in range(3)]
    for tp in range(sizes[0]):
        for pp in range(sizes[1]):
            for ep in range(sizes[2]):
                name = (f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pipeline_parallel else "")
                        + (f"_{ep:03d}" if expert_parallel else ""))
                if (tp, pp, ep) not in files or not os.path.isfile(files[(tp, pp, ep)]):
                    raise FileNotFoundError(
                        f"{os.path.join(directory, name, 'model_optim_rng.pt')} is missing "
                        f"(the checkpoint has TP {sizes[0]} x PP {sizes[1]} x EP {sizes[2]} shards)")
    return files, *sizes


def _check_layout(common: dict, tp_size: int, pp_size: int, ep_size: int, directory: str) -> None:
    """The shard directories found must be all the checkpoint's arguments say there are."""
    for arg, found in (("tensor_model_parallel_size", tp_size), ("pipeline_model_parallel_size", pp_size),
                       ("expert_model_parallel_size", ep_size)):
        expected = getattr(common["args"], arg, None)
        if expected is not None and int(expected) != found:
            raise ValueError(f"{directory}: {arg} is {expected} in the checkpoint's arguments but its mp_rank_* "
                             f"directories hold {found}; shards are missing")


def _model_chunks(state: dict, file: str) -> list:
    """The model state dicts of one file: `model`, or `model0`, `model1`, ... (virtual stages)."""
    if "model" in state:
        chunks = [state["model"]]
    else:
        indices = sorted(int(key[len("model"):]) for key in state if re.fullmatch(r"model\d+", key))
        if not indices:
            raise ValueError(f"{file}: no model weights (no 'model' or 'model0' entry); saved with --no-save-model?")
        chunks = [state[f"model{i}"] for i in indices]
    for chunk in chunks:
        if "language_model" in chunk:
            raise ValueError(f"{file}: a pre-Megatron-Core model (--use-legacy-models, keys under 'language_model') "
                             "cannot be imported; convert it to Megatron-Core's format first")
    return chunks


def _merge_tensor_parallel(shards: list, args: dict, whole_rows: dict, file: str) -> dict:
    """The full tensors of one model chunk from its TP shards (Megatron's layouts kept)."""
    gated = bool(args.get("swiglu", False))
    merged = {}
    for raw_name in shards[0]:
        if raw_name.endswith("_extra_state"):
            continue
        name = _canonical_name(raw_name)
        dim = _split_dim(name, file)
        pieces = [shard[raw_name] for shard in shards]
        if dim is None or len(pieces) == 1 or mla.is_whole(name, pieces[0], whole_rows):
            merged[name] = pieces[0]
        elif gated and moe.GATED_FC1.fullmatch(name):
            halves = [piece.chunk(2, dim=0) for piece in pieces]  # each shard: [gate_r; up_r]
            merged[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            merged[name] = torch.cat(pieces, dim=dim)
    return merged


def _split_dim(name: str, file: str) -> Optional[int]:
    layer, module = _ANY_LAYER.fullmatch(name), mla.MTP_MODULE.fullmatch(name)
    if layer:
        table, key = _LAYER_SPLIT, moe.split_key(layer.group(2))
    elif module:
        table, key = mla.MTP_SPLIT, module.group(1)
    else:
        table, key = _MODEL_SPLIT, name
    if key not in table:
        raise ValueError(f"{file}: tensor {name!r} is not part of a GPT model this framework can build "
                         "(an option it does not implement?)")
    return table[key]


def _canonical_name(name: str) -> str:
    """The local spec's name for a Transformer Engine spec's fused layer-norm name."""
    match = _ANY_LAYER.fullmatch(name)
    if match and match.group(2) in _FUSED_NORMS:
        return f"{match.group(1)}.{_FUSED_NORMS[match.group(2)]}"
    return name


def _number_layers_globally(chunks: dict, pp_size: int, directory: str) -> dict:
    """Local layer numbers -> global: chunks in pipeline order (virtual stage, then stage)."""
    tensors, offset = {}, 0
    for virtual, stage in sorted(chunks):
        chunk = chunks[(virtual, stage)]
        local = {int(m.group(1)) for m in map(_LAYER.fullmatch, chunk) if m}
        if local and local != set(range(len(local))):
            raise ValueError(f"{directory}: pipeline stage {stage} (virtual stage {virtual}) holds layers "
                             f"{sorted(local)}; expected 0..{len(local) - 1}")
        for name, tensor in chunk.items():
            match = _LAYER.fullmatch(name)
            if match:
                name = f"decoder.layers.{offset + int(match.group(1))}.{match.group(2)}"
            if name == WORD_EMBEDDINGS and name in tensors and stage > 0:
                continue  # the multi-token prediction stage's copy, tied to the first stage's
            if name in tensors:
                raise ValueError(f"{directory}: {name} is held by more than one pipeline stage")
            tensors[name] = tensor
        offset += len(local)
    return tensors


# ------------------------------------------------------------------------------------------------
# Megatron's arguments -> TransformerConfig
# ------------------------------------------------------------------------------------------------
# (argument, Megatron flag, what it is) for options GPTModel does not implement: refused when set.
_UNSUPPORTED = (
    ("moe_apply_probs_on_input", "--moe-apply-probs-on-input", "router weights applied to the experts' input"),
    ("moe_latent_size", "--moe-latent-size", "experts in a latent space"),
    ("moe_mlp_glu_interleave_size", "--moe-mlp-glu-interleave-size", "interleaved gate/up rows of the experts"),
    ("moe_shared_expert_glu_interleave_size", "--moe-shared-expert-glu-interleave-size",
     "interleaved gate/up rows of the shared experts"),
    ("rotary_seq_len_interpolation_factor", "--rotary-seq-len-interpolation-factor", "rotary interpolation"),
    ("apply_residual_connection_post_layernorm", "--apply-residual-connection-post-layernorm",
     "residuals taken after the layer norm"),
    ("squared_relu", "--squared-relu", "squared ReLU"),
    ("quick_geglu", "--quick-geglu", "quick GeGLU"),
    ("window_size", "--window-size", "sliding-window attention"),
    ("attention_output_gate", "--attention-output-gate", "gated attention output"),
    ("use_legacy_models", "--use-legacy-models", "pre-Megatron-Core models"),
    *mla.UNSUPPORTED,
)


def _read_common(state, source: str) -> dict:
    """Arguments, iteration and checkpoint version, checked before any weight is read: the arguments
    must exist and name no option GPTModel lacks."""
    args = state.get("args") if isinstance(state, dict) else None
    if not isinstance(args, (Namespace, SimpleNamespace)):
        raise ValueError(f"{source}: the checkpoint holds no 'args' (Megatron-LM's arguments); cannot tell the "
                         "model's shape")
    version = state.get("checkpoint_version")
    if version is not None and float(version) < 3.0:
        raise ValueError(f"{source}: checkpoint_version {version} (before 3.0) is not supported")
    check_supported(vars(args), source)
    return {"args": args, "iteration": state.get("iteration"), "checkpoint_version": version}


def _required(args: dict, name: str, source: str):
    if args.get(name) is None:
        raise ValueError(f"{source}: the checkpoint's arguments have no {name}")
    return args[name]


def _vocab_rows(tensors: dict, source: str) -> int:
    if WORD_EMBEDDINGS not in tensors:
        raise ValueError(f"{source}: no {WORD_EMBEDDINGS} in the checkpoint")
    return tensors[WORD_EMBEDDINGS].shape[0]


def check_supported(args: dict, source: str = "checkpoint") -> None:
    """Raises ValueError naming the first option in Megatron's arguments that GPTModel lacks, or
    whose tensors this importer does not map."""
    for name, flag, what in _UNSUPPORTED:
        if args.get(name):
            raise ValueError(f"{source}: {flag} ({what}; {name}={args[name]!r}) cannot be imported: GPTModel does "
                             "not implement it")
    for name, default, supported in (("position_embedding_type", "learned_absolute", ("rope", "learned_absolute", "none")),
                                     ("normalization", "LayerNorm", ("LayerNorm", "RMSNorm")),
                                     ("softmax_type", "vanilla", ("vanilla",)),
                                     ("moe_router_score_function", "softmax", ("softmax", "sigmoid"))):
        value = args.get(name) or default
        if value not in supported:
            raise ValueError(f"{source}: --{name.replace('_', '-')} {value} cannot be imported; supported: {supported}")
    moe.check_supported(args, source)


def config_from_megatron_args(args: dict, padded_vocab_size: int, *, source: str = "checkpoint") -> TransformerConfig:
    """Our TransformerConfig for Megatron-LM's arguments (names as in its argparse namespace).

    Raises ValueError for options GPTModel does not implement (see `check_supported`)."""
    check_supported(args, source)
    saved_vocab = args.get("padded_vocab_size")
    if saved_vocab is not None and saved_vocab != padded_vocab_size:
        raise ValueError(f"{source}: padded_vocab_size is {saved_vocab} in the arguments but the word embedding has "
                         f"{padded_vocab_size} rows")
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        _required(args, name, source)
    names = {field.name for field in dataclasses.fields(TransformerConfig)}
    values = {name: value for name, value in args.items() if name in names and value is not None}
    if isinstance(values.get("moe_layer_freq"), (int, list)):  # Megatron-LM parses the flag to these
        values["moe_layer_freq"] = str(values["moe_layer_freq"])
    for field in dataclasses.fields(TransformerConfig):  # nargs='+' flags keep their scalar default
        if field.name in values and _is_list_field(field) and not isinstance(values[field.name], (list, tuple)):
            values[field.name] = [values[field.name]]
    values.update(padded_vocab_size=padded_vocab_size, openai_gelu=_tanh_gelu(args))
    if args.get("multi_latent_attention"):
        values["rotary_interleaved"] = mla.rotary_interleaved(args, source)
    return derive(TransformerConfig(**values), seq_length=args.get("seq_length"))


def _is_list_field(field) -> bool:
    return field.default_factory is not dataclasses.MISSING and isinstance(field.default_factory(), list)


def _tanh_gelu(args: dict) -> bool:
    """--openai-gelu, or Megatron-Core's fused bias-GeLU (--bias-gelu-fusion, on by default, used when
    linear layers have biases), which is the tanh approximation; otherwise its MLP calls the exact
    F.gelu."""
    fused = args.get("bias_gelu_fusion", True) and args.get("add_bias_linear", True)
    return bool(args.get("openai_gelu") or fused)


# ------------------------------------------------------------------------------------------------
# Megatron's layouts -> logical state
# ------------------------------------------------------------------------------------------------
def _to_logical(tensors: dict, config: TransformerConfig, source: str) -> dict:
    tensors = dict(tensors)
    logical = moe.moe_logical(tensors, config, source)
    for name, tensor in tensors.items():
        if name == OUTPUT_LAYER and not config.untie_embeddings_and_output_weights:
            continue  # the last stage's copy of the tied word embedding
        match = _ANY_LAYER.fullmatch(name)
        suffix = match.group(2) if match else ""
        if suffix.startswith("self_attention.linear_qkv."):
            parts = _split_qkv(tensor, config, name, source)
        elif re.fullmatch(r"mlp\.(shared_experts\.mlp\.)?linear_fc1\..+", suffix) and config.swiglu:
            gate, up = tensor.chunk(2, dim=0)
            parts = {"gate": gate, "up": up}
        else:
            parts = {"": tensor}
        logical[name] = {part: piece.to(torch.float32, copy=True).contiguous() for part, piece in parts.items()}
    return logical


def _split_qkv(tensor: torch.Tensor, config: TransformerConfig, name: str, source: str) -> dict:
    """[q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...] -> {"q", "k", "v"}."""
    groups, heads, head_dim = config.num_query_groups, config.num_attention_heads, config.kv_channels
    per_group = heads // groups
    rows = groups * (per_group + 2) * head_dim
    if tensor.shape[0] != rows:
        raise ValueError(f"{source}: {name} has {tensor.shape[0]} rows; the arguments (num_query_groups={groups}, "
                         f"num_attention_heads={heads}, kv_channels={head_dim}) give {rows}")
    rest = tuple(tensor.shape[1:])
    grouped = tensor.reshape(groups, per_group + 2, head_dim, *rest)
    return {"q": grouped[:, :per_group].reshape(heads * head_dim, *rest),
            "k": grouped[:, per_group].reshape(groups * head_dim, *rest),
            "v": grouped[:, per_group + 1].reshape(groups * head_dim, *rest)}


def _check_against_model(logical: dict, config: TransformerConfig, source: str) -> None:
    """Every parameter of the GPTModel `config` builds, with its shape, and nothing else."""
    model = GPTModel(config, single_process(), device="meta")
    expected = {}
    for local_name, param in model.named_parameters():
        layout = param.tp_layout
        shapes = {}
        for part in layout.parts:
            shape = list(param.shape)
            shape[layout.dim] = part.full_size
            shapes[part.name] = tuple(shape)
        expected[model.global_param_name(local_name)] = shapes
    for local_name, buffer in model.named_buffers():
        if local_name.endswith(_ROUTER_BIAS):  # --moe-router-enable-expert-bias: state without gradients
            expected[model.global_param_name(local_name)] = {"": tuple(buffer.shape)}
    missing = sorted(set(expected) - set(logical))
    unexpected = sorted(set(logical) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: the checkpoint's tensors do not match the model its arguments describe: "
                         f"missing {missing}, unexpected {unexpected}")
    for name, shapes in expected.items():
        found = {part: tuple(tensor.shape) for part, tensor in logical[name].items()}
        if found != shapes:
            raise ValueError(f"{source}: {name} has shapes {found}; the model its arguments describe has {shapes}")
