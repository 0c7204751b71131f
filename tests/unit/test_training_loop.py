"""The training loop end to end in this process (pretrain_gpt.main, one rank, tiny model): Megatron's
evaluation order and resume, the batch-size ramp, --calculate-per-token-loss and TensorBoard
intervals. Multi-rank equivalence of the same features is in tests/functional."""
import json
import re

import numpy as np
import pytest

import pretrain_gpt
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.training.state import BatchSchedule

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "1e-3", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--position-embedding-type", "rope", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--log-interval", "1", "--num-workers", "0",
        "--distributed-backend", "gloo", "--seed", "7"]
MOCK = TINY + ["--mock-data"]


def run(capsys, flags) -> str:
    pretrain_gpt.main(flags)
    return capsys.readouterr().out


def losses(output: str) -> list:
    return [float(v) for v in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", output)]


def grad_norms(output: str) -> list:
    return [float(v) for v in re.findall(r"\| grad norm: ([0-9.]+) \|", output)]


def evaluations(output: str) -> list:
    """[(label, loss)] of every evaluation, in order."""
    return [(label, float(value)) for label, value in
            re.findall(r" validation loss at (.*?) \| lm loss value: ([0-9.E+-]+)", output)]


def test_evaluation_continues_through_the_validation_set(capsys):
    """With the learning rate at zero the model is fixed, so an evaluation is a function of the
    samples it reads: two evaluations of 2 batches read what one evaluation of 4 batches reads."""
    fixed = ["--lr", "0", "--min-lr", "0", "--train-iters", "4"]
    two = evaluations(run(capsys, MOCK + fixed + ["--eval-interval", "2", "--eval-iters", "2"]))
    four = evaluations(run(capsys, MOCK + fixed + ["--eval-interval", "4", "--eval-iters", "4"]))
    assert [label for label, _ in two] == ["iteration 2", "iteration 4", "iteration 4 on validation set",
                                           "iteration 4 on test set"]
    assert two[0][1] != two[1][1]
    assert four[0][1] == pytest.approx((two[0][1] + two[1][1]) / 2, rel=1e-6)


def test_resume_continues_the_validation_set(capsys, tmp_path):
    flags = MOCK + ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "2"]
    whole = evaluations(run(capsys, flags))
    run(capsys, flags + ["--save", str(tmp_path), "--exit-interval", "2"])
    common = json.loads((tmp_path / "iter_0000002" / "common.json").read_text())
    assert common["train_state"]["consumed_valid_samples"] == 2 * 8
    resumed = evaluations(run(capsys, flags + ["--load", str(tmp_path)]))
    assert resumed == [(label, pytest.approx(value, rel=1e-6)) for label, value in whole[1:]]


def test_rampup_follows_the_schedule(capsys):
    output = run(capsys, MOCK + ["--train-samples", "60", "--rampup-batch-size", "2", "2", "20", "--eval-iters", "0"])
    sizes = [int(v) for v in re.findall(r"global batch size: +(\d+)", output)]
    consumed = [int(v) for v in re.findall(r"consumed samples: +(\d+)", output)]
    schedule = BatchSchedule(8, 2, (2, 2, 20))
    expected, total = [], 0
    for _ in range(schedule.iterations_for(60)):
        expected.append(schedule.global_batch_size_at(total))
        total += expected[-1]
    assert sizes == expected and sizes[0] == 2 and sizes[-1] == 8
    assert consumed == list(np.cumsum(expected))


@pytest.fixture(scope="module")
def documents_prefix(tmp_path_factory):
    """Documents of 1 to 8 tokens ending in EOD (255): with --eod-mask-loss the micro-batches have
    clearly different numbers of loss tokens."""
    prefix = str(tmp_path_factory.mktemp("data") / "docs")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(400):
        builder.add_item(np.append(rng.integers(0, 255, rng.integers(0, 8)), 255))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_per_token_loss_weighs_every_token_of_the_global_batch(capsys, tmp_path, documents_prefix):
    """--calculate-per-token-loss over 4 micro-batches of 2 trains exactly as one micro-batch of 8
    (the mean over all loss tokens of the step); the default (mean of micro-batch means) does not."""
    data = TINY + ["--data-path", documents_prefix, "--split", "98,2,0", "--eod-mask-loss", "--train-iters", "4",
                   "--eval-iters", "0", "--data-cache-path", str(tmp_path), "--lr", "1e-2"]
    per_token = run(capsys, data + ["--calculate-per-token-loss"])
    one_micro_batch = run(capsys, data + ["--micro-batch-size", "8"])
    default = run(capsys, data)
    assert losses(per_token) == pytest.approx(losses(one_micro_batch), rel=1e-5)
    assert grad_norms(per_token) == pytest.approx(grad_norms(one_micro_batch), rel=1e-3)
    assert max(abs(a / b - 1) for a, b in zip(grad_norms(default), grad_norms(one_micro_batch))) > 1e-2


def test_tensorboard_log_interval(capsys, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(capsys, MOCK + ["--train-iters", "6", "--eval-iters", "0", "--tensorboard-dir", str(tmp_path),
                        "--tensorboard-log-interval", "3", "--log-interval", "2", "--log-params-norm",
                        "--log-world-size-to-tensorboard", "--no-log-loss-scale-to-tensorboard"])
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Scalars("lm loss")] == [3, 6]
    assert [e.step for e in events.Scalars("params-norm")] == [3, 6]
    assert [e.value for e in events.Scalars("world-size")] == [1, 1]
    assert "loss-scale" not in events.Tags()["scalars"]


def test_data_args_files_are_the_data_path_flags(capsys, tmp_path, documents_prefix):
    base = TINY + ["--train-iters", "2", "--eval-iters", "1", "--eval-interval", "2", "--data-cache-path", str(tmp_path)]
    blend = ["0.7", documents_prefix, "0.3", documents_prefix]
    (tmp_path / "blend.txt").write_text(" ".join(blend) + "\n")
    direct = run(capsys, base + ["--data-path", *blend, "--split", "90,8,2"])
    from_file = run(capsys, base + ["--data-args-path", str(tmp_path / "blend.txt"), "--split", "90,8,2"])
    assert losses(from_file) == losses(direct) and evaluations(from_file) == evaluations(direct)
    (tmp_path / "splits.json").write_text(json.dumps({"train": " ".join(blend), "valid": [documents_prefix],
                                                      "test": documents_prefix}))
    direct = run(capsys, base + ["--train-data-path", *blend, "--valid-data-path", documents_prefix,
                                 "--test-data-path", documents_prefix])
    from_file = run(capsys, base + ["--per-split-data-args-path", str(tmp_path / "splits.json")])
    assert losses(from_file) == losses(direct) and evaluations(from_file) == evaluations(direct)
    assert len(evaluations(direct)) == 3


def test_a_missing_dataset_stops_before_the_model_is_built(capsys, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"--data-path: dataset {tmp_path}/missing_text_document: neither"):
        pretrain_gpt.main(TINY + ["--train-iters", "2", "--data-path", str(tmp_path / "missing_text_document")])
    assert "parameters on" not in capsys.readouterr().out


@pytest.mark.parametrize("mmap, mask", [(True, True), (False, False)])
def test_mmap_and_attention_mask_flags_reach_the_samples(tmp_path, documents_prefix, mmap, mask):
    from megatron.training.arguments import parse_args

    flags = TINY + ["--train-iters", "2", "--data-path", documents_prefix, "--reset-attention-mask",
                    "--data-cache-path", str(tmp_path)]
    flags += [] if mmap else ["--no-mmap-bin-files"]
    flags += [] if mask else ["--no-create-attention-mask-in-dataloader"]
    config = parse_args(flags)
    tokenizer = pretrain_gpt.build_tokenizer(config)
    train, _, _ = pretrain_gpt.datasets_provider(config, _OneRank(), (16, 0, 0), tokenizer, tokenizer.vocab_size)
    assert ("document_ids" in train[0]) is mask  # document-aware attention (no s x s mask is built)
    assert isinstance(train.indexed_dataset._bin, np.memmap) is mmap


class _OneRank:
    global_rank = 0


def test_exit_on_missing_checkpoint(capsys, tmp_path):
    from megatron.training.validation import ConfigError

    with pytest.raises(ConfigError, match=f"--load {tmp_path}: no checkpoint found .*--exit-on-missing-checkpoint"):
        pretrain_gpt.main(MOCK + ["--train-iters", "1", "--load", str(tmp_path), "--exit-on-missing-checkpoint"])
    assert "parameters on" not in capsys.readouterr().out
