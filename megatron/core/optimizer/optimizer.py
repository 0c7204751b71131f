"""The optimizer step for low-precision models: fp32 master weights, fp32 gradients, loss scaling.

The model's parameters may be bf16/fp16; their gradients live in fp32 `param.main_grad` buffers
(see distributed.ddp). The inner torch optimizer works on fp32 master copies whose `.grad` is the
`main_grad` view itself (no copy). A step: unscale (fp16) -> detect inf/NaN on every rank alike ->
global-norm clip -> inner step -> copy masters back into the model's dtype.

Passes over the parameters' memory per step (counted in tests/unit/test_optimizer_passes.py): the
gradient norm (one multi-tensor kernel), the fused AdamW update, which also applies the clipping
(the clip coefficient is its `grad_scale`: the gradients are divided inside the same kernel), the
copy of the masters into the model, and the zeroing of the gradient buffer before the next step.
Without a fused kernel (SGD) the clipping is a pass of its own.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.distributed import comm
from megatron.core.optimizer.clip_grads import clip_coefficient, clip_grads, local_square_norm
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.parallel_state import ParallelGroups


@dataclass
class OptimizerConfig:
    optimizer: str = "adam"           # "adam" (AdamW: decoupled weight decay, as Megatron) or "sgd"
    lr: float = 1e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    fp16: bool = False
    bf16: bool = False
    loss_scale: Optional[float] = None  # constant scale; None = dynamic (fp16 only)
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    decoupled_lr: Optional[float] = None      # peak lr of the embedding and output layer (Megatron's --decoupled-lr)
    decoupled_min_lr: Optional[float] = None  # their final lr (default: the scheduler's min_lr)


def param_groups(config: OptimizerConfig, pairs: list, keep_empty: bool = False) -> list:
    """Optimizer param groups of (model parameter, master) pairs. Weight decay on matrices only:
    norms and biases (1-D) are not decayed. With `decoupled_lr`, the embedding and output layer
    (parameters marked `is_embedding_or_output_parameter`) form groups of their own whose
    "max_lr"/"min_lr" the LR scheduler follows. `keep_empty`: every group exists even when this
    rank has no parameter in it (sharded optimizers: all ranks then have the same groups)."""
    separate = config.decoupled_lr is not None
    groups = []
    for decoupled in ((False, True) if separate else (False,)):
        for decay in (True, False):
            masters = [m for p, m in pairs if (p.ndim > 1) == decay
                       and (separate and getattr(p, "is_embedding_or_output_parameter", False)) == decoupled]
            if not masters and not keep_empty:
                continue
            group = {"params": masters, "weight_decay": config.weight_decay if decay else 0.0}
            if decoupled:
                group["max_lr"] = config.decoupled_lr
                if config.decoupled_min_lr is not None:
                    group["min_lr"] = config.decoupled_min_lr
            groups.append(group)
    return groups


def build_inner_optimizer(config: OptimizerConfig, param_groups: list) -> torch.optim.Optimizer:
    """AdamW is torch's fused kernel (one pass over each parameter's master, gradient and moments;
    CUDA, ROCm and CPU all have it)."""
    if config.optimizer == "adam":
        return torch.optim.AdamW(param_groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                 eps=config.adam_eps, fused=True)
    if config.optimizer == "sgd":
        return torch.optim.SGD(param_groups, lr=config.lr, momentum=config.sgd_momentum)
    raise ValueError(f"`optimizer` must be adam or sgd, got {config.optimizer!r}")


def build_grad_scaler(config: OptimizerConfig):
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale,
                                 growth_interval=config.loss_scale_window, hysteresis=config.hysteresis)
    return None


class MixedPrecisionOptimizer:
    def __init__(self, config: OptimizerConfig, params: list, groups: ParallelGroups):
        self.config = config
        self.groups = groups
        self.model_params = list(params)
        self.master_params = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_()
                              for p in self.model_params]
        for master, param in zip(self.master_params, self.model_params):
            if master is not param:
                master.tp_layout = param.tp_layout
        self.optimizer = build_inner_optimizer(config, param_groups(config, list(zip(self.model_params,
                                                                                    self.master_params))))
        self.grad_scaler = build_grad_scaler(config)
        self.num_applied_steps = 0

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    def loss_scale(self) -> float:
        return 1.0 if self.grad_scaler is None else self.grad_scaler.scale.item()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss x the fp16 loss scale. The scale moves to the loss's device once and stays there
        (the dynamic scaler's updates keep it there), so no micro-batch copies it."""
        if self.grad_scaler is None:
            return loss
        if self.grad_scaler.scale.device != loss.device:
            self.grad_scaler.scale = self.grad_scaler.scale.to(loss.device)
        return loss * self.grad_scaler.scale

    def grads(self) -> list:
        return [p.main_grad for p in self.model_params]

    # Replicated state: each rank's share of the norm is its model replica's, so experts (held by
    # other ranks of the expert-parallel group) are summed apart (`_reduced_square`).
    split_expert_norm = True

    def found_inf_groups(self) -> list:
        """Groups over which inf/NaN detection must agree (all ranks of one model replica; with expert
        parallelism every rank, since a replica's experts are spread over data ranks)."""
        return [self.groups.mp] if self.groups.ep_size == 1 else [self.groups.world]

    def norm_groups(self) -> list:
        return [self.groups.mp]

    @torch.no_grad()
    def step(self, guard=None) -> tuple[bool, Optional[float]]:
        """Returns (update applied, gradient norm before clipping). `guard` (optional; see
        `megatron.training.reliability.guards.StepGuard`) may veto the update: it gets this rank's share of the
        squared norm, returns device values of its own, and they are read to the host in the same
        transfer as the norm, so a guard adds no synchronization."""
        grads = self.grads()
        if self.grad_scaler is not None:
            torch._foreach_mul_(grads, 1.0 / self.grad_scaler.scale.item())
            found_inf = self._found_inf(grads)
            self.grad_scaler.update(found_inf)
            if found_inf:
                if guard is not None:
                    guard.allow(None, guard.flags(None).tolist())
                return False, None
        local_square = self._local_grad_square(grads).reshape(1)
        extra = guard.flags(local_square) if guard is not None else None
        square = self._reduced_square(grads, local_square)
        values = (square if extra is None else torch.cat([square, extra.to(square.device)])).tolist()
        grad_norm = math.sqrt(values[0])  # the step's one read to the host
        if guard is not None and not guard.allow(grad_norm, values[1:]):
            return False, grad_norm
        if not math.isfinite(grad_norm):
            return False, grad_norm
        coefficient = clip_coefficient(grad_norm, self.config.clip_grad)
        if coefficient < 1.0 and not self._fused_update():
            clip_grads(grads, grad_norm, self.config.clip_grad)
        elif coefficient < 1.0:  # the fused kernel divides the gradients by its grad_scale
            self.optimizer.grad_scale = torch.full((), 1.0 / coefficient, device=self.groups.device)
        try:
            self._apply_update(grads)
        finally:
            self.optimizer.grad_scale = None
        self.num_applied_steps += 1
        return True, grad_norm

    def _fused_update(self) -> bool:
        return all(group.get("fused") for group in self.optimizer.param_groups)

    def _apply_update(self, grads: list) -> None:
        """The inner optimizer's step on the masters with these (clipped) gradients, then the
        masters copied into the model."""
        for master, grad in zip(self.master_params, grads):
            master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)
        self.optimizer.step()
        for master in self.master_params:
            master.grad = None
        self._copy_masters_to_model()

    def _local_grad_square(self, grads: list) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (summed over `norm_groups`)."""
        return local_square_norm(self.model_params, grads, self.groups.device)

    def _grad_norm(self, grads: list) -> float:
        """The global norm of `grads` (one tensor per stepped parameter), summed over `norm_groups`."""
        return math.sqrt(self._reduced_square(grads, self._local_grad_square(grads).reshape(1)).item())

    def _reduced_square(self, grads: list, local_square: torch.Tensor) -> torch.Tensor:
        """The squared global norm from this rank's share: summed over `norm_groups`. Routed-expert
        weights differ over the expert-parallel ranks, which a model replica's group (tp x pp) need
        not span: their share is summed over the expert model-parallel group (etp x ep x pp)."""
        experts = [index for index, param in enumerate(self.model_params) if hasattr(param, "expert_offset")]
        if not experts or not self.split_expert_norm:
            square = local_square.clone()
            for group in self.norm_groups():
                comm.all_reduce(square, group)
            return square
        is_expert = set(experts)
        dense = [i for i in range(len(self.model_params)) if i not in is_expert]
        pick = lambda indices, values: [values[i] for i in indices]  # noqa: E731
        square = local_square_norm(pick(dense, self.model_params), pick(dense, grads), self.groups.device).reshape(1)
        expert_square = local_square_norm(pick(experts, self.model_params), pick(experts, grads),
                                          self.groups.device).reshape(1)
        for group in self.norm_groups():
            comm.all_reduce(square, group)
        comm.all_reduce(expert_square, self.groups.expert_mp)
        return square + expert_square

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        """Multiplies the gradients this rank steps by `factor` (before the next `step`)."""
        torch._foreach_mul_(self.grads(), factor)

    @torch.no_grad()
    def params_norm(self) -> float:
        """L2 norm of the fp32 master weights of the whole model (each logical element once)."""
        return self._grad_norm([master.detach().view_as(grad) for master, grad in zip(self.master_params, self.grads())])

    @torch.no_grad()
    def count_zeros(self) -> int:
        """Gradient elements equal to zero over the whole model (each logical element once)."""
        return round(self._grad_norm([(grad == 0).float() for grad in self.grads()]) ** 2)

    def _found_inf(self, grads: list) -> bool:
        device = grads[0].device if grads else self.groups.device
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        if grads:
            norms = torch._foreach_norm(grads)
            flag += (~torch.isfinite(torch.stack(norms))).any().float()
        for group in self.found_inf_groups():
            comm.all_reduce_max(flag, group)
        return bool(flag.item() > 0)

    def _copy_masters_to_model(self) -> None:
        pairs = [(p, m) for p, m in zip(self.model_params, self.master_params) if m is not p]
        if pairs:
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    def stepped_elements(self) -> tuple[int, int]:
        """(elements this rank's optimizer steps, of which held in fp32 master copies apart from
        the model's parameters): the basis of the theoretical optimizer-state memory."""
        copies = sum(m.numel() for m, p in zip(self.master_params, self.model_params) if m is not p)
        return sum(m.numel() for m in self.master_params), copies

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: fp32 master copies (those that are not the model's
        own parameters) and the inner optimizer's per-parameter state (Adam moments)."""
        return _optimizer_state_bytes(self.optimizer, [m for m, p in zip(self.master_params, self.model_params)
                                                       if m is not p])

    # -- checkpointing ------------------------------------------------------------------------
    def state_regions(self) -> list:
        """(model param, flat start, flat end, master) for every master this rank steps: here the
        whole (tensor-parallel local) parameter."""
        return [(p, 0, p.numel(), m) for p, m in zip(self.model_params, self.master_params)]

    def separate_masters(self) -> bool:
        """Whether the fp32 masters are copies apart from the model's (bf16/fp16) weights."""
        return any(m is not p for p, m in zip(self.model_params, self.master_params))

    def moment_keys(self) -> tuple:
        """The inner optimizer's per-element state tensors."""
        if self.config.optimizer == "adam":
            return ("exp_avg", "exp_avg_sq")
        return ("momentum_buffer",) if self.config.sgd_momentum else ()

    def prepare_state_for_load(self, num_applied_steps: int) -> None:
        """Creates the inner optimizer's state (as its first step would) so that a checkpoint can be
        loaded into it in place, and sets the step count."""
        self.num_applied_steps = num_applied_steps
        scalar_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        on_device = any(g.get("fused") or g.get("capturable") for g in self.optimizer.param_groups)
        for _, _, _, master in self.state_regions():
            slot = self.optimizer.state[master]
            for key in self.moment_keys():
                slot[key] = torch.zeros_like(master, memory_format=torch.preserve_format)
            if self.config.optimizer == "adam":
                slot["step"] = torch.tensor(float(num_applied_steps), dtype=scalar_dtype,
                                            device=master.device if on_device else "cpu")

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Masters from the model's weights (after loading weights only)."""
        for param, master in zip(self.model_params, self.master_params):
            if master is not param:
                master.copy_(param)

    @torch.no_grad()
    def copy_masters_to_model(self) -> None:
        """The model's weights from the masters (after loading masters)."""
        self._copy_masters_to_model()

    def scaler_state(self) -> dict:
        """The loss scaler's state as plain numbers (empty without fp16 scaling)."""
        if self.grad_scaler is None:
            return {}
        return {key: (value.item() if torch.is_tensor(value) else value)
                for key, value in self.grad_scaler.state_dict().items()}

    def load_scaler_state(self, state: dict) -> None:
        if self.grad_scaler is None or not state:
            return
        self.grad_scaler.load_state_dict({key: torch.tensor([value], dtype=torch.float32) if key == "scale" else value
                                          for key, value in state.items()})


def _optimizer_state_bytes(inner: torch.optim.Optimizer, extra_masters: list) -> int:
    total = sum(m.numel() * m.element_size() for m in extra_masters)
    for state in inner.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim() > 0:
                total += value.numel() * value.element_size()
    return total
