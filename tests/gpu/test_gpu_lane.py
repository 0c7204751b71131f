"""The GPU lane (`pytest -m gpu`, run by bench/gpu_check.sh): what only a GPU can show.

Compiled fusions against eager on CUDA, the fused linear and loss against the reference, FP8 GEMMs
against bf16 (and the FP8 linear keeping its compiled cast input), clipping folded into the fused
AdamW, the attention backends and their start-up probe, context parallelism's block kernels,
document masks with compiled FlexAttention, the GPU-only bug fixes (device with gloo, CPU seeding, loss scale on the device),
and bf16/fp16 training steps of pretrain_gpt.py with NCCL at world size 1. Skipped without a GPU.
Every test with a CUDA-only path lives under tests/gpu, which is what the lane runs
(tests/unit/test_gpu_lane_collection.py checks it).
"""
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda")


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    generator = torch.Generator(device=CUDA).manual_seed(seed)
    return (torch.randn(*shape, generator=generator, device=CUDA) * scale).to(dtype)


def test_compiled_fusions_match_eager_on_cuda():
    from megatron.core.transformer import fusions
    from tests.unit.test_fusions import _compare

    x = randn(64, 2, 8, 128, seed=0, dtype=torch.bfloat16)
    angles = randn(64, 2, 1, 64, seed=1)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    weight = randn(128, seed=2, dtype=torch.bfloat16)
    _compare(lambda a, w: fusions.rms_norm(a, w, 1e-5), [x, weight], 2e-2)
    _compare(fusions.swiglu, [x], 2e-2)
    _compare(fusions.rotary, [x, cos, sin], 2e-2)


def test_mixed_precision_wgrad_accumulates_in_one_gemm():
    from megatron.core.tensor_parallel.layers import _mixed_dtype_addmm_works, accumulate_matmul_

    assert _mixed_dtype_addmm_works(CUDA), "torch.addmm(out_dtype=fp32) is missing: the fusion falls back"
    a, b = randn(256, 512, seed=1, dtype=torch.bfloat16), randn(512, 128, seed=2, dtype=torch.bfloat16)
    out = randn(256, 128, seed=3)
    want = out + a.float() @ b.float()
    accumulate_matmul_(out, a, b)
    torch.testing.assert_close(out, want, rtol=1e-3, atol=1e-3)


def test_fused_linear_matches_plain_path_on_cuda():
    """On CUDA the fused path runs each weight-gradient GEMM as one bf16 GEMM accumulating in fp32
    straight into main_grad, so its reference is the fp32 product of the same bf16 operands, summed
    over micro-batches. (Summing autograd's bf16 `p.grad` instead rounds each micro-batch's product
    to bf16 first: products reach 30-110 here, where a bf16 ulp is 0.125-0.5, while sums that cancel
    to 5-30 get only 0.02 + 0.02 * |sum| of room, so a few of 512 elements fail by 0.1-0.3.)"""
    from megatron.core.distributed.ddp import DistributedDataParallel
    from megatron.core.parallel_state import single_process
    from tests.unit.test_fused_linear_and_loss import TwoLinears, full_weights

    model = TwoLinears(torch.bfloat16, fusion=True).to(CUDA)
    ddp = DistributedDataParallel(model, single_process(CUDA))
    ddp.zero_grad_buffer()
    w1, b1, w2 = (full_weights(torch.bfloat16)[name].to(CUDA) for name in ("w1", "b1", "w2"))
    main = {"w1": torch.zeros(w1.shape, device=CUDA), "b1": torch.zeros(b1.shape, device=CUDA),
            "w2": torch.zeros(w2.shape, device=CUDA)}
    for step in range(3):
        x = randn(64, 4, 16, seed=10 + step, dtype=torch.bfloat16)
        g = randn(64, 4, 16, seed=20 + step, dtype=torch.bfloat16)
        ddp(x).backward(g)
        h = F.linear(x, w1, b1).requires_grad_()  # [64, 4, 32]
        a = F.gelu(h)
        dh, = torch.autograd.grad(F.linear(a, w2), h, g)
        main["w1"] += dh.reshape(-1, 32).float().t() @ x.reshape(-1, 16).float()
        main["w2"] += g.reshape(-1, 16).float().t() @ a.reshape(-1, 32).float()
        main["b1"] += dh.sum((0, 1)).float()  # the bias gradient is a bf16 sum on both paths
    for name, param in (("w1", model.fc1.weight), ("b1", model.fc1.bias), ("w2", model.fc2.weight)):
        torch.testing.assert_close(param.main_grad, main[name], rtol=2e-2, atol=2e-2)


def test_fused_cross_entropy_matches_and_saves_memory_on_cuda():
    from megatron.core.tensor_parallel.cross_entropy import (
        fused_vocab_parallel_cross_entropy,
        vocab_parallel_cross_entropy,
    )

    tokens, vocab = 4096, 128256
    target = torch.randint(0, vocab, (tokens, 1), device=CUDA)
    peaks, results = {}, {}
    for name, function in (("plain", vocab_parallel_cross_entropy), ("fused", fused_vocab_parallel_cross_entropy)):
        logits = randn(tokens, 1, vocab, seed=1, dtype=torch.bfloat16, scale=3.0).requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        kwargs = {"compiled": True} if name == "fused" else {}
        loss = function(logits * 1, target, None, **kwargs)
        loss.sum().backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        results[name] = (loss.detach(), logits.grad)
    print(f"cross entropy peak above inputs, 4096 x 128256 bf16: plain {peaks['plain'] / 2**30:.2f} GiB, "
          f"fused {peaks['fused'] / 2**30:.2f} GiB")
    torch.testing.assert_close(results["fused"][0], results["plain"][0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(results["fused"][1].float(), results["plain"][1].float(), rtol=2e-2, atol=1e-4)
    assert peaks["fused"] < peaks["plain"] / 2


@pytest.mark.parametrize("fp8_format, recipe", [("e4m3", "tensorwise"), ("hybrid", "tensorwise"),
                                                ("hybrid", "delayed"), ("e4m3", "rowwise")])
def test_fp8_gemms_match_bf16_on_cuda(fp8_format, recipe):
    from megatron.core.transformer.fp8 import DelayedScaling, FP8Linear, FP8Options
    from tests.unit.test_fp8 import UNIT_ROUNDOFF

    options = FP8Options(fp8_format, recipe)
    scaling = DelayedScaling(options) if recipe == "delayed" else None
    linear = FP8Linear(options, scaling, compiled=True)
    if scaling is not None:
        scaling.allocate(CUDA)
        linear.bind()
    x = randn(4, 512, 1024, seed=1, dtype=torch.bfloat16)
    weight = randn(2048, 1024, seed=2, dtype=torch.bfloat16, scale=0.02)
    grad = randn(4, 512, 2048, seed=3, dtype=torch.bfloat16, scale=1e-3)
    forward_u, grad_u = UNIT_ROUNDOFF[linear.forward_dtype], UNIT_ROUNDOFF[linear.grad_dtype]
    for _ in range(2):
        if scaling is not None:
            scaling.roll()
        for got, want, bound in (
                (linear.forward(x, weight), x.float() @ weight.float().t(), math.hypot(forward_u, forward_u)),
                (linear.dgrad(grad, weight), grad.float() @ weight.float(), math.hypot(grad_u, forward_u)),
                (linear.wgrad(grad.reshape(-1, 2048), x.reshape(-1, 1024)),
                 grad.reshape(-1, 2048).float().t() @ x.reshape(-1, 1024).float(), math.hypot(grad_u, forward_u))):
            error = ((got.float() - want).norm() / want.norm()).item()
            assert error <= bound, (fp8_format, recipe, error)


def test_fp8_blockwise_gemms_on_cuda():
    """--fp8-recipe blockwise on a Hopper GPU: the start-up check of PyTorch's block-scaled GEMM
    passes, and the three GEMMs of an FP8 linear equal the products of the block-dequantized
    operands (fp32 sums) and bf16's within E4M3's bound."""
    from megatron.core.transformer.fp8 import (BLOCK, FP8Linear, FP8Options, blockwise_unavailable,
                                               dequantize_blocks, quantize_blocks)
    from tests.unit.test_fp8 import UNIT_ROUNDOFF

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("block-scaled FP8 GEMMs run on Hopper (compute capability 9.0) only")
    assert blockwise_unavailable(CUDA) is None
    linear = FP8Linear(FP8Options("e4m3", "blockwise"), None)
    x = randn(2, 512, 1024, seed=1, dtype=torch.bfloat16)
    weight = randn(2048, 1024, seed=2, dtype=torch.bfloat16, scale=0.02)
    grad = randn(2, 512, 2048, seed=3, dtype=torch.bfloat16, scale=1e-3)
    x2d, g2d = x.reshape(-1, 1024), grad.reshape(-1, 2048)

    def blocks(t, rows):
        return dequantize_blocks(*quantize_blocks(t, rows, torch.float8_e4m3fn), rows)

    w_blocks = blocks(weight, BLOCK)
    bound = math.hypot(UNIT_ROUNDOFF[torch.float8_e4m3fn], UNIT_ROUNDOFF[torch.float8_e4m3fn])
    for got, exact, want in (
            (linear.forward(x, weight).reshape(-1, 2048), blocks(x2d, 1) @ w_blocks.t(), x2d.float() @ weight.float().t()),
            (linear.dgrad(grad, weight).reshape(-1, 1024), blocks(g2d, 1) @ w_blocks, g2d.float() @ weight.float()),
            (linear.wgrad(g2d, x2d), blocks(g2d.t().contiguous(), 1) @ blocks(x2d.t().contiguous(), 1).t(),
             g2d.float().t() @ x2d.float())):
        torch.testing.assert_close(got.float(), exact.to(got.dtype).float(), rtol=2e-2, atol=1e-3 * exact.abs().max().item())
        assert ((got.float() - want).norm() / want.norm()).item() <= bound


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_linear_keeps_its_compiled_cast_input_on_cuda(recipe):
    """The compiled cast (amax, cast and transpose in one function) on CUDA: the weight gradient
    from the FP8 transpose the forward kept equals the one from casting the bf16 input again, and
    the FP8 casts of the step equal the eager ones."""
    from megatron.core.parallel_state import TensorParallel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.fp8 import DelayedScaling, FP8Linear, FP8Options, cast_to_fp8, compiled_cast_to_fp8

    options = FP8Options("hybrid", recipe)
    scaling = DelayedScaling(options) if recipe == "delayed" else None
    linear = ColumnParallelLinear(1024, 2048, bias=False, tp=TensorParallel(),
                                  params_dtype=torch.bfloat16, device=CUDA, gradient_accumulation_fusion=False)
    linear.fp8 = FP8Linear(options, scaling, compiled=True)
    if scaling is not None:
        scaling.allocate(CUDA)
        linear.fp8.bind()
    x = randn(4, 512, 1024, seed=1, dtype=torch.bfloat16).requires_grad_()
    grad = randn(4, 512, 2048, seed=3, dtype=torch.bfloat16, scale=1e-3)
    linear(x).backward(grad)
    recast = linear.fp8.wgrad(grad.reshape(-1, 2048), x.detach().reshape(-1, 1024))
    assert torch.equal(linear.weight.grad, recast)
    x2d = x.detach().reshape(-1, 1024)
    for got, want in zip(compiled_cast_to_fp8()(x2d, None, torch.float8_e4m3fn, 0, True),
                         cast_to_fp8(x2d, None, torch.float8_e4m3fn, 0, True)):
        assert torch.equal(got.float(), want.float())


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_compiled_fp8_cast_reads_of_the_bf16_input_on_cuda(recipe):
    """Prints how many generated Triton kernels read the bf16 input of one compiled cast (on the
    CPU, tests/unit/test_fp8_one_pass.py counts 1 loop for delayed, 2 for current scaling), and
    checks the compiled cast against the eager one."""
    from megatron.core.transformer.fp8 import cast_to_fp8, compiled_cast_to_fp8
    from tests.unit.work_counting import generated_code

    torch._dynamo.reset()
    x = randn(4096, 4096, seed=1, dtype=torch.bfloat16)
    scale = torch.full((), 3.0, device=CUDA) if recipe == "delayed" else None
    code = generated_code(compiled_cast_to_fp8(), x, scale, torch.float8_e4m3fn, 0, True)
    matrix = re.search(r"assert_size_stride\((arg\d+_1), \(s\d+, s\d+\)", code)  # the bf16 input's name
    launches = [line.strip()[:60] for line in code.splitlines()
                if matrix and ".run(" in line and re.search(rf"\b{matrix.group(1)}\b", line)]
    print(f"FP8 cast, {recipe}: {len(launches)} kernel(s) read the bf16 input: {launches}"
          if matrix else f"FP8 cast, {recipe}: the input was not found in the generated code:\n{code}")
    for got, want in zip(compiled_cast_to_fp8()(x, scale, torch.float8_e4m3fn, 0, True),
                         cast_to_fp8(x, scale, torch.float8_e4m3fn, 0, True)):
        assert torch.equal(got.float(), want.float())


def test_clipping_folded_into_fused_adamw_on_cuda():
    """The fused CUDA AdamW divides the gradients by its grad_scale: the same update as clipping first."""
    params = [randn(256, 128, seed=i).requires_grad_() for i in range(2)]
    copies = [p.detach().clone().requires_grad_() for p in params]
    grads = [randn(256, 128, seed=10 + i) for i in range(2)]
    folded = torch.optim.AdamW(params, lr=1e-2, fused=True)
    plain = torch.optim.AdamW(copies, lr=1e-2, fused=True)
    for p, c, g in zip(params, copies, grads):
        p.grad, c.grad = g.clone(), g * 0.25
    folded.grad_scale = torch.full((), 4.0, device=CUDA)
    folded.step()
    plain.step()
    for p, c in zip(params, copies):
        torch.testing.assert_close(p, c, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(params[0].grad, grads[0] * 0.25)  # the kernel writes the clipped gradient back


def test_attention_backends_and_probe_on_cuda():
    from megatron.core.transformer.attention import resolve_attention_backend
    from tests.unit.test_attention_backends import core

    q = randn(2, 32, 1024, 128, seed=1, dtype=torch.bfloat16)
    k, v = randn(2, 8, 1024, 128, seed=2, dtype=torch.bfloat16), randn(2, 8, 1024, 128, seed=3, dtype=torch.bfloat16)
    reference = core("math")(q, k, v)
    for backend in ("flash", "fused", "cudnn", "efficient", "unfused", "auto"):
        out = core(backend)(q, k, v)
        torch.testing.assert_close(out.float(), reference.float(), rtol=2e-2, atol=2e-2, msg=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the probe says why a kernel cannot run in its line, not as warnings
        backend, line = resolve_attention_backend("auto", batch=1, heads=32, groups=8, seq=4096, head_dim=128,
                                                  dtype=torch.bfloat16, device=CUDA)
        chosen = core(backend)
        torch.testing.assert_close(chosen(q, k, v).float(), reference.float(), rtol=2e-2, atol=2e-2)
    print(line)
    assert backend in ("cudnn", "flash", "efficient", "flash_attn") and "median of 5 after 2 warm-up calls" in line


def test_context_parallel_block_kernels_match_the_cpu_kernel():
    """Each GPU block kernel of ring attention returns the CPU flash kernel's output, log-sum-exp
    and gradients (the CPU twin: tests/distributed/test_context_parallel.py runs CPU_FLASH)."""
    from megatron.core.context_parallel import kernels

    names = [kernels.FLASH, kernels.EFFICIENT] + ([kernels.FLASH_ATTN] if kernels.flash_attn_package_usable() else [])
    generator = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, h, 256, 64, generator=generator) for h in (8, 2, 2, 8))
    for causal in (True, False):
        want_out, want_lse, _ = kernels.block_forward(kernels.CPU_FLASH, q, k, v, causal)
        want = kernels.block_backward(kernels.CPU_FLASH, dout, q, k, v, want_out, want_lse, causal, None)
        for name in names:
            dtype = torch.float32 if name == kernels.EFFICIENT else torch.bfloat16
            gpu = [t.to(CUDA, dtype) for t in (q, k, v, dout)]
            out, lse, state = kernels.block_forward(name, *gpu[:3], causal)
            grads = kernels.block_backward(name, gpu[3], *gpu[:3], out, lse, causal, state)
            tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(out.float().cpu(), want_out, **tolerance)
            torch.testing.assert_close(lse.float().cpu(), want_lse, **tolerance)
            for got, expected in zip(grads, want):
                torch.testing.assert_close(got.float().cpu(), expected, **tolerance)


def test_document_mask_with_compiled_flex_attention_matches_dense():
    from megatron.core.transformer.attention import document_attention_mask
    from tests.unit.test_attention_backends import core

    s = 2048
    lengths = torch.tensor([300, 700, 48, 1000])
    document_ids = torch.repeat_interleave(torch.arange(4), lengths).to(CUDA).unsqueeze(0).expand(2, s)
    allowed = (document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)) & torch.ones(
        s, s, dtype=torch.bool, device=CUDA).tril()
    attention = core("auto")
    q = randn(2, 16, s, 128, seed=1, dtype=torch.bfloat16)
    k, v = randn(2, 4, s, 128, seed=2, dtype=torch.bfloat16), randn(2, 4, s, 128, seed=3, dtype=torch.bfloat16)
    mask = document_attention_mask(document_ids)
    assert type(mask).__name__ == "BlockMask"
    torch.testing.assert_close(attention(q, k, v, mask).float(), attention(q, k, v, allowed.unsqueeze(1)).float(),
                               rtol=2e-2, atol=2e-2)


def test_seeding_cuda_leaves_the_cpu_generator_alike_on_tensor_parallel_ranks():
    from megatron.core.tensor_parallel.random import build_tracker

    draws = []
    for tp_rank in (0, 1):
        build_tracker(1234, tp_rank, 0, CUDA)
        draws.append(torch.rand(8))
    assert torch.equal(draws[0], draws[1])


def test_fp16_loss_scale_stays_on_the_device():
    from megatron.core.distributed.ddp import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.parallel_state import single_process
    from tests.unit.test_fused_linear_and_loss import TwoLinears

    groups = single_process(CUDA)
    ddp = DistributedDataParallel(TwoLinears(torch.float16, fusion=True).to(CUDA), groups)
    optimizer = get_megatron_optimizer(OptimizerConfig(fp16=True), [ddp], groups)
    loss = torch.ones((), device=CUDA)
    optimizer.scale_loss(loss)
    assert optimizer.grad_scaler.scale.device.type == "cuda"
    optimizer.grad_scaler.update(True)
    assert optimizer.grad_scaler.scale.device.type == "cuda"


def _pretrain(extra: list) -> subprocess.CompletedProcess:
    flags = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8", "--group-query-attention",
             "--num-query-groups", "4", "--ffn-hidden-size", "512", "--seq-length", "256", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3", "--normalization", "RMSNorm",
             "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope", "--hidden-dropout", "0",
             "--attention-dropout", "0", "--mock-data", "--vocab-size", "1024", "--log-interval", "1",
             "--eval-iters", "0", "--num-workers", "0"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *flags, *extra], capture_output=True,
                          text=True, timeout=600, env=env)


@pytest.mark.parametrize("precision", [["--bf16"], ["--fp16"], ["--bf16", "--fp8-format", "hybrid"]])
def test_training_steps_with_nccl_at_world_size_one(precision):
    result = _pretrain(["--distributed-backend", "nccl", *precision])
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", result.stdout)]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert "device: cuda" in result.stdout and "> attention:" in result.stdout


def test_gloo_backend_on_a_gpu_machine_still_computes_on_the_gpu():
    result = _pretrain(["--distributed-backend", "gloo", "--bf16", "--train-iters", "1"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "device: cuda" in result.stdout
