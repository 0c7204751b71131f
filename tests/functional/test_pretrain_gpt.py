"""pretrain_gpt.py end to end: torchrun layouts reproduce the single-process loss curve."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.optional import require_executable, require_module

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention",
    "--num-query-groups", "2", "--ffn-hidden-size", "96", "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "5", "--lr", "1e-3",
    "--lr-warmup-iters", "1", "--lr-decay-style", "cosine", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "255", "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "1",
    "--num-workers", "0", "--distributed-backend", "gloo", "--adam-eps", "1e-4",
]


def pretrain_command(nproc: int = 1) -> list:
    """`python pretrain_gpt.py`, or torchrun with `nproc` processes on a free port."""
    if nproc == 1:
        return [sys.executable, str(ROOT / "pretrain_gpt.py")]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
            str(ROOT / "pretrain_gpt.py")]


def pretrain_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def run_pretrain(extra: list, nproc: int = 1, timeout: int = 300, base: list = TINY_LLAMA) -> subprocess.CompletedProcess:
    """Skips (with the install command) a run that logs to TensorBoard when tensorboard is absent."""
    if "--tensorboard-dir" in base + extra:
        require_module("tensorboard")
    return subprocess.run(pretrain_command(nproc) + base + extra, capture_output=True, text=True, timeout=timeout,
                          env=pretrain_env())


def tensorboard_scalars(directory, tag: str) -> dict:
    """{iteration: value} of one TensorBoard scalar (float32, exactly as computed)."""
    require_module("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def losses(output: str) -> list:
    return [float(v) for v in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", output)]


def validation_losses(output: str) -> list:
    """Every evaluation's loss, in order: during training, then the validation and test sets at the end."""
    return [float(v) for v in re.findall(r"lm loss value: ([0-9.E+-]+)", output)]


def evaluation_labels(output: str) -> list:
    return re.findall(r" validation loss at (.*?) \| lm loss value", output)


@pytest.fixture(scope="module")
def tensorboard_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tensorboard")


@pytest.fixture(scope="module")
def single_process_run(tensorboard_dir):
    result = run_pretrain(["--tensorboard-dir", str(tensorboard_dir), "--log-throughput"])
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_single_process_trains_and_logs(single_process_run):
    curve = losses(single_process_run)
    assert len(curve) == 5
    assert "throughput per GPU (TFLOP/s/GPU)" in single_process_run
    assert "tokens per GPU (tokens/s/GPU)" in single_process_run
    # Megatron's evaluations: every --eval-interval, then the validation set (continued, so on other
    # samples) and the test set after training.
    assert evaluation_labels(single_process_run) == ["iteration 5", "iteration 5 on validation set",
                                                     "iteration 5 on test set"]
    in_training, final, test = validation_losses(single_process_run)
    assert in_training != final
    assert "------------------------ arguments ------------------------" in single_process_run


def test_tensorboard_has_the_logged_scalars(single_process_run, tensorboard_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("lm loss", "learning-rate", "grad-norm", "loss-scale", "throughput-tflops-per-gpu",
                "tokens-per-second-per-gpu", "peak-memory-gb", "lm loss validation", "lm loss test", "batch-size"):
        assert tag in tags
    logged = [event.value for event in events.Scalars("lm loss")]
    assert logged == pytest.approx(losses(single_process_run), rel=1e-6)


def test_pytorch_profiler_writes_a_chrome_trace(tmp_path):
    result = run_pretrain(["--train-iters", "3", "--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
                           "--profile-step-end", "2", "--profile-dir", str(tmp_path), "--eval-iters", "0"])
    assert result.returncode == 0, result.stderr[-3000:]
    trace = tmp_path / "trace_rank0_iters2-2.json"
    assert trace.exists()
    import json

    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in str(event.get("name", "")) for event in events)


def _launch_script(tmp_path, **overrides):
    env = dict(os.environ, TOTAL_ITERS="3", BS="4", MBS="1", SEQ_LENGTH="32", NPROC="2", TEE_OUTPUT="0",
               MASTER_PORT="29533", EXTRA_ARGS="--num-workers 0 --log-interval 1", OMP_NUM_THREADS="1",
               LOG_DIR=str(tmp_path / "logs"), QUICKSTART_DIR=str(tmp_path / "none"),
               PATH=require_executable("torchrun"))
    env.update(overrides)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(["bash", str(ROOT / "examples/llama/train_llama3.sh")], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)


def test_example_script_prints_the_run_summary(tmp_path):
    """train_llama3.sh on CPU (tiny model, gloo, 2 processes): the flag check for both processes,
    one line saying the data is mock and why, the log in LOG_DIR, the mean throughput lines."""
    result = _launch_script(tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert result.stdout.startswith("data: mock (random tokens, so the loss stays near ln(8192) = 9.01;")
    assert result.stdout.count("> dry run: the flags are valid for 2 processes") == 1
    assert len(list((tmp_path / "logs").glob("train_llama_tiny_*.log"))) == 1
    summary = result.stdout.strip().splitlines()[-3:]
    assert summary[0].startswith("mean elapsed time per iteration (ms): ")
    assert summary[1].startswith("mean throughput per GPU (TFLOP/s/GPU): ")
    assert summary[2].startswith("mean tokens per GPU (tokens/s/GPU): ")
    assert float(summary[2].split(": ")[1]) > 0


def test_example_script_reports_a_flag_error_once(tmp_path):
    """A bad flag stops the script before torchrun: one message, no per-rank tracebacks."""
    result = _launch_script(tmp_path, EXTRA_ARGS="--hidden-size 130")
    assert result.returncode == 2
    assert result.stderr.count("error: --hidden-size (130) must be divisible by --num-attention-heads (4)") == 1
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    assert "stopped before starting torchrun" in result.stderr


@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],                     # TP2 x DP2
    ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"],
    ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--sequence-parallel"],
    ["--pipeline-model-parallel-size", "2", "--use-torch-fsdp2"],                     # FSDP2 x PP2 (x DP2)
    # Every micro-batch of mock data has the same number of loss tokens, so the token mean over the
    # global batch equals the mean of micro-batch means: the single-process curve is the reference.
    ["--pipeline-model-parallel-size", "2", "--calculate-per-token-loss"],
], ids=["tp2-dp2", "pp2-tp2", "cp2-tp2", "fsdp2-pp2", "pp2-dp2-per-token"])
def test_torchrun_layout_matches_single_process(single_process_run, layout):
    """Training and validation loss curves agree with one process to a relative 1e-5 (fp32)."""
    result = run_pretrain(layout, nproc=4)
    assert result.returncode == 0, result.stderr[-3000:]
    if "--context-parallel-size" in layout:  # the layout really split the sequence
        assert "context-parallel size: 2" in result.stdout and "DP=1, CP=2, TP=2" in result.stdout
    got, want = losses(result.stdout), losses(single_process_run)
    assert len(got) == len(want) == 5
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-5 * abs(b), f"iteration {step + 1}: {a} vs {b}"
    assert validation_losses(result.stdout) == pytest.approx(validation_losses(single_process_run), rel=1e-5)


@pytest.mark.parametrize("flags, message", [
    (["--hidden-size", "65"], "--hidden-size (65) must be divisible by --num-attention-heads (8)"),
    (["--tensor-model-parallel-size", "2"], "world size (1) is not divisible by tensor (2)"),
    (["--global-batch-size", "7"], "--global-batch-size (7) must be divisible by --micro-batch-size (2)"),
    (["--seq-length", "64"], "--seq-length (64) exceeds --max-position-embeddings (32)"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--bf16"], "--fp8-recipe mxfp8 is not available"),
    (["--num-virtual-stages-per-pipeline-rank", "2"], "--pipeline-model-parallel-size"),
])
def test_bad_flags_fail_before_building(flags, message):
    result = run_pretrain(flags)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_transformer_engine_flags_run_the_native_fp8_path_with_a_note():
    """Megatron's FP8 flags as launch scripts pass them (TE_FP8=1): without Transformer Engine the
    local layers train in FP8 through torch._scaled_mm, after a one-line note."""
    result = run_pretrain(["--transformer-impl", "transformer_engine", "--bf16", "--fp8-format", "hybrid",
                           "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo",
                           "max", "--eval-iters", "0"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "NOTE: --transformer-impl transformer_engine: Transformer Engine is not used" in result.stdout
    curve = losses(result.stdout)
    assert len(curve) == 5 and curve[-1] < curve[0]


def test_unknown_flag_is_an_error():
    result = run_pretrain(["--no-such-flag"])
    assert result.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in result.stderr
