"""A tiny mixture-of-experts Llama trained with pretrain_gpt.py at several layouts (gloo, fp32, CPU,
no token dropping): the loss, the load-balancing loss and the gradient norm of every iteration equal
the single-process run's to rtol 1e-5. Expert parallelism with pipeline parallelism (plain and
interleaved) and with context parallelism is shown here, through the real schedules and data path,
and so is activation recomputation (--moe-layer-recompute, full recomputation: the auxiliary losses
are attached once, when the recomputed forward runs).
Exact values come from TensorBoard (float32 scalars, as computed)."""
import pytest

from tests.functional.test_pretrain_gpt import run_pretrain, tensorboard_scalars

MOE_LLAMA = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
    "--attention-dropout", "0", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
    "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--distributed-backend", "gloo",
    "--adam-eps", "1e-4", "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2",
    "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001", "--moe-layer-freq", "[0]*1+[1]*3",
    "--moe-token-dispatcher-type", "alltoall",
]
TAGS = ("lm loss", "load_balancing_loss", "z_loss", "grad-norm")
LAYOUTS = {
    "moe layer recompute": (1, ["--moe-layer-recompute"]),
    "full recompute": (1, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"]),
    "ep2": (2, ["--expert-model-parallel-size", "2"]),
    "ep2 pp2 distributed optimizer": (4, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                          "--use-distributed-optimizer"]),
    "ep2 pp2 interleaved": (4, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                "--num-layers-per-virtual-pipeline-stage", "1"]),
    "ep2 cp2": (4, ["--expert-model-parallel-size", "2", "--context-parallel-size", "2"]),
    # global_aux_loss counts expert loads over the data ranks and the step's micro-batches so far:
    # equal to one process only where the data-parallel size is 1.
    "tp2 sp global aux loss": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   "--moe-router-load-balancing-type", "global_aux_loss"]),
    "ep2 tp2 sp etp1 allgather": (4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                      "--sequence-parallel", "--expert-tensor-parallel-size", "1",
                                      "--moe-token-dispatcher-type", "allgather"]),
}


def _curves(tmp_path, name: str, nproc: int, extra: list) -> dict:
    directory = tmp_path / name.replace(" ", "_")
    done = run_pretrain(extra + ["--tensorboard-dir", str(directory)], nproc=nproc, base=MOE_LLAMA, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    tags = [tag.replace("load_balancing", "global_load_balancing") if "global_aux_loss" in extra else tag
            for tag in TAGS]
    return {tag: tensorboard_scalars(directory, real) for tag, real in zip(TAGS, tags)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _curves(tmp_path_factory.mktemp("moe_reference"), "one process", 1, [])


@pytest.fixture(scope="module")
def global_aux_reference(tmp_path_factory):
    return _curves(tmp_path_factory.mktemp("moe_reference_global"), "one process global", 1,
                   ["--moe-router-load-balancing-type", "global_aux_loss"])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layouts_match_one_process(request, tmp_path, name):
    nproc, extra = LAYOUTS[name]
    reference = request.getfixturevalue("global_aux_reference" if "global_aux_loss" in extra else "reference")
    got = _curves(tmp_path, name, nproc, extra)
    for tag in TAGS:
        assert sorted(got[tag]) == sorted(reference[tag]) == [1, 2, 3, 4], tag
        for iteration, value in reference[tag].items():
            assert got[tag][iteration] == pytest.approx(value, rel=1e-5), (tag, iteration)


def test_resume_at_other_expert_parallel_sizes(tmp_path):
    """Saved at EP2 x PP2 with the distributed optimizer (experts keyed by global index, optimizer
    state included), resumed at EP1 and at EP4: the later iterations equal the uninterrupted run's."""
    schedule = ["--train-iters", "6", "--lr-decay-iters", "6"]
    whole = _curves(tmp_path, "uninterrupted", 1, schedule)
    save = tmp_path / "checkpoints"
    first = run_pretrain(schedule + ["--exit-interval", "3", "--save", str(save), "--save-interval", "3",
                                     "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                     "--use-distributed-optimizer"], nproc=4, base=MOE_LLAMA, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    for name, nproc, layout in (("ep1", 1, []), ("ep4", 4, ["--expert-model-parallel-size", "4"])):
        resumed = _curves(tmp_path, f"resumed {name}", nproc, schedule + ["--load", str(save)] + layout)
        for tag in TAGS:
            assert sorted(resumed[tag]) == [4, 5, 6], (name, tag)
            for iteration in (4, 5, 6):
                assert resumed[tag][iteration] == pytest.approx(whole[tag][iteration], rel=1e-5), (name, tag, iteration)


def test_expert_bias_resumes(tmp_path):
    """Aux-loss-free balancing (sigmoid routing, expert bias updated every step): the bias is saved
    and restored, so a resumed run continues the uninterrupted one exactly."""
    options = ["--train-iters", "6", "--lr-decay-iters", "6", "--moe-router-score-function", "sigmoid",
               "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05"]
    whole = _curves(tmp_path, "uninterrupted", 1, options)
    save = tmp_path / "checkpoints"
    first = run_pretrain(options + ["--exit-interval", "3", "--save", str(save), "--save-interval", "3"],
                         base=MOE_LLAMA, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _curves(tmp_path, "resumed", 1, options + ["--load", str(save)])
    for iteration in (4, 5, 6):
        assert resumed["lm loss"][iteration] == pytest.approx(whole["lm loss"][iteration], rel=1e-6), iteration
