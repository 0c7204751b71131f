"""Target GPUs and clusters: memory, peak FLOP/s, HBM and interconnect bandwidth, and the tables of
achieved throughput the step-time model reads.

Peak figures are the vendors' dense datasheet numbers (no sparsity). Achieved GEMM and attention
throughput come from a table per GPU: H100's is built from the ceilings measured on an H100 SXM
at the benchmark shapes (bf16 GEMMs 545-715 TFLOP/s, FP8 GEMMs 740-1280, SDPA flash attention
forward+backward 340-410, docs/planning.md); other GPUs use the same fractions of their own peak
until `bench/bench_plan_table.py` measures theirs (`tools/plan.py --throughput-table FILE`).
Bandwidths are per GPU and per direction, as a collective's bus bandwidth sees them.
"""
import json
import math
from dataclasses import dataclass, field
from typing import Optional

GB = 1e9
TERA = 1e12


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float          # what the framework can allocate (the device's total memory)
    bf16_flops: float            # dense peak
    fp8_flops: float             # dense peak, 0 when the GPU has no FP8 tensor cores
    hbm_bandwidth: float         # bytes/s
    intra_node_bandwidth: float  # bytes/s per GPU per direction (NVLink / Infinity Fabric)
    inter_node_bandwidth: float  # bytes/s per GPU per direction (InfiniBand / RoCE NIC)
    gpus_per_node: int = 8
    grouped_gemm: bool = True    # torch._grouped_mm in bf16 (compute capability 9.0+): the experts' grouped path


# name -> GPU. Memory: the device's total as PyTorch reports it (MiB from nvidia-smi / rocm-smi).
PRESETS = {
    "h100-80gb": GPU("H100 SXM 80GB", 81559 * 2 ** 20, 989 * TERA, 1979 * TERA, 3.35e12, 450 * GB, 50 * GB),
    "h200": GPU("H200 SXM 141GB", 143771 * 2 ** 20, 989 * TERA, 1979 * TERA, 4.8e12, 450 * GB, 50 * GB),
    "a100-80gb": GPU("A100 SXM 80GB", 81920 * 2 ** 20, 312 * TERA, 0.0, 2.039e12, 300 * GB, 25 * GB,
                     grouped_gemm=False),
    "mi300x": GPU("MI300X 192GB", 196592 * 2 ** 20, 1307 * TERA, 2615 * TERA, 5.3e12, 448 * GB, 50 * GB),
}

# Achieved throughput as a fraction of peak against the work of one GEMM (FLOPs), measured on the
# H100 at the benchmark shapes: the smallest GEMM of llama3.2-1b (about 6.9e10 FLOPs) ran at
# 545 TFLOP/s, the largest of llama3-8b (about 9.6e11) at 715; FP8 740-1280 of 1979.
H100_TABLE = {
    "bf16_gemm": [(6.9e10, 545 / 989), (9.6e11, 715 / 989)],
    "fp8_gemm": [(6.9e10, 740 / 1979), (9.6e11, 1280 / 1979)],
    "attention": [(1.0e11, 340 / 989), (1.0e12, 410 / 989)],  # causal flash fwd+bwd (3x the forward's FLOPs)
    "hbm_efficiency": 0.7,   # elementwise kernels reach this fraction of the HBM bandwidth
    "link_efficiency": 0.8,  # collectives reach this fraction of the link bandwidth
    "launch_seconds": 5e-6,  # the fixed cost of one kernel
}


def _interpolate(points: list, work: float) -> float:
    """Piecewise linear in log(work), flat beyond the ends; below the smallest point the fraction
    falls in proportion to the work (small GEMMs cannot fill the GPU)."""
    (w0, f0), (w1, f1) = points[0], points[-1]
    if work <= w0:
        return f0 * max(0.05, work / w0) ** 0.5
    if work >= w1:
        return f1
    for (a, fa), (b, fb) in zip(points, points[1:]):
        if a <= work <= b:
            return fa + (fb - fa) * (math.log(work) - math.log(a)) / (math.log(b) - math.log(a))
    return f1


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    nodes: int
    gpus_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    table: dict = field(default_factory=lambda: dict(H100_TABLE))

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def gemm_seconds(self, flops: float, fp8: bool = False) -> float:
        peak = self.gpu.fp8_flops if fp8 and self.gpu.fp8_flops else self.gpu.bf16_flops
        fraction = _interpolate(self.table["fp8_gemm" if fp8 and self.gpu.fp8_flops else "bf16_gemm"], flops)
        return flops / (peak * fraction) + self.table["launch_seconds"]

    def attention_seconds(self, flops: float) -> float:
        """Seconds of causal attention forward+backward doing `flops` (3x its forward)."""
        return flops / (self.gpu.bf16_flops * _interpolate(self.table["attention"], flops / 3))

    def memory_seconds(self, nbytes: float, kernels: int = 1) -> float:
        return nbytes / (self.gpu.hbm_bandwidth * self.table["hbm_efficiency"]) + kernels * self.table["launch_seconds"]

    def link_bandwidth(self, span: int) -> float:
        """Bus bandwidth of a collective over `span` consecutive GPUs (inside a node or across)."""
        bandwidth = self.intra_node_bandwidth if span <= self.gpus_per_node else self.inter_node_bandwidth
        return bandwidth * self.table["link_efficiency"]


def cluster(gpu: str = "h100-80gb", *, nodes: int = 1, gpus_per_node: Optional[int] = None,
            intra_node_bandwidth: Optional[float] = None, inter_node_bandwidth: Optional[float] = None,
            table_file: Optional[str] = None) -> Cluster:
    """A cluster of `nodes` nodes of a preset GPU, bandwidths in bytes/s overriding the preset's."""
    if gpu not in PRESETS:
        raise ValueError(f"unknown GPU {gpu!r}: choose one of {', '.join(PRESETS)}")
    preset = PRESETS[gpu]
    table = dict(H100_TABLE)
    if table_file:
        table.update(load_table(table_file))
    return Cluster(gpu=preset, nodes=nodes, gpus_per_node=gpus_per_node or preset.gpus_per_node,
                   intra_node_bandwidth=intra_node_bandwidth or preset.intra_node_bandwidth,
                   inter_node_bandwidth=inter_node_bandwidth or preset.inter_node_bandwidth, table=table)


def load_table(path: str) -> dict:
    """A throughput table written by bench/bench_plan_table.py (JSON: fractions of the GPU's peak)."""
    with open(path) as handle:
        data = json.load(handle)
    table = {}
    for key in ("bf16_gemm", "fp8_gemm", "attention"):
        if key in data:
            table[key] = sorted((float(work), float(fraction)) for work, fraction in data[key])
    for key in ("hbm_efficiency", "link_efficiency", "launch_seconds"):
        if key in data:
            table[key] = float(data[key])
    if not table:
        raise ValueError(f"{path}: no throughput table in it (write one with bench/bench_plan_table.py)")
    return table
