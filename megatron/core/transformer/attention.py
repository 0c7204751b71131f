"""Self-attention: project, rotate, attend, project.

Heads are split over tensor-parallel ranks: each rank holds num_attention_heads/tp query heads and
the key/value groups they read. When TP exceeds the number of query groups, each group's key/value
projection is replicated on the tp/groups ranks that use it (their gradients are summed after
backward, see `TPLayout.sum_partial_replica_grads`).
"""
import contextlib
import dataclasses
import importlib.util
import logging
import statistics
import time
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core import utils
from megatron.core.context_parallel import ContextParallelAttention
from megatron.core.parallel_state import TensorParallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, Part, RowParallelLinear
from megatron.core.tensor_parallel.random import RNGStatesTracker
from megatron.core.transformer.config import DEFAULT_EXECUTION
from megatron.core.transformer.flops import causal_attention_flops_per_token, matmul_flops_per_token
from megatron.core.transformer.fusions import pick, rotary, rotary_interleaved
from megatron.core.transformer.norm import build_norm

logger = logging.getLogger(__name__)

_SDPA_HAS_GQA = "enable_gqa" in F.scaled_dot_product_attention.__doc__

# --attention-backend values -> the SDPA kernels each may run, in PyTorch's order of preference.
# Megatron's names: flash, fused (cuDNN, else memory-efficient), unfused and local (math).
SDPA_KERNELS = {
    "flash": (SDPBackend.FLASH_ATTENTION,),
    "fused": (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION),
    "unfused": (SDPBackend.MATH,),
    "local": (SDPBackend.MATH,),
    "cudnn": (SDPBackend.CUDNN_ATTENTION,),
    "efficient": (SDPBackend.EFFICIENT_ATTENTION,),
    "math": (SDPBackend.MATH,),
}
ATTENTION_BACKENDS = ("auto", *SDPA_KERNELS, "flash_attn")
PROBED = ("cudnn", "flash", "efficient")  # what --attention-backend auto times on GPU
CPU_KERNELS = (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH)  # the SDPA kernels PyTorch has on the CPU


def no_kernel_for(error: RuntimeError) -> bool:
    """Whether `error` is SDPA saying that none of the allowed kernels takes these inputs (the one
    failure a fallback answers; out-of-memory and every other error propagate)."""
    message = str(error)
    return not isinstance(error, torch.OutOfMemoryError) and (
        "No available kernel" in message or "No viable backend" in message)  # CUDA's, CPU's wording


def sdpa_quietly(call):
    """(call(), None), or (None, why) when SDPA finds no allowed kernel for the inputs.

    Before raising "No available kernel", SDPA on CUDA warns once per kernel it ruled out, with the
    reason; those warnings become `why` (one string) instead of lines in the run's log. Warnings of
    a call that runs are passed on unchanged; any other error propagates, its warnings with it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result, error = call(), None
        except RuntimeError as raised:
            result, error = None, raised
    if error is not None and no_kernel_for(error):
        return None, warning_lines(caught) or str(error).splitlines()[0]
    for warning in caught:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if error is not None:
        raise error
    return result, None


def warning_lines(caught) -> str:
    """The distinct first lines of recorded warnings, in order, as one string."""
    lines = dict.fromkeys(str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip())
    return "; ".join(lines)


def flash_attn_available() -> bool:
    return flash_attn_module() is not None


def flash_attn_module():
    """The flash-attn package's module: the Hopper FA3 build when installed, else FA2, else None."""
    for name in ("flash_attn_interface", "flash_attn"):
        if importlib.util.find_spec(name) is not None:
            return importlib.import_module(name)
    return None


class CoreAttention(torch.nn.Module):
    """softmax(q k^T / sqrt(d) + mask) v over local heads.

    q: [b, nq, s, d], k/v: [b, nkv, s, d] -> [b, nq, s, d]. The mask is causal unless
    `attention_mask` says otherwise: a FlexAttention `BlockMask` (document-aware attention on GPU)
    or a dense bool [b, 1, s, s] (True = may attend). The module boundary is what selective
    recomputation re-runs, and what context parallelism replaces with ring attention.
    """

    def __init__(self, config, rng_tracker, *, execution=DEFAULT_EXECUTION):
        super().__init__()
        requested = execution.attention_backend
        if requested not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {requested!r}")
        self.dropout = config.attention_dropout
        self.rng_tracker = rng_tracker
        self.flash_attn = flash_attn_module() if requested == "flash_attn" else None
        backend = "flash" if requested == "flash_attn" else requested
        self.kernels = SDPA_KERNELS.get(backend)  # None: PyTorch chooses (auto, unresolved)
        self.expand_kv = not _SDPA_HAS_GQA  # set when the chosen kernel rejects grouped k/v
        self.grouped_kv_runs = False  # set once a call with grouped k/v (enable_gqa) ran
        self.expand_kv_reason = ""    # why the kernel took no grouped k/v (PyTorch's words)
        self.quiet = False            # the start-up probe reports the expansion in its own line

    def forward(self, q, k, v, attention_mask=None):
        dropout = self.dropout if self.training else 0.0
        if dropout > 0.0 and self.rng_tracker is not None:
            with self.rng_tracker.fork():
                return self._attend(q, k, v, attention_mask, dropout)
        return self._attend(q, k, v, attention_mask, dropout)

    def _attend(self, q, k, v, attention_mask, dropout):
        group = q.shape[1] // k.shape[1]
        if is_block_mask(attention_mask):
            return flex_attention_fn(q.device)(q, k, v, block_mask=attention_mask, enable_gqa=group > 1)
        if self.flash_attn is not None and attention_mask is None:
            out = self.flash_attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  causal=True, **({"dropout_p": dropout} if dropout else {}))
            out = out[0] if isinstance(out, tuple) else out  # FA3 also returns the log-sum-exp
            return out.transpose(1, 2)
        mask = {"attn_mask": attention_mask} if attention_mask is not None else {"is_causal": True}
        with sdpa_kernel(list(self.kernels)) if self.kernels else contextlib.nullcontext():
            if group > 1 and not self.expand_kv and self.grouped_kv_runs:
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, enable_gqa=True, **mask)
            if group > 1 and not self.expand_kv:
                # SDPA's flash and math kernels take grouped k/v heads (enable_gqa); its cuDNN and
                # memory-efficient ones do not (PyTorch 2.13). The first call finds out, quietly.
                out, why = sdpa_quietly(lambda: F.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout, enable_gqa=True, **mask))
                if why is None:
                    self.grouped_kv_runs = True
                    return out
                self.expand_kv, self.expand_kv_reason = True, why
                self._report_expansion(list(q.shape))
            if group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, **mask)

    def _report_expansion(self, shape: list) -> None:
        """One log line per kernel choice and shape, not one per layer."""
        kernels = "/".join(k.name for k in self.kernels) if self.kernels else "SDPA"
        if self.quiet or (kernels, *shape) in _EXPANSIONS_REPORTED:
            return
        _EXPANSIONS_REPORTED.add((kernels, *shape))
        logger.info("attention: %s takes no grouped key/value heads on %s; expanding them (repeat_interleave) "
                    "(%s)", kernels, shape, self.expand_kv_reason)


_EXPANSIONS_REPORTED = set()


# -- document-aware attention (--reset-attention-mask) ---------------------------------------------
def is_block_mask(mask) -> bool:
    return mask is not None and type(mask).__name__ == "BlockMask"


def flex_attention_fn(device):
    """FlexAttention, compiled on an accelerator (its Triton kernel), eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    return pick(flex_attention, utils.is_accelerator(device))


def document_attention_mask(document_ids: torch.Tensor):
    """The causal mask restricted to each token's own document, from document_ids [b, s] (the
    index of the document each token belongs to). On an accelerator a FlexAttention `BlockMask`
    (block-sparse: no s x s tensor, fully masked blocks are skipped); on the CPU the exact dense
    bool mask [b, 1, s, s]."""
    b, s = document_ids.shape
    if not utils.is_accelerator(document_ids.device):
        causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
        same_document = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)  # [b, s, s]
        return (same_document & causal).unsqueeze(1)
    return document_block_mask(document_ids)


def document_block_mask(document_ids: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask

    b, s = document_ids.shape

    def causal_same_document(batch, head, q_index, kv_index):
        return (q_index >= kv_index) & (document_ids[batch, q_index] == document_ids[batch, kv_index])

    return create_block_mask(causal_same_document, B=b, H=None, Q_LEN=s, KV_LEN=s, device=document_ids.device,
                             _compile=utils.is_accelerator(document_ids.device))


# -- choosing the kernel once at start-up ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Probe:
    """One kernel's result in the start-up probe: the median seconds of a forward+backward, or
    None where no kernel of `name` takes the shape; `note` says why not, or how it ran."""
    name: str
    seconds: Optional[float]
    note: str = ""


def resolve_attention_backend(requested: str, *, batch: int, heads: int, groups: int, seq: int, head_dim: int,
                              dtype: torch.dtype, device: torch.device, batch_first: bool = False,
                              time_backend=None) -> tuple[str, str]:
    """(backend to build the model with, one line saying which kernel runs).

    `auto` on an accelerator times each SDPA kernel (and the flash-attn package when installed) on
    one micro-batch's attention shape, forward and backward, and takes the fastest that runs; on the
    CPU it leaves the choice to PyTorch. An explicit `--attention-backend` is never probed or
    replaced on an accelerator. `batch_first`: the layout the model runs (`runs_batch_first`), which
    the probe's tensors take. `time_backend(name)` -> `Probe` replaces the timing (tests)."""
    if requested == "flash_attn":
        module = flash_attn_module()
        if module is None:
            return "flash", "attention: flash-attn not installed; SDPA FLASH_ATTENTION"
        return "flash_attn", f"attention: flash-attn package ({module.__name__})"
    if requested != "auto":
        kernels = ", ".join(k.name for k in SDPA_KERNELS[requested])
        if not utils.is_accelerator(device) and not set(SDPA_KERNELS[requested]) & set(CPU_KERNELS):
            # Megatron-LM's scripts ask for GPU kernels (fused: cuDNN or memory-efficient) that the
            # CPU does not have: run what it has rather than fail.
            return "auto", (f"attention: --attention-backend {requested} ({kernels}) needs a GPU; "
                            "SDPA, kernel chosen by PyTorch (CPU)")
        return requested, f"attention: --attention-backend {requested} -> SDPA {kernels}"
    if not utils.is_accelerator(device):
        return "auto", "attention: SDPA, kernel chosen by PyTorch (CPU)"
    if time_backend is None:
        def time_backend(name):
            return _time_backend(name, batch, heads, groups, seq, head_dim, dtype, device, batch_first=batch_first)
    candidates = (("flash_attn",) if flash_attn_available() else ()) + PROBED
    return choose_backend([time_backend(name) for name in candidates], f"[{batch}, {heads}, {seq}, {head_dim}]",
                          groups)


def choose_backend(probes: list, shape: str, groups: int) -> tuple[str, str]:
    """The fastest kernel that ran, and the one attention line: each time (with how it ran), then
    the kernels that could not run and why."""
    ran = [p for p in probes if p.seconds is not None]
    unavailable = "; ".join(f"{p.name}: {p.note}" for p in probes if p.seconds is None)
    unavailable = f"; unavailable: {unavailable}" if unavailable else ""
    if not ran:
        return "auto", f"attention: no kernel passed the probe; SDPA, kernel chosen by PyTorch{unavailable}"
    best = min(ran, key=lambda p: p.seconds)
    times = ", ".join(f"{p.name} {p.seconds * 1e3:.2f} ms" + (f" ({p.note})" if p.note else "") for p in ran)
    return best.name, (f"attention: auto -> {best.name} (fwd+bwd on {shape}, {groups} k/v heads, median of "
                       f"{PROBE_REPEATS} after {PROBE_WARMUP} warm-up calls: {times}){unavailable}")


PROBE_WARMUP, PROBE_REPEATS = 2, 5  # cuDNN builds its plans in the first calls: never timed


def probe_inputs(batch, heads, groups, seq, head_dim, dtype, device, batch_first: bool = False):
    """q, k, v [b, n, s, d] laid out as `SelfAttention` passes them (permuted views of [s, b, n, d]
    tensors, or of [b, s, n, d] ones when it runs batch-first: q and k as the rotation writes them,
    v a view of the fused QKV output), and a dense output gradient [b, nq, s, d] in the layout the
    output projection's backward returns."""
    qkv = torch.randn(seq, batch, (heads + 2 * groups) * head_dim, device=device, dtype=dtype, requires_grad=True)
    q, k, v = qkv.split((heads * head_dim, groups * head_dim, groups * head_dim), dim=-1)
    q = q.view(seq, batch, heads, head_dim)
    k, v = k.view(seq, batch, groups, head_dim), v.view(seq, batch, groups, head_dim)
    if batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    q, k = q.contiguous(), k.contiguous()  # the rotation's output
    grad = torch.randn(*q.shape, device=device, dtype=dtype)
    return (*(t.transpose(1, 2) if batch_first else t.permute(1, 2, 0, 3) for t in (q, k, v, grad)),)


def _time_backend(name, batch, heads, groups, seq, head_dim, dtype, device, batch_first=False,
                  warmup: int = PROBE_WARMUP, repeats: int = PROBE_REPEATS) -> Probe:
    """The median seconds of `repeats` forward+backward calls of `name` on that shape and layout,
    after `warmup` untimed ones. PyTorch's warnings during the probe (the reasons a kernel does not
    run) go into the returned note, not the log."""
    from types import SimpleNamespace

    attention = CoreAttention(SimpleNamespace(attention_dropout=0.0), None,
                              execution=SimpleNamespace(attention_backend=name))
    attention.quiet = True
    q, k, v, grad = probe_inputs(batch, heads, groups, seq, head_dim, dtype, device, batch_first)

    def step():
        attention(q, k, v).backward(grad)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            seconds = median_seconds(step, device, warmup, repeats)
        except RuntimeError as error:
            if not no_kernel_for(error):
                raise
            return Probe(name, None, warning_lines(caught) or str(error).splitlines()[0])
    # The reason a kernel took no grouped heads is PyTorch's, the same for every shape: not repeated here.
    notes = ["k/v heads expanded"] if attention.expand_kv and groups < heads else []
    return Probe(name, seconds, "; ".join(notes + ([warning_lines(caught)] if caught else [])))


def median_seconds(step, device, warmup: int, repeats: int) -> float:
    """The median wall time of `repeats` calls of `step`, each synchronized, after `warmup` calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        utils.synchronize(device)
        start = time.perf_counter()
        step()
        utils.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def runs_batch_first(batch: int, seq: int, hidden: int, *, sequence_parallel: bool = False,
                     context_parallel: bool = False, fp8: bool = False) -> bool:
    """Whether this micro-batch's attention runs batch-first: q and k written [b, s, n, d], so
    the kernels that follow q's layout (SDPA flash and cuDNN) write their output so, and the
    output projection takes it as [b*s, nq*d] without a copy. Sequence-first at micro-batch > 1,
    the attention output and its gradient are [b, s, n, d] views of [s, b, n, d] memory, which
    PyTorch's flash backward copies (both, 2 bytes read and written per element each: 8 per
    element of the [b*s, nq*d] output). Batch-first, the projection's weight gradient takes one
    GEMM per sample whose rows are strided in the sequence-first output gradient, and each
    accumulates into main_grad (8 bytes per weight, b - 1 more times): cheaper while
    b*s > (b - 1) * hidden. Not under sequence parallelism (its reduce-scatter needs the
    [s, b, h] output contiguous: a copy of h per token instead of nq*d/tp), context parallelism
    (its kernels return [b, n, s, d]) or an FP8 projection (its gradient cast reads rows in
    order)."""
    if batch == 1 or sequence_parallel or context_parallel or fp8:
        return False
    return batch * seq > (batch - 1) * hidden


class SelfAttention(torch.nn.Module):
    compilable = {"_rotate": "fuse_elementwise"}  # parallelize.py

    def __init__(self, config, *, execution=DEFAULT_EXECUTION, tp: TensorParallel = TensorParallel(),
                 rng_tracker: RNGStatesTracker, device, cp_group=None):
        super().__init__()
        config.check_tensor_parallel(tp.size)
        self.config = config
        kv_shards = min(tp.size, config.num_query_groups)
        self.num_local_heads = config.local_heads(tp.size)
        self.num_local_groups = config.local_query_groups(tp.size)
        self.head_dim = config.kv_channels
        parts = (
            Part("q", config.query_projection_size, tp.size),
            Part("k", config.kv_projection_size, kv_shards, sum_replica_grads=True),
            Part("v", config.kv_projection_size, kv_shards, sum_replica_grads=True),
        )
        common = dict(tp=tp, sequence_parallel=execution.sequence_parallel, params_dtype=execution.params_dtype,
                      device=device, gradient_accumulation_fusion=execution.gradient_accumulation_fusion)
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, None, parts=parts,
                                               bias=config.add_bias_linear or config.add_qkv_bias, **common)
        self.context_parallel = cp_group is not None
        if cp_group is None:
            self.core_attention = CoreAttention(config, rng_tracker, execution=execution)
        else:  # context parallelism: this rank holds part of the sequence (None is a group of one)
            self.core_attention = ContextParallelAttention(
                config, execution=execution, cp_group=cp_group, num_local_heads=self.num_local_heads, num_local_groups=self.num_local_groups)
        self.linear_proj = RowParallelLinear(config.query_projection_size, config.hidden_size,
                                             bias=config.add_bias_linear, **common)
        self._rotate = rotary_interleaved if config.rotary_interleaved else rotary
        if config.qk_layernorm:
            # One weight over each head's channels, shared by all heads; each rank normalizes its
            # own heads, so the gradients are partial sums over the TP group.
            norm = dict(execution=execution, tp=tp, device=device, partial_grads=True)
            self.q_layernorm = build_norm(config, config.kv_channels, **norm)
            self.k_layernorm = build_norm(config, config.kv_channels, **norm)
        else:
            self.q_layernorm = self.k_layernorm = None

    def forward(self, x, rotary_cos_sin=None, attention_mask=None):
        # x: [s, b, h] (or [s/tp, b, h] with sequence parallelism; linear_qkv gathers it)
        qkv = self.linear_qkv(x)
        s, b = qkv.shape[:2]
        q_size = self.num_local_heads * self.head_dim
        kv_size = self.num_local_groups * self.head_dim
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        q = q.view(s, b, self.num_local_heads, self.head_dim)
        k = k.view(s, b, self.num_local_groups, self.head_dim)
        v = v.view(s, b, self.num_local_groups, self.head_dim)
        batch_first = self._batch_first(s, b)
        if batch_first:  # [b, s, n, d] views: the norms and the rotation write q and k batch-first
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary_cos_sin is not None:
            cos, sin = (t.transpose(0, 1) for t in rotary_cos_sin) if batch_first else rotary_cos_sin
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        # -> [b, n, s, d]
        q, k, v = (t.transpose(1, 2) if batch_first else t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = self.core_attention(q, k, v, attention_mask)
        if batch_first and out.transpose(1, 2).is_contiguous():
            # The kernel wrote [b, s, n, d]: project [b*s, nq*d] as it lies; the residual add reads
            # the result through a transposed view.
            return self.linear_proj(out.transpose(1, 2).reshape(b, s, q_size)).transpose(0, 1)  # [s, b, h]
        out = out.permute(2, 0, 1, 3).reshape(s, b, q_size)  # [s, b, nq*d]; a view if stored so
        return self.linear_proj(out)

    def _batch_first(self, s: int, b: int) -> bool:
        """Whether this micro-batch's attention runs batch-first (`runs_batch_first`)."""
        return runs_batch_first(b, s, self.config.hidden_size, sequence_parallel=self.linear_proj.sequence_parallel,
                                context_parallel=self.context_parallel, fp8=self.linear_proj.fp8 is not None)

    def flops_per_token(self, seq_length: int) -> int:
        """Forward FLOPs per token (transformer.flops): the projections, and the causal attention
        products of this rank's heads."""
        return (matmul_flops_per_token(self, seq_length)
                + causal_attention_flops_per_token(seq_length, self.num_local_heads, self.head_dim, self.head_dim))
