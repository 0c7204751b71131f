"""FP8 per linear by measurement: a start-up probe times each FP8 linear's three GEMMs (casts
included) against bf16 on this rank's weight shape, and leaves in bf16 the kinds that run slower in
FP8 (e.g. a 1B model's attention projections); the fast paths line names them.

Here the timings are injected (the CPU's float8 GEMMs are emulated, so the probe does not run on
the CPU by itself), the model is real, and it trains after the choice. Planted bug
(tools/dev/mutations.txt, FP8 choice): the faster kind left in bf16 instead of the slower."""
import torch

from megatron.core.transformer.fp8 import choose_fp8_linears, time_linear_gemms
from megatron.training.reporting.fast_paths import _fp8


def _fp8_model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.parallel_state import single_process
    from megatron.core.transformer.config import ExecutionConfig
    from tests.distributed.parity import llama_config

    execution = ExecutionConfig(params_dtype=torch.bfloat16, fp8="hybrid", fp8_recipe="tensorwise")
    model = GPTModel(llama_config(padded_vocab_size=64), single_process(), execution=execution)
    model.initialize_parameters(3)
    return model, execution


def linears(model):
    return {name: module for name, module in model.named_modules() if name.rsplit(".", 1)[-1].startswith("linear_")}


def test_kinds_slower_in_fp8_are_left_in_bf16_and_named():
    model, execution = _fp8_model()
    shapes = {name.rsplit(".", 1)[-1]: tuple(m.weight.shape) for name, m in linears(model).items()}
    slow = {shapes["linear_qkv"], shapes["linear_proj"]}  # [96, 64], [64, 64]: the MLP's are other shapes
    asked = []

    def time_linear(fp8_linear, shape):  # (bf16 seconds, FP8 seconds)
        asked.append(shape)
        return (1e-3, 2e-3) if shape in slow else (2e-3, 1e-3)

    report = choose_fp8_linears([model], 32, torch.device("cpu"), time_linear=time_linear)
    assert sorted(asked) == sorted(set(shapes.values()))  # once per kind and shape, not per layer
    for name, module in linears(model).items():
        assert (module.fp8 is None) == (name.rsplit(".", 1)[-1] in ("linear_qkv", "linear_proj")), name
    assert report == ("left in bf16 (slower in FP8 at start-up): linear_qkv 96x64 (2.00 ms in FP8, 1.00 in "
                      "bf16), linear_proj 64x64 (2.00 ms in FP8, 1.00 in bf16)")
    assert report in _fp8(execution, None, torch.device("cpu"), report)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens, torch.arange(16).expand_as(tokens), labels=tokens).mean().backward()


def test_nothing_is_probed_on_the_cpu_and_the_timer_runs():
    model, _ = _fp8_model()
    assert choose_fp8_linears([model], 32, torch.device("cpu")) == ""
    assert all(module.fp8 is not None for module in linears(model).values())
    some = next(iter(linears(model).values()))
    bf16_seconds, fp8_seconds = time_linear_gemms(some.fp8, tuple(some.weight.shape), 32, torch.device("cpu"))
    assert bf16_seconds > 0 and fp8_seconds > 0
