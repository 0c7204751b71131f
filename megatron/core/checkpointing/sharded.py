"""What one rank holds of each logical tensor, as boxes of the full tensor.

A checkpoint stores the *logical* tensors of the unsharded model (see `tensor_parallel.layers`:
a fused QKV weight is the three tensors q, k and v, a SwiGLU fc1 is gate and up, each at its full
shape). A rank holds pieces of them:

- a tensor-parallel rank holds a slice of each part of its parameter (`TPLayout`);
- the distributed optimizer holds a flat range [start, end) of the rank's parameter, in bucket order;
- FSDP2 holds a range of dim-0 rows of it.

All three come down to a flat range of the rank's (TP-local) parameter tensor. `logical_boxes`
cuts such a range into rectangular boxes of the logical tensors: a flat range of a row-major
[R, C] tensor is at most a partial first row, a run of whole rows and a partial last row, and
whole-row runs are split further where they cross from one fused part into the next. Each box is
a contiguous slice of the flat range, so saving and loading need no copies.

`ShardedState` collects, per checkpoint key, the boxes a rank holds (`Boxes`). Ranks holding the
same data (replicas over data-parallel ranks, key/value heads replicated over tensor-parallel
ranks, the tied embedding on the first and last pipeline stage) describe it with identical boxes,
which the storage layer writes once.
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass(frozen=True)
class Box:
    """A rectangular piece of a logical tensor: `offsets`/`sizes` in the full tensor, and the
    range [flat_start, flat_end) of the rank's flat tensor that holds it (row-major)."""

    part: str
    offsets: tuple
    sizes: tuple
    flat_start: int
    flat_end: int


def _row_runs(shape: tuple, start: int, end: int) -> list:
    """Row-major boxes of [start, end) in the rank's tensor: (row, col, rows, cols, flat_start)."""
    if len(shape) == 1:
        return [(start, 0, end - start, 1, start)] if end > start else []
    if len(shape) != 2:
        raise ValueError(f"checkpoint boxes support 1-D and 2-D parameters, got shape {tuple(shape)}")
    cols = shape[1]
    runs = []
    first_row, first_col = divmod(start, cols)
    last_row, last_col = divmod(end, cols)
    if first_row == last_row:
        if last_col > first_col:
            runs.append((first_row, first_col, 1, last_col - first_col, start))
        return runs
    if first_col:
        runs.append((first_row, first_col, 1, cols - first_col, start))
        first_row += 1
    if last_row > first_row:
        runs.append((first_row, 0, last_row - first_row, cols, first_row * cols))
    if last_col:
        runs.append((last_row, 0, 1, last_col, last_row * cols))
    return runs


def logical_boxes(param, start: int, end: int) -> list:
    """Boxes of the logical tensors covered by elements [start, end) of `param` (flattened).

    `param.tp_layout` says how the rank's tensor is cut from the logical parts; `param.shape` is
    the rank's (tensor-parallel local) shape, also for an FSDP2 DTensor parameter."""
    layout = param.tp_layout
    shape = tuple(param.shape)
    boxes = []
    for row, col, rows, cols, flat in _row_runs(shape, start, end):
        width = cols if len(shape) == 2 else 1
        if layout.dim == 1:  # split along columns (row-parallel weight): one part, columns shift
            (part,) = layout.parts
            column_start, _ = layout.local_range(part)
            boxes.append(Box(part.name, (row, column_start + col), (rows, cols), flat, flat + rows * width))
            continue
        for part, offset, length in layout.local_offsets():  # split along rows, parts stacked
            lo, hi = max(row, offset), min(row + rows, offset + length)
            if lo >= hi:
                continue
            row_start, _ = layout.local_range(part)
            logical_row = row_start + lo - offset
            first = flat + (lo - row) * width
            if len(shape) == 1:
                boxes.append(Box(part.name, (logical_row,), (hi - lo,), first, first + hi - lo))
            else:
                boxes.append(Box(part.name, (logical_row, col), (hi - lo, cols), first, first + (hi - lo) * cols))
    return boxes


def logical_shape(param, part_name: str) -> tuple:
    """Full shape of one logical part of `param`."""
    layout = param.tp_layout
    part = next(p for p in layout.parts if p.name == part_name)
    shape = list(param.shape)
    shape[layout.dim] = part.full_size
    return tuple(shape)


def tensor_key(prefix: str, global_name: str, part: str) -> str:
    """Checkpoint key of one logical tensor: 'model/<global name>' or 'model/<name>/<part>'."""
    return f"{prefix}/{global_name}/{part}" if part else f"{prefix}/{global_name}"


def split_tensor_key(key: str, prefix: str) -> tuple:
    """(global name, part) of a key made by `tensor_key(prefix, ...)` (names and parts never
    contain '/')."""
    if not key.startswith(prefix + "/"):
        raise ValueError(f"{key!r} is not under {prefix!r}")
    name, _, part = key[len(prefix) + 1:].partition("/")
    return name, part


@dataclass(frozen=True)
class _ExpertView:
    """One expert's tensor of a stacked expert parameter, as `logical_boxes` reads a parameter."""

    shape: tuple
    tp_layout: object


@dataclass
class Boxes:
    """The boxes this rank holds of one logical tensor, each with its local data (a view)."""

    size: tuple
    dtype: torch.dtype
    pieces: list = field(default_factory=list)  # [(offsets, tensor shaped like the box)]

    def add(self, offsets: tuple, tensor: torch.Tensor) -> None:
        self.pieces.append((tuple(offsets), tensor))


class ShardedState:
    """{checkpoint key: Boxes} for tensors cut from logical tensors, plus whole tensors held by
    every rank alike (`replicated`) or by this rank alone (`per_rank`, keyed uniquely)."""

    def __init__(self):
        self.sharded: dict = {}
        self.whole: dict = {}

    def add_range(self, prefix: str, global_name: str, param, start: int, end: int, flat: torch.Tensor,
                  *, dtype: Optional[torch.dtype] = None) -> None:
        """Adds elements [start, end) of `param` whose data is the 1-D `flat` (flat[0] is element
        `start`) under the keys of their logical tensors."""
        if flat.numel() != end - start:
            raise ValueError(f"{global_name}: {flat.numel()} elements given for the range [{start}, {end})")
        if hasattr(param, "expert_offset"):
            self._add_expert_range(prefix, global_name, param, start, end, flat, dtype)
            return
        for box in logical_boxes(param, start, end):
            key = tensor_key(prefix, global_name, box.part)
            entry = self.sharded.get(key)
            if entry is None:
                entry = self.sharded[key] = Boxes(logical_shape(param, box.part), dtype or flat.dtype)
            view = flat[box.flat_start - start:box.flat_end - start].view(box.sizes)
            entry.add(box.offsets, view)

    def _add_expert_range(self, prefix, global_name, param, start, end, flat, dtype) -> None:
        """A stacked routed-expert parameter [E_local, ...]: each local expert's piece is stored under
        its global expert index (`experts.expert_param_names`), so a checkpoint loads at any
        expert-parallel size."""
        from megatron.core.transformer.moe.experts import expert_param_names

        one = _ExpertView(tuple(param.shape[1:]), dataclasses.replace(param.tp_layout, dim=param.tp_layout.dim - 1))
        per_expert = param[0].numel()
        for index, name in enumerate(expert_param_names(global_name, param)):
            lo, hi = max(start, index * per_expert), min(end, (index + 1) * per_expert)
            if lo < hi:
                base = index * per_expert
                self.add_range(prefix, name, one, lo - base, hi - base, flat[lo - start:hi - start], dtype=dtype)

    def add_whole(self, key: str, tensor: torch.Tensor) -> None:
        self.whole[key] = tensor
