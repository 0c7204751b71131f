"""FP8 experts through pretrain_gpt.py (gloo, CPU): the delayed-scaling state, which holds each local
expert's amax history, survives a resume at the same layout exactly, and a resume at another
expert-parallel size (each rank then holds other experts' slots) starts the histories afresh with a
note instead of loading another layout's slots."""
import pytest

from tests.functional.test_moe import MOE_LLAMA, _curves
from tests.functional.test_pretrain_gpt import run_pretrain

FP8 = ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "4",
       "--fp8-amax-compute-algo", "max", "--train-iters", "6", "--lr-decay-iters", "6"]
EP2 = ["--expert-model-parallel-size", "2"]


def test_fp8_experts_resume(tmp_path):
    whole = _curves(tmp_path, "uninterrupted", 2, FP8 + EP2)
    save = tmp_path / "checkpoints"
    first = run_pretrain(FP8 + EP2 + ["--exit-interval", "3", "--save", str(save), "--save-interval", "3"], nproc=2,
                         base=MOE_LLAMA, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    same = _curves(tmp_path, "resumed ep2", 2, FP8 + EP2 + ["--load", str(save)])
    for iteration in (4, 5, 6):
        assert same["lm loss"][iteration] == pytest.approx(whole["lm loss"][iteration], rel=1e-5), iteration
    other = run_pretrain(FP8 + ["--load", str(save)], nproc=2, base=MOE_LLAMA, timeout=600)  # EP1 x DP2
    assert other.returncode == 0, other.stderr[-3000:]
    assert "was saved at another layout: the FP8 amax histories start afresh" in other.stdout
