"""--save / --load end to end with pretrain_gpt.py (gloo, fp32, CPU).

- Layout independence: a checkpoint saved at TP2 x PP2 x DP2 with the distributed optimizer resumes
  at TP1, TP4, PP4 with interleaving, FSDP2 at DP4 and CP2 x TP2; every later loss and gradient norm equals the
  uninterrupted run's to rtol 1e-6 (summation order changes with the layout).
- Exact resume: at the same layout (PP2 x DP2, distributed optimizer, tied embeddings, dropout, real
  .bin/.idx data) the resumed run's losses and grad norms are bit-identical to the uninterrupted run.
- Stops: SIGTERM with --exit-signal-handler saves and exits 0; kill -9 at random moments and inside
  a save always leaves the tracker on a complete checkpoint, losing at most one save interval.
- Bad input: each a one-line error naming the path or field, before training starts.

Exact values come from TensorBoard (float32 scalars, as computed); the log line rounds them.
"""
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.functional.test_pretrain_gpt import (
    ROOT,
    pretrain_command,
    pretrain_env,
    run_pretrain,
    tensorboard_scalars,
)
from tests.optional import require_module

LLAMA = [
    "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention",
    "--num-query-groups", "2", "--ffn-hidden-size", "96", "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-3",
    "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
    # 500 pads to 512 at TP 1, 2 and 4 alike (padded rows take part in the softmax)
    "--vocab-size", "500", "--log-interval", "1", "--eval-interval", "100", "--eval-iters", "0",
    "--num-workers", "0", "--distributed-backend", "gloo", "--adam-eps", "1e-4",
]
SAVE_LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
               "--use-distributed-optimizer"]
TAGS = ("lm loss", "grad-norm")


def curves(tensorboard_dir) -> dict:
    return {tag: tensorboard_scalars(tensorboard_dir, tag) for tag in TAGS}


def assert_close_curves(got: dict, want: dict, iterations, rtol: float) -> None:
    for tag in TAGS:
        for iteration in iterations:
            a, b = got[tag][iteration], want[tag][iteration]
            assert abs(a - b) <= rtol * abs(b), f"{tag} at iteration {iteration}: {a!r} vs {b!r} (rtol {rtol})"


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, (result.stdout[-2000:] + result.stderr[-4000:])
    return result.stdout


# ---------------------------------------------------------------------------------------------
# Layout independence
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_at_tp2_pp2_dp2(tmp_path_factory):
    """6 iterations at TP2 x PP2 x DP2 with the distributed optimizer, saving at 3 and 6."""
    root = tmp_path_factory.mktemp("layout")
    ok(run_pretrain(SAVE_LAYOUT + ["--save", str(root / "ckpt"), "--save-interval", "3",
                                   "--tensorboard-dir", str(root / "tb")], nproc=8, base=LLAMA))
    return root / "ckpt", curves(root / "tb")


@pytest.mark.parametrize("layout, nproc", [
    ([], 1),
    (["--tensor-model-parallel-size", "4", "--sequence-parallel"], 4),
    (["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1"], 4),
    (["--use-torch-fsdp2"], 4),
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 4),
], ids=["tp1", "tp4", "pp4-interleaved", "fsdp2-dp4", "cp2-tp2"])
def test_resume_at_another_layout_continues_the_curve(saved_at_tp2_pp2_dp2, tmp_path, layout, nproc):
    checkpoint, reference = saved_at_tp2_pp2_dp2
    output = ok(run_pretrain(layout + ["--load", str(checkpoint), "--ckpt-step", "3",
                                       "--tensorboard-dir", str(tmp_path / "tb")], nproc=nproc, base=LLAMA))
    assert "loaded weights and optimizer state of iteration 3" in output
    assert "random number generator states are not restored" in output  # another layout
    resumed = curves(tmp_path / "tb")
    assert sorted(resumed["lm loss"]) == [4, 5, 6]
    assert_close_curves(resumed, reference, [4, 5, 6], rtol=1e-6)


def test_checkpoint_holds_logical_tensors_written_once(saved_at_tp2_pp2_dp2):
    """Full shapes, global layer numbers, masters only when they are copies (fp32 here: none), and
    each replicated box (DP replicas, replicated K/V heads) written by one rank only."""
    from megatron.core.checkpointing.storage import read_metadata

    checkpoint, _ = saved_at_tp2_pp2_dp2
    metadata = read_metadata(str(checkpoint / "iter_0000003"))
    shapes = {key: tuple(value.size) for key, value in metadata.state_dict_metadata.items()}
    assert shapes["model/decoder.layers.7.self_attention.linear_qkv.weight/q"] == (64, 64)
    assert shapes["model/decoder.layers.7.self_attention.linear_qkv.weight/k"] == (16, 64)
    assert shapes["model/embedding.word_embeddings.weight"] == (512, 64)
    assert shapes["optimizer/exp_avg_sq/output_layer.weight"] == (512, 64)
    assert not any(key.startswith("optimizer/master/") for key in shapes)
    assert sum(key.startswith("rng/") and key.endswith("/torch_cpu") for key in shapes) == 8
    for key, value in metadata.state_dict_metadata.items():
        if key.startswith("model/"):
            volume = sum(int(np.prod(chunk.sizes)) for chunk in value.chunks)
            assert volume == int(np.prod(value.size)), key  # no box saved twice, none missing
    common = json.loads((checkpoint / "iter_0000003" / "common.json").read_text())
    assert common["iteration"] == 3 and common["train_state"]["consumed_train_samples"] == 24
    # the scheduler counts samples, as Megatron-LM's: 3 iterations of global batch 8
    assert common["optimizer"]["num_applied_steps"] == 3 and common["optimizer"]["scheduler"]["num_steps"] == 24
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text() == "6"


# ---------------------------------------------------------------------------------------------
# Exact resume at the same layout
# ---------------------------------------------------------------------------------------------
GPT_TIED = LLAMA[:LLAMA.index("--normalization")] + [
    "--normalization", "LayerNorm", "--position-embedding-type", "learned_absolute", "--hidden-dropout", "0.1",
    "--attention-dropout", "0.1", "--num-workers", "0", "--log-interval", "1", "--eval-interval", "100",
    "--eval-iters", "0", "--distributed-backend", "gloo", "--adam-eps", "1e-4", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "500", "--split", "1,0,0"]


@pytest.fixture(scope="module")
def token_corpus(tmp_path_factory) -> str:
    """A .bin/.idx corpus of random documents of token ids below 500."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("corpus") / "tokens_text_document")
    generator = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(120):
        builder.add_item(generator.integers(0, 500, generator.integers(5, 80)))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_same_layout_resume_is_bit_identical(tmp_path, token_corpus):
    """PP2 x DP2, distributed optimizer, tied embeddings on the first and last stage, dropout (RNG
    streams restored) and real data (the data order continues)."""
    layout = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--data-path", token_corpus,
              "--data-cache-path", str(tmp_path / "cache")]
    ok(run_pretrain(layout + ["--save", str(tmp_path / "ckpt"), "--save-interval", "3",
                              "--tensorboard-dir", str(tmp_path / "tb_full")], nproc=4, base=GPT_TIED))
    ok(run_pretrain(layout + ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "3",
                              "--tensorboard-dir", str(tmp_path / "tb_resumed")], nproc=4, base=GPT_TIED))
    full, resumed = curves(tmp_path / "tb_full"), curves(tmp_path / "tb_resumed")
    for tag in TAGS:
        assert resumed[tag] == {i: full[tag][i] for i in (4, 5, 6)}, tag


# ---------------------------------------------------------------------------------------------
# Stops: SIGTERM, kill -9, a crash inside a save
# ---------------------------------------------------------------------------------------------
SINGLE = LLAMA[:LLAMA.index("--num-layers")] + ["--num-layers", "2"] + LLAMA[LLAMA.index("--hidden-size"):] + [
    "--hidden-dropout", "0.1", "--train-iters", "12"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    ok(run_pretrain(["--tensorboard-dir", str(root / "tb")], base=SINGLE))
    return curves(root / "tb")


def _start(args: list, nproc: int = 1) -> subprocess.Popen:
    if "--tensorboard-dir" in args:
        require_module("tensorboard")
    return subprocess.Popen(pretrain_command(nproc) + SINGLE + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=pretrain_env(), start_new_session=True)


def _wait_for_iteration(process: subprocess.Popen, iteration: int, lines: list) -> None:
    pattern = re.compile(rf" iteration +{iteration}/")
    for line in process.stdout:
        lines.append(line)
        if pattern.search(line):
            return
    raise AssertionError("training ended before iteration %d:\n%s" % (iteration, "".join(lines[-30:])))


def test_sigterm_saves_exits_zero_and_resume_matches(tmp_path, uninterrupted):
    process = _start(["--save", str(tmp_path / "ckpt"), "--exit-signal-handler", "--tensorboard-dir",
                      str(tmp_path / "tb")])
    lines = []
    _wait_for_iteration(process, 3, lines)
    process.send_signal(signal.SIGTERM)
    lines += process.stdout.readlines()
    assert process.wait(timeout=120) == 0, "".join(lines[-30:])
    stopped = int(re.search(r"exiting after iteration (\d+): signal SIGTERM", "".join(lines)).group(1))
    assert 3 <= stopped < 12
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == str(stopped)
    ok(run_pretrain(["--load", str(tmp_path / "ckpt"), "--tensorboard-dir", str(tmp_path / "tb_resumed")], base=SINGLE))
    resumed = curves(tmp_path / "tb_resumed")
    for tag in TAGS:
        assert resumed[tag] == {i: uninterrupted[tag][i] for i in range(stopped + 1, 13)}, tag


@pytest.mark.parametrize("precision", [["--bf16"], ["--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "4"]],
                         ids=["bf16", "fp8-delayed"])
def test_bf16_resume_keeps_the_fp32_masters(tmp_path, precision):
    """bf16 weights with fp32 masters: the masters are saved apart, so the resumed run is exact
    (resuming from the bf16 weights alone would round the masters and change the curve). With FP8
    delayed scaling the amax histories are saved too."""
    bf16 = precision + ["--train-iters", "4"]
    ok(run_pretrain(bf16 + ["--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                            "--tensorboard-dir", str(tmp_path / "tb_full")], base=SINGLE))
    ok(run_pretrain(bf16 + ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "2",
                            "--tensorboard-dir", str(tmp_path / "tb_resumed")], base=SINGLE))
    full, resumed = curves(tmp_path / "tb_full"), curves(tmp_path / "tb_resumed")
    for tag in TAGS:
        assert resumed[tag] == {i: full[tag][i] for i in (3, 4)}, tag


def _check_tracker_loads(checkpoint: Path) -> int:
    from megatron.core.checkpointing.storage import read_full_tensors
    from megatron.training.checkpointing import read_common, read_tracker

    iteration = read_tracker(str(checkpoint))
    directory = str(checkpoint / f"iter_{iteration:07d}")
    assert read_common(directory)["iteration"] == iteration
    tensors = read_full_tensors(directory)
    assert any(key.startswith("optimizer/exp_avg/") for key in tensors)
    return iteration


def test_kill_9_at_random_moments_leaves_a_loadable_checkpoint(tmp_path):
    """Saves every iteration; a kill at a random moment (often inside a save) costs at most the
    iteration in flight and the one being saved."""
    rng = random.Random(1234)
    for trial in range(3):
        checkpoint = tmp_path / f"ckpt{trial}"
        process = _start(["--save", str(checkpoint), "--save-interval", "1", "--train-iters", "200"])
        lines = []
        _wait_for_iteration(process, 2, lines)
        time.sleep(rng.uniform(0.0, 1.0))
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
        logged = [int(m.group(1)) for m in re.finditer(r" iteration +(\d+)/", "".join(lines))]
        assert _check_tracker_loads(checkpoint) >= logged[-1] - 1


@pytest.mark.parametrize("where", ["mid-data", "after-data", "at-rename", "at-tracker"])
def test_crash_inside_a_save_keeps_a_complete_checkpoint(tmp_path, where, uninterrupted):
    """A crash at each step of a save (writing, committing) leaves the tracker on a complete
    checkpoint: the previous one, or the new one once it is renamed into place."""
    checkpoint = tmp_path / "ckpt"
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("crash_during_save.py")), where, "4"]
                            + SINGLE + ["--save", str(checkpoint), "--save-interval", "2"],
                            capture_output=True, text=True, env=pretrain_env(), timeout=300)
    assert result.returncode == 9, result.stderr[-3000:]
    committed = where == "at-tracker"
    assert (checkpoint / "iter_0000004").is_dir() == committed
    assert (checkpoint / "iter_0000004.incomplete").is_dir() != committed
    assert _check_tracker_loads(checkpoint) == 2
    if where != "mid-data":
        return
    # The resumed run redoes iterations 3-4 exactly, and its save at 4 clears the leftover.
    ok(run_pretrain(["--load", str(checkpoint), "--save", str(checkpoint), "--save-interval", "2",
                     "--exit-interval", "6", "--tensorboard-dir", str(tmp_path / "tb")], base=SINGLE))
    assert not (checkpoint / "iter_0000004.incomplete").exists()
    assert curves(tmp_path / "tb")["lm loss"] == {i: uninterrupted["lm loss"][i] for i in (3, 4, 5, 6)}


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    """ENOSPC while the data files of iteration 4 are written: one error line naming the save and
    what survives, exit 1, the partial directory removed, the tracker on iteration 2, which loads."""
    checkpoint = tmp_path / "ckpt"
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("crash_during_save.py")), "enospc", "4"]
                            + SINGLE + ["--save", str(checkpoint), "--save-interval", "2"],
                            capture_output=True, text=True, env=pretrain_env(), timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert (f"error: saving the checkpoint of iteration 4 to {checkpoint / 'iter_0000004'} failed on rank 0: [Errno 28] "
            f"No space left on device. The partial checkpoint was removed and "
            f"{checkpoint / 'latest_checkpointed_iteration.txt'} still names iteration 2, which is complete; free space "
            f"(or keep fewer checkpoints with --ckpt-keep-latest) and resume with --load {checkpoint}") in result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in checkpoint.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt",
                                                              "save.lock"]
    assert _check_tracker_loads(checkpoint) == 2


def test_retention_async_save_and_finetune(tmp_path, uninterrupted):
    """--ckpt-keep-latest 2 keeps the newest two; --async-save writes the same checkpoints (the
    resumed curve is exact); --finetune loads weights only and restarts at iteration 0."""
    checkpoint = tmp_path / "ckpt"
    output = ok(run_pretrain(["--save", str(checkpoint), "--save-interval", "2", "--async-save",
                              "--ckpt-keep-latest", "2", "--exit-interval", "8"], base=SINGLE))
    assert "async checkpoint of iteration 2" in output
    assert sorted(p.name for p in checkpoint.iterdir()) == ["iter_0000006", "iter_0000008",
                                                              "latest_checkpointed_iteration.txt", "save.lock"]
    ok(run_pretrain(["--load", str(checkpoint), "--ckpt-step", "6", "--tensorboard-dir", str(tmp_path / "tb")],
                    base=SINGLE))
    assert curves(tmp_path / "tb")["lm loss"] == {i: uninterrupted["lm loss"][i] for i in range(7, 13)}
    output = ok(run_pretrain(["--load", str(checkpoint), "--finetune", "--train-iters", "2"], base=SINGLE))
    assert "--finetune: starting at iteration 0" in output
    assert re.search(r" iteration +2/ +2 \|", output)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    checkpoint = tmp_path_factory.mktemp("small") / "ckpt"
    ok(run_pretrain(["--save", str(checkpoint), "--train-iters", "2"], base=SINGLE))
    return checkpoint


def _main_error(argv: list) -> str:
    """pretrain_gpt.main in this process (it fails before anything heavy); the error's message."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_gpt_under_test", ROOT / "pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(ValueError) as error:
        module.main(SINGLE + argv)
    return str(error.value)


def test_missing_load_directory_starts_fresh(tmp_path):
    output = ok(run_pretrain(["--load", str(tmp_path / "nothing"), "--train-iters", "1"], base=SINGLE))
    assert f"--load {tmp_path / 'nothing'}: no checkpoint found" in output


def test_bad_checkpoints_fail_with_one_line(tmp_path, small_checkpoint):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(small_checkpoint, broken)
    assert "--ckpt-step 7: " in _main_error(["--load", str(broken), "--ckpt-step", "7"])
    (broken / "latest_checkpointed_iteration.txt").write_text("5")
    message = _main_error(["--load", str(broken)])
    assert "latest_checkpointed_iteration.txt names iteration 5, but" in message and "iter_0000005" in message
    (broken / "latest_checkpointed_iteration.txt").write_text("2")
    message = _main_error(["--load", str(broken), "--hidden-size", "128"])
    assert "it has hidden_size = 64 (--hidden-size), this run has 128" in message
    message = _main_error(["--load", str(broken), "--vocab-size", "300"])  # NullTokenizer: N ids + EOD
    assert "it has vocab_size = 501" in message and "this run has 301" in message
    shard = broken / "iter_0000002" / "__0_0.distcp"
    os.truncate(shard, 1000)
    assert f"{shard} is truncated" in _main_error(["--load", str(broken)])
    # through the command line: one line naming the file, no traceback
    result = run_pretrain(["--load", str(broken)], base=SINGLE)
    assert result.returncode == 2 and f"error: {shard} is truncated" in result.stderr
    assert "Traceback" not in result.stderr


def test_checkpoint_of_another_optimizer_is_refused(small_checkpoint):
    message = _main_error(["--load", str(small_checkpoint), "--optimizer", "sgd"])
    assert message.startswith(f"the checkpoint {small_checkpoint / 'iter_0000002'} was trained with --optimizer adam, "
                              "this run uses --optimizer sgd; pass --no-load-optim to start the optimizer afresh")


def test_use_checkpoint_args_takes_the_model_shape(small_checkpoint):
    output = ok(run_pretrain(["--load", str(small_checkpoint), "--use-checkpoint-args", "--hidden-size", "128",
                              "--train-iters", "3"], base=SINGLE))
    assert "--use-checkpoint-args: hidden_size = 64 (was 128)" in output
    assert re.search(r" iteration +3/ +3 \|", output)
