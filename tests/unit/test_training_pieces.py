"""Learning-rate schedules, loss scaling, the FLOPs formula, the log line and the data sampler."""
import math

import pytest

from megatron.core.optimizer.grad_scaler import DynamicGradScaler
from megatron.core.optimizer.lr_scheduler import LRScheduleConfig, learning_rate
from megatron.core.transformer.config import TransformerConfig, derive
from megatron.training.data import PretrainingSampler
from megatron.training.reporting.logging import flops_per_iteration, iteration_line


def test_warmup_then_cosine_to_min():
    c = LRScheduleConfig(max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110, decay_style="cosine")
    assert learning_rate(c, 0) == 0.0
    assert learning_rate(c, 5) == pytest.approx(0.5)
    assert learning_rate(c, 10) == pytest.approx(1.0)
    assert learning_rate(c, 60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert learning_rate(c, 110) == pytest.approx(0.1)
    assert learning_rate(c, 500) == pytest.approx(0.1)


def test_linear_and_constant():
    linear = LRScheduleConfig(max_lr=2.0, min_lr=0.0, warmup_steps=0, decay_steps=100, decay_style="linear")
    assert learning_rate(linear, 25) == pytest.approx(1.5)
    constant = LRScheduleConfig(max_lr=2.0, min_lr=0.0, warmup_steps=4, decay_steps=100, decay_style="constant")
    assert learning_rate(constant, 2) == pytest.approx(1.0)
    assert learning_rate(constant, 90) == pytest.approx(2.0)


def test_wsd_is_stable_then_decays_in_the_tail():
    c = LRScheduleConfig(max_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=100, decay_style="WSD",
                         wsd_decay_steps=20, wsd_decay_style="linear")
    assert learning_rate(c, 50) == pytest.approx(1.0)
    assert learning_rate(c, 80) == pytest.approx(1.0)
    assert learning_rate(c, 90) == pytest.approx(0.5)
    assert learning_rate(c, 100) == pytest.approx(0.0)
    exponential = LRScheduleConfig(max_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=100, decay_style="WSD",
                                   wsd_decay_steps=20, wsd_decay_style="exponential")
    assert learning_rate(exponential, 100) == pytest.approx(0.0)
    assert 0.0 < learning_rate(exponential, 90) < 1.0


def test_dynamic_loss_scale_backs_off_after_hysteresis_and_grows():
    scaler = DynamicGradScaler(initial_scale=1024.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    scaler.update(found_inf=True)
    assert scaler.scale.item() == 1024.0  # first overflow tolerated
    scaler.update(found_inf=True)
    assert scaler.scale.item() == 512.0
    for _ in range(3):
        scaler.update(found_inf=False)
    assert scaler.scale.item() == 1024.0


def test_flops_formula_matches_design_for_llama3_8b():
    model = derive(TransformerConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, group_query_attention=True,
                                     num_query_groups=8, ffn_hidden_size=14336, padded_vocab_size=128256, swiglu=True))
    B, s, L, h, f, q, k, g, V = 1, 8192, 32, 4096, 14336, 4096, 128, 8, 128256
    expected = 6 * B * s * (L * (3 * h * f + 2 * h * q + 2 * h * k * g + s * q) + h * V)
    assert flops_per_iteration(model, 1, 8192) == expected
    # roughly 6 x parameters x tokens plus attention: a sanity bound
    assert 6 * 8.0e9 * 8192 < expected < 6 * 9.5e9 * 8192


def test_log_line_has_megatron_fields():
    fields = dict(iteration=10, train_iters=100, consumed_samples=640, elapsed_ms=1234.5, learning_rate=1e-4,
                  global_batch_size=64, losses={"lm loss": 2.5}, loss_scale=1.0, grad_norm=0.9, skipped=0, nan=0,
                  peak_memory_gb=40.0)
    line = iteration_line(throughput=(401.2, 9000.0), **fields)
    for field in ("iteration       10/     100", "consumed samples:", "elapsed time per iteration (ms): 1234.5",
                  "throughput per GPU (TFLOP/s/GPU): 401.20", "learning rate: 1.000000E-04",
                  "global batch size:    64", "lm loss: 2.500000E+00", "loss scale: 1.0", "grad norm: 0.900",
                  "number of skipped iterations:   0", "number of nan iterations:   0"):
        assert field in line
    assert "decoupled" not in line and "params norm" not in line and "num zeros" not in line


def test_log_line_switches():
    """Throughput only with --log-throughput; the decoupled learning rate, parameter norm and zero
    count when they are computed."""
    line = iteration_line(iteration=1, train_iters=2, consumed_samples=8, elapsed_ms=1.0, throughput=None,
                          learning_rate=1e-4, global_batch_size=8, losses={}, loss_scale=1.0, grad_norm=None,
                          skipped=0, nan=0, peak_memory_gb=0.0, decoupled_learning_rate=5e-4, params_norm=12.5,
                          num_zeros=7)
    assert "TFLOP/s" not in line and "tokens/s" not in line
    for field in ("decoupled learning rate: 5.000000E-04", "params norm: 12.500", "num zeros: 7"):
        assert field in line


def test_sampler_splits_each_step_over_data_ranks_and_resumes():
    ranks = [list(PretrainingSampler(16, 0, 2, r, 2)) for r in range(2)]
    assert ranks[0][:2] == [[0, 1], [4, 5]]
    assert ranks[1][:2] == [[2, 3], [6, 7]]
    covered = sorted(i for r in ranks for batch in r for i in batch)
    assert covered == list(range(16))
    resumed = list(PretrainingSampler(16, 8, 2, 1, 2))
    assert resumed[0] == [10, 11]
    with pytest.raises(ValueError, match="consumed 16 of 16"):
        PretrainingSampler(16, 16, 2, 0, 2)
    assert math.isclose(len(PretrainingSampler(17, 0, 2, 0, 2)), 4)


def test_weight_decay_skips_norms_and_biases_and_masters_are_fp32():
    import torch

    from megatron.core.distributed.ddp import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.parallel_state import single_process
    from megatron.core.transformer.config import ExecutionConfig, TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, padded_vocab_size=64,
                               max_position_embeddings=4096, add_bias_linear=True)
    model = GPTModel(config, single_process(), execution=ExecutionConfig(params_dtype=torch.bfloat16))
    model.initialize_parameters(3)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.1, bf16=True),
                                       [DistributedDataParallel(model, single_process())], single_process())
    by_decay = {group["weight_decay"]: group["params"] for group in optimizer.param_groups}
    assert all(p.ndim > 1 for p in by_decay[0.1])
    assert all(p.ndim == 1 for p in by_decay[0.0])
    assert len(by_decay[0.0]) == sum(1 for p in model.parameters() if p.ndim == 1) > 0
    assert all(p.dtype == torch.float32 for group in optimizer.param_groups for p in group["params"])


def test_compile_threads_are_split_between_the_ranks_of_a_node(monkeypatch):
    """N ranks compiling at once each get 1/N of the node's CPUs; an explicit setting wins."""
    import os

    import torch._inductor.config as inductor_config

    from megatron.training.initialize import limit_compile_threads

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    # inductor's own patch restores the setting: monkeypatch.setattr would see no attribute in the
    # config module's __dict__ and delete it on undo, hiding it from every later compile.
    with inductor_config.patch(compile_threads=inductor_config.compile_threads):
        limit_compile_threads()
        assert os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "8" and inductor_config.compile_threads == 8
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    limit_compile_threads()
    assert os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "3"
