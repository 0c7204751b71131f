"""The start-up attention choice is fair and quiet, and grouped key/value heads reach SDPA as they
are where its kernel takes them.

Fair: the decision over injected timings (the fastest kernel that ran, whatever the order; a kernel
that could not run is named with its reason in the one line), each kernel timed as a median after
untimed warm-up calls (cuDNN builds its plans in its first calls), and an explicit
--attention-backend is never probed or replaced. Quiet: the warnings SDPA raises before "No
available kernel" become the reason in that line, and nothing is warned on the probe's path (the
module runs under -W error). GQA: enable_gqa equals the expanded heads' result, forward and
backward, with no repeat_interleave run.

Planted bugs these fail on (tools/dev/mutations.txt, attention choice): the slowest kernel chosen,
the first (cold) call timed, and a kernel's refusal warnings passed on to the log."""
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.transformer import attention as attention_module
from megatron.core.transformer.attention import (
    CoreAttention,
    Probe,
    choose_backend,
    median_seconds,
    resolve_attention_backend,
    sdpa_quietly,
)

pytestmark = pytest.mark.filterwarnings("error")
SHAPE = dict(batch=1, heads=32, groups=8, seq=4096, head_dim=128, dtype=torch.bfloat16)


def test_the_fastest_kernel_that_ran_is_chosen_and_the_others_are_named():
    probes = [Probe("cudnn", 1.5e-3, "k/v heads expanded"), Probe("flash", 2.0e-3),
              Probe("efficient", None, "Memory efficient kernel not used because: head_dim 256 > 128")]
    backend, line = choose_backend(probes, "[1, 32, 4096, 128]", 8)
    assert backend == "cudnn"
    assert "cudnn 1.50 ms (k/v heads expanded), flash 2.00 ms" in line
    assert "median of 5 after 2 warm-up calls" in line
    assert line.endswith("unavailable: efficient: Memory efficient kernel not used because: head_dim 256 > 128")
    assert choose_backend(list(reversed(probes)), "[1, 32, 4096, 128]", 8)[0] == "cudnn"
    backend, line = choose_backend([Probe("flash", None, "no kernel")], "[1, 32, 4096, 128]", 8)
    assert backend == "auto" and "no kernel passed the probe" in line and "flash: no kernel" in line


def test_auto_on_an_accelerator_probes_every_kernel_and_an_explicit_choice_is_never_probed():
    accelerator = torch.device("meta")  # not the CPU: the accelerator branch, with timings injected
    asked = []

    def time_backend(name):
        asked.append(name)
        return Probe(name, {"cudnn": 1e-3, "flash": 2e-3}.get(name), "" if name != "efficient" else "refused")

    backend, line = resolve_attention_backend("auto", **SHAPE, device=accelerator, time_backend=time_backend)
    assert backend == "cudnn" and set(attention_module.PROBED) <= set(asked)
    for requested in ("flash", "fused", "cudnn", "efficient", "unfused", "local", "math"):
        asked.clear()
        got, line = resolve_attention_backend(requested, **SHAPE, device=accelerator, time_backend=time_backend)
        assert (got, asked) == (requested, []) and f"--attention-backend {requested}" in line


def test_the_probe_times_the_median_after_untimed_warm_up_calls():
    durations = iter([5.0, 5.0, 0.3, 0.1, 0.2, 0.9, 0.2])  # two cold calls (plan building), then five
    clock = {"now": 0.0}

    def step():
        clock["now"] += next(durations)

    original = attention_module.time.perf_counter
    attention_module.time.perf_counter = lambda: clock["now"]
    try:
        seconds = median_seconds(step, torch.device("cpu"), warmup=2, repeats=5)
    finally:
        attention_module.time.perf_counter = original
    assert seconds == pytest.approx(0.2)


def test_the_probe_on_the_cpu_runs_quietly():
    cpu = torch.device("cpu")
    refused = attention_module._time_backend("efficient", 1, 4, 2, 16, 8, torch.float32, cpu)
    assert refused.seconds is None and refused.note  # no such kernel on CPU: said why
    ran = attention_module._time_backend("math", 1, 4, 2, 16, 8, torch.float32, cpu)
    assert ran.seconds > 0 and ran.note == ""  # math takes grouped heads: nothing expanded


def test_refusal_warnings_become_the_reason_and_other_warnings_pass():
    def refused():  # what SDPA on CUDA does when no allowed kernel takes the inputs
        warnings.warn("Memory efficient kernel not used because: enable_gqa is not supported")
        warnings.warn("Flash attention has been runtime disabled.")
        raise RuntimeError("No available kernel. Aborting execution.")

    assert sdpa_quietly(refused) == (None, "Memory efficient kernel not used because: enable_gqa is not "
                                           "supported; Flash attention has been runtime disabled.")
    with pytest.raises(UserWarning, match="unrelated"):  # a call that runs keeps its warnings
        sdpa_quietly(lambda: warnings.warn("unrelated"))
    with pytest.raises(RuntimeError, match="size of tensor"):
        sdpa_quietly(lambda: (_ for _ in ()).throw(RuntimeError("The size of tensor a (8) must match")))


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["flash", "math"])
def test_grouped_heads_go_to_sdpa_unexpanded_and_equal_the_expanded_heads(backend):
    """flash reads the grouped k/v as they are: no copy of k and v (repeat_interleave is an expand
    and a clone each); SDPA's math kernel expands them itself, so only its numerics are checked."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 16, 8, generator=generator) for n in (8, 2, 2))
    grad = torch.randn(2, 8, 16, 8, generator=generator)
    results = []
    for expand in (False, True):
        attention = CoreAttention(SimpleNamespace(attention_dropout=0.0), None,
                                  execution=SimpleNamespace(attention_backend=backend))
        attention.expand_kv = expand
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with CountOps() as ops:
            out = attention(*leaves)
            out.backward(grad)
        if backend == "flash":
            assert ops.names.count("clone.default") == (2 if expand else 0), ops.names
        assert attention.grouped_kv_runs != expand
        results.append([out, *(t.grad for t in leaves)])
    for grouped, expanded in zip(*results):
        torch.testing.assert_close(grouped, expanded, rtol=1e-6, atol=1e-6)
