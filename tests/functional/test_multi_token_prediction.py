"""pretrain_gpt.py with --mtp-num-layers 1 on the tiny CPU Llama: the iteration line and TensorBoard
carry "mtp_1 loss" (Megatron-Core's name) beside the lm loss, and a run saved at iteration 3 and
resumed at another layout (two pipeline stages: the prediction module and its embedding copy on the
last) continues the uninterrupted one: lm and mtp losses of iterations 4-6 equal to rtol 1e-5, which
needs the module's weights and optimizer state in the checkpoint."""
import re

import pytest

from tests.functional.test_pretrain_gpt import TINY_LLAMA, run_pretrain, tensorboard_scalars

MTP = ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3", "--eval-iters", "0", "--train-iters", "6",
       "--lr-decay-iters", "6"]
TAGS = ("lm loss", "mtp_1 loss")


def _curves(directory, extra: list, nproc: int = 1) -> tuple:
    done = run_pretrain(MTP + extra + ["--tensorboard-dir", str(directory)], nproc=nproc, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, {tag: tensorboard_scalars(directory, tag) for tag in TAGS}


def test_mtp_loss_is_logged_and_resumes_at_another_layout(tmp_path):
    output, whole = _curves(tmp_path / "whole", [])
    logged = [float(value) for value in re.findall(r"\| mtp_1 loss: ([0-9.E+-]+) \|", output)]
    assert len(logged) == 6 and all(value > 0 for value in logged), output[-2000:]
    assert sorted(whole["mtp_1 loss"]) == [1, 2, 3, 4, 5, 6]
    save = tmp_path / "checkpoints"
    _curves(tmp_path / "first", ["--exit-interval", "3", "--save", str(save), "--save-interval", "3"])
    _, resumed = _curves(tmp_path / "resumed", ["--load", str(save), "--pipeline-model-parallel-size", "2"], nproc=2)
    for tag in TAGS:
        assert sorted(resumed[tag]) == [4, 5, 6], tag
        for iteration in (4, 5, 6):
            assert resumed[tag][iteration] == pytest.approx(whole[tag][iteration], rel=1e-5), (tag, iteration)
