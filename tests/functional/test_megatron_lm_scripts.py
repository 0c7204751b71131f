"""pretrain_gpt.py with the complete flag sets of Megatron-LM's own example scripts,
examples/gpt3/train_gpt3_175b_distributed.sh and examples/llama/train_llama3_8b_h100_fp8.sh (its
bf16 branch on real data), shrunk to tiny sizes and run on CPU with gloo under torchrun: every flag
is read, and the run trains, saves, resumes, evaluates and profiles.

Shrunk means: sizes (layers, hidden, heads, sequence, batch, samples, iterations, intervals) and the
parallel layout are small numbers; paths point into tmp_path; --distributed-backend gloo is added.
The flag names and every other value are the scripts' own.
"""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.functional.test_pretrain_gpt import losses, pretrain_command, pretrain_env
from tests.optional import require_executable

# examples/gpt3/train_gpt3_175b_distributed.sh: GPT_MODEL_ARGS, TRAINING_ARGS, MODEL_PARALLEL_ARGS,
# DATA_ARGS, EVAL_AND_LOGGING_ARGS (96 layers, h 12288, 96 heads, seq 2048, TP 8 x PP 16 shrunk).
GPT3_MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--max-position-embeddings", "32", "--attention-backend", "auto"]
GPT3_TRAINING = ["--micro-batch-size", "1", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "24",
                 "--train-iters", "8", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                 "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
                 "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
                 "--lr-decay-iters", "7"]
GPT3_PARALLEL = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
GPT3_EVAL = ["--log-interval", "1", "--save-interval", "4", "--eval-interval", "4", "--eval-iters", "1"]

# examples/llama/train_llama3_8b_h100_fp8.sh with DTYPE != fp8 and real data: MODEL_ARGS,
# TRAINING_ARGS (+ DDP_ARGS), MODEL_PARALLEL_ARGS, DATA_ARGS_LIST, EVAL_AND_LOGGING_ARGS
# (32 layers, h 4096, 32 heads, seq 8192, 1953125000 samples shrunk).
LLAMA3_MODEL = ["--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "224",
                "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2", "--kv-channels",
                "8", "--seq-length", "32", "--max-position-embeddings", "32", "--position-embedding-type", "rope",
                "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
                "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "fused",
                "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
LLAMA3_TRAINING = ["--micro-batch-size", "1", "--global-batch-size", "8", "--train-samples", "64",
                   "--lr-decay-samples", "60", "--lr-warmup-samples", "16", "--lr", "0.00015", "--min-lr", "0.00001",
                   "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine",
                   "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                   "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion", "--calculate-per-token-loss",
                   "--manual-gc", "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
                   "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
LLAMA3_PARALLEL = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "1", "--sequence-parallel"]
LLAMA3_EVAL = ["--log-interval", "1", "--eval-iters", "2", "--eval-interval", "4", "--save-interval", "4",
               "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6",
               "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60"]


def torchrun(nproc: int, flags: list, timeout: int = 420, **env):
    return subprocess.run(pretrain_command(nproc) + flags + ["--distributed-backend", "gloo"], capture_output=True,
                          text=True, timeout=timeout, env=dict(pretrain_env(), **env))


def notes(output: str) -> list:
    return re.findall(r"NOTE: (--[a-z0-9-]+)", output)


def test_gpt3_175b_flag_set(tmp_path, gpt2_dataset, bpe_dir):
    """The script's own combination of --rampup-batch-size with --train-iters is refused, as
    Megatron-LM refuses it ('expected no batch-size rampup for iteration-based training'); with the
    sample-based equivalents (--train-samples 64 = 8 iterations of 8, --lr-decay-samples 56) the
    rest of the flag set trains: tokenizer implied by --vocab-file/--merge-file, fp16 with dynamic
    loss scaling, TP 2 x PP 2, the ramp 2 -> 8, saves every 4 iterations."""
    data = ["--data-path", gpt2_dataset, "--vocab-file", f"{bpe_dir}/vocab.json", "--merge-file",
            f"{bpe_dir}/merges.txt", "--split", "949,50,1"]
    logging = GPT3_EVAL + ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"),
                           "--tensorboard-dir", str(tmp_path / "tb"), "--data-cache-path", str(tmp_path / "cache")]
    as_written = GPT3_MODEL + GPT3_TRAINING + GPT3_PARALLEL + data + logging
    refused = torchrun(1, as_written + ["--dry-run"], WORLD_SIZE="4")
    assert refused.returncode == 2
    assert "--rampup-batch-size needs sample-based training" in refused.stderr

    training = [f for f in GPT3_TRAINING]
    training[training.index("--train-iters"):training.index("--train-iters") + 2] = ["--train-samples", "64"]
    training[training.index("--lr-decay-iters"):training.index("--lr-decay-iters") + 2] = ["--lr-decay-samples", "56"]
    result = torchrun(4, GPT3_MODEL + training + GPT3_PARALLEL + data + logging)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    sizes = [int(v) for v in re.findall(r"global batch size: +(\d+)", result.stdout)]
    assert sizes[0] == 2 and sizes[-1] == 8 and len(sizes) == len(losses(result.stdout))
    # --load of an empty directory starts afresh; the tokenizer comes from --vocab-file/--merge-file
    assert notes(result.stdout) == ["--load", "--vocab-file"]
    assert json.loads((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text()) == len(sizes)


def test_llama3_8b_flag_set(tmp_path, bpe_dir, gpt2_dataset):
    """Every flag of the bf16, real-data branch; the run trains, profiles iterations 5-6, saves,
    and a second run with the same command resumes from its checkpoint."""
    # The same BPE files read through Hugging Face: a copy of the data without this framework's
    # tokenizer record (as data written by Megatron-LM's own tools has none), which would otherwise
    # refuse the other tokenizer type.
    prefix = tmp_path / "corpus_text_document"
    for suffix in (".bin", ".idx"):
        shutil.copyfile(gpt2_dataset + suffix, str(prefix) + suffix)
    data = ["--data-path", str(prefix), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", bpe_dir,
            "--data-cache-path", str(tmp_path / "cache"), "--split", "'99,1,0'",
            "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
            "--vocab-size", "128256"]
    logging = LLAMA3_EVAL + ["--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"),
                             "--tensorboard-dir", str(tmp_path / "tb")]
    flags = LLAMA3_MODEL + LLAMA3_TRAINING + LLAMA3_PARALLEL + data + logging
    result = torchrun(2, flags)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert len(losses(result.stdout)) == 8
    assert "decoupled learning rate" in result.stdout and "throughput per GPU" in result.stdout
    assert notes(result.stdout) == ["--load", "--use-mcore-models", "--profile"]
    assert "attention: --attention-backend fused (CUDNN_ATTENTION, EFFICIENT_ATTENTION) needs a GPU" in result.stdout
    assert list((tmp_path / "tb").glob("trace_rank0_iters5-6.json"))
    again = torchrun(2, flags[:flags.index("--train-samples") + 1] + ["96"] + flags[flags.index("--train-samples") + 2:])
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "loaded weights and optimizer state of iteration 8" in again.stdout
    assert len(losses(again.stdout)) == 4


def _run_upstream_script(tmp_path, script: str, *args, **env) -> subprocess.CompletedProcess:
    """One of tests/functional/upstream_scripts under the real torchrun (2 CPU processes)."""
    scripts = Path(__file__).with_name("upstream_scripts")
    env = dict(pretrain_env(), MEGATRON_ROOT=str(scripts.parents[2]), PATH=require_executable("torchrun"), **env)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(["bash", str(scripts / script), *args], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=420)


def test_rocm_llama3_script_trains_saves_and_resumes(tmp_path, bpe_dir):
    """The ROCm fork's train_llama3.sh as its users run it (its defaults: --dataloader-type cyclic,
    --eval-iters -1, the fork's own flags, --ckpt-format torch), with a checkpoint directory; then
    again with LOAD_CKPT_PATH, which resumes from it with --use-checkpoint-args."""
    sizes = dict(TP="1", MODEL_SIZE="8", BS="8", MBS="1", SEQ_LENGTH="32", TOKENIZER_MODEL=bpe_dir,
                 SAVE_CKPT_PATH=str(tmp_path / "ckpt"), SAVE_INTERVAL="2", EVAL_INTERVAL="2")
    first = _run_upstream_script(tmp_path, "rocm_train_llama3.sh", TOTAL_ITERS="4", MASTER_PORT="29621", **sizes)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    assert len(losses(first.stdout)) == 4
    assert {"--fused-single-qkv-rope", "--use-te-activation-func", "--rerun-mode"} <= set(notes(first.stdout))
    assert "--eval-iters -1: no evaluation" in first.stdout and "validation loss" not in first.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    again = _run_upstream_script(tmp_path, "rocm_train_llama3.sh", TOTAL_ITERS="6", MASTER_PORT="29622",
                                 LOAD_CKPT_PATH=str(tmp_path / "ckpt"), **sizes)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "loaded weights of iteration 4" in again.stdout and len(losses(again.stdout)) == 2
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


def test_nvidia_llama3_fp8_script_trains_saves_and_resumes(tmp_path):
    """NVIDIA's train_llama3_8b_h100_fp8.sh as written (FP8 hybrid with --fp8-param-gather, mock
    data, --profile): it trains, evaluates, saves; run again, it loads its checkpoint and has nothing
    left to train."""
    paths = (str(tmp_path / "ckpt"), str(tmp_path / "tb"))
    first = _run_upstream_script(tmp_path, "nvidia_train_llama3_8b_h100_fp8.sh", *paths, MASTER_PORT="29623")
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    assert len(losses(first.stdout)) == 8 and "validation loss at iteration 8" in first.stdout
    assert "--fp8-param-gather" in notes(first.stdout)
    again = _run_upstream_script(tmp_path, "nvidia_train_llama3_8b_h100_fp8.sh", *paths, MASTER_PORT="29624")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "loaded weights and optimizer state of iteration 8" in again.stdout and losses(again.stdout) == []


def test_a_typo_in_a_launch_script_is_one_line_before_torchrun(tmp_path):
    """examples/llama/train_llama3.sh checks its flags in one process before torchrun: a misspelt
    flag is one line naming the closest known flag, with no usage text and no torchrun report."""
    from tests.functional.test_pretrain_gpt import _launch_script

    result = _launch_script(tmp_path, EXTRA_ARGS="--save-intreval 20")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert lines[0] == ("pretrain_gpt.py: error: unrecognized arguments: --save-intreval "
                        "(did you mean --save-interval?)")
    assert "usage:" not in result.stderr and "Traceback" not in result.stderr
    assert "ChildFailedError" not in result.stderr and "stopped before starting torchrun" in result.stderr
