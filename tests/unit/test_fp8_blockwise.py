"""--fp8-recipe blockwise: DeepSeek-V3's scaling (1x128 tiles of activations and gradients, 128x128
weight blocks) through PyTorch's block-scaled GEMM, which runs on Hopper GPUs only.

On the CPU: the block quantization against a per-block reference written here, the start-up
refusal (which names the PyTorch version or hardware that would run it) and acceptance logic, and
the refusal a CPU machine gets at start-up. The GEMMs themselves run in the GPU lane
(tests/gpu/test_gpu_lane.py), where each model build first checks them against the
block-dequantized product.

Planted bugs these fail on (tools/dev/mutations.txt, FP8 blockwise): blocks scaled from the
whole tensor's amax, a non-Hopper GPU accepted."""
import pytest
import torch

from megatron.core.transformer.fp8 import (
    BLOCK,
    FP8Options,
    blockwise_refusal,
    blockwise_unavailable,
    dequantize_blocks,
    has_block_scaled_gemm,
    quantize_blocks,
)


@pytest.mark.parametrize("rows", [1, BLOCK], ids=["1x128 tiles", "128x128 blocks"])
def test_each_block_is_scaled_from_its_own_amax(rows):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 384, generator=generator)
    x[:128, :128] *= 1000  # one block far larger: the others keep their own resolution
    q, scale = quantize_blocks(x.bfloat16(), rows, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (256 // rows, 384 // BLOCK)
    for i in range(0, 256, rows):
        for j in range(0, 384, BLOCK):
            block = x.bfloat16()[i:i + rows, j:j + BLOCK].float()
            want = 448.0 / block.abs().max()
            assert scale[i // rows, j // BLOCK] == want
    back = dequantize_blocks(q, scale, rows)
    error = (back - x.bfloat16().float()).abs() / x.bfloat16().float().abs().clamp(min=1e-3)
    assert error[x.abs() > 1e-2].max() <= 2 ** -4  # E4M3: 3 mantissa bits, in every block


def test_the_refusal_names_what_would_run_it():
    assert "PyTorch 2.13 has it" in blockwise_refusal(False, "cuda", (9, 0), None)
    assert "not on cpu" in blockwise_refusal(True, "cpu", None, None)
    assert "this GPU is 8.0" in blockwise_refusal(True, "cuda", (8, 0), None)
    assert "this GPU is 10.0" in blockwise_refusal(True, "cuda", (10, 0), None)
    assert "start-up check" in blockwise_refusal(True, "cuda", (9, 0), "1x128 by 128x128 off by 0.9 (relative)")
    assert blockwise_refusal(True, "cuda", (9, 0), None) is None
    assert has_block_scaled_gemm()  # PyTorch 2.13: torch.nn.functional.scaled_mm with block scales
    assert "not on cpu" in blockwise_unavailable(torch.device("cpu"))


def test_blockwise_takes_e4m3_only():
    FP8Options("e4m3", "blockwise")
    with pytest.raises(ValueError, match="--fp8-recipe blockwise takes --fp8-format e4m3"):
        FP8Options("hybrid", "blockwise")


BLOCKWISE = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "2", "--micro-batch-size", "1",
             "--seq-length", "128", "--train-iters", "3", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
             "NullTokenizer", "--vocab-size", "128", "--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]


def test_sizes_that_are_not_whole_blocks_are_refused_at_start_up():
    from megatron.training.arguments import parse_args
    from megatron.training.validation import ConfigError, validate

    with pytest.raises(ConfigError, match="blockwise need matrix sizes divisible by 128: --hidden-size is 192"):
        validate(parse_args(BLOCKWISE + ["--hidden-size", "192"]), 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU gets past this check")
def test_a_machine_without_a_gpu_refuses_blockwise_at_start_up():
    from megatron.training.arguments import parse_args
    from megatron.training.validation import ConfigError, validate

    with pytest.raises(ConfigError, match="--fp8-recipe blockwise cannot run here: .*not on cpu"):
        validate(parse_args(BLOCKWISE), 1)
