"""Batch-size ramp-up, sample-based iteration counts and learning-rate schedules against
Megatron-Core's own calculator and scheduler (run in a subprocess, never imported here), and the
optimizer's parameter groups."""
import json
import textwrap

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.lr_scheduler import OptimizerParamScheduler
from megatron.core.optimizer.optimizer import param_groups
from megatron.training.arguments import parse_args
from megatron.training.state import BatchSchedule
from megatron.training.builders import lr_schedule_config
from tests.distributed.parity import llama_config

REFERENCE = textwrap.dedent("""
    import json, sys, types, warnings
    warnings.simplefilter("ignore")
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    spec = json.load(open(sys.argv[1]))
    report = {"ramps": [], "schedules": []}
    for ramp in spec["ramps"]:
        calculator = RampupBatchsizeNumMicroBatchesCalculator(
            ramp["global"], ramp["micro"], ramp["dp"], False, 0, *ramp["rampup"])
        sizes = []
        for consumed in ramp["consumed"]:
            calculator.update(consumed, consistency_check=True)
            sizes.append(calculator.get_current_global_batch_size())
        # Megatron-LM's update_train_iters: the ramp one iteration at a time, then whole batches.
        iterations = consumed = 0
        while consumed <= ramp["rampup"][2] and consumed <= ramp["train_samples"]:
            calculator.update(consumed, consistency_check=False)
            consumed += calculator.get_current_global_batch_size()
            iterations += 1
        if ramp["train_samples"] > consumed:
            iterations += (ramp["train_samples"] - consumed) // ramp["global"]
        report["ramps"].append({"sizes": sizes, "iterations": iterations})
    for schedule in spec["schedules"]:
        groups = [dict(group) for group in schedule["groups"]]
        optimizer = types.SimpleNamespace(param_groups=groups)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=schedule["init_lr"], max_lr=schedule["max_lr"], min_lr=schedule["min_lr"],
            lr_warmup_steps=schedule["warmup"], lr_decay_steps=schedule["decay"], lr_decay_style=schedule["style"],
            start_wd=0.1, end_wd=0.1, wd_incr_steps=schedule["decay"], wd_incr_style="constant",
            wsd_decay_steps=schedule["wsd"], lr_wsd_decay_style=schedule["wsd_style"])
        lrs = []
        for increment in schedule["increments"]:
            scheduler.step(increment)
            lrs.append([group["lr"] for group in groups])
        report["schedules"].append(lrs)
    json.dump(report, open(spec["output"], "w"))
""")

RAMPS = [  # global batch, micro-batch, data-parallel size, (start, increment, ramp samples), train samples
    (1536, 1, 8, (16, 16, 5859375), 50_000_000),   # Megatron-LM's GPT-3 175B ramp
    (64, 2, 2, (8, 4, 1000), 5000),
    (32, 4, 1, (4, 4, 100), 90),                   # training ends inside the ramp
    (48, 2, 3, (6, 42, 1), 500),                    # one increment, after one sample
]
TINY = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1", "--micro-batch-size", "2",
        "--seq-length", "4", "--lr", "0.01", "--min-lr", "0.001", "--mock-data", "--vocab-size", "8"]
SCHEDULES = [  # flags; global batch sizes of the steps
    (["--train-iters", "30", "--global-batch-size", "8", "--lr-warmup-iters", "5", "--lr-decay-style", "cosine",
      "--lr-decay-iters", "20", "--lr-warmup-init", "0.002"], [8] * 30),
    (["--train-iters", "30", "--global-batch-size", "8", "--lr-warmup-fraction", "0.13", "--lr-decay-style", "linear"],
     [8] * 30),
    (["--train-iters", "30", "--global-batch-size", "4", "--lr-decay-style", "inverse-square-root", "--lr-warmup-iters",
      "3", "--lr-decay-iters", "12"], [4] * 30),
    (["--train-samples", "400", "--global-batch-size", "16", "--lr-warmup-samples", "40", "--lr-decay-style", "WSD",
      "--lr-wsd-decay-samples", "120", "--lr-wsd-decay-style", "minus_sqrt", "--decoupled-lr", "0.05",
      "--decoupled-min-lr", "0.0005"], [4, 4, 8, 8, 12, 16] + [16] * 22),
    (["--train-samples", "300", "--global-batch-size", "8", "--lr-decay-samples", "250", "--lr-decay-style", "cosine",
      "--lr-warmup-fraction", "0.1", "--decoupled-lr", "0.03"], [8] * 37),
]


def _groups_of(config) -> list:
    """Param groups as our optimizer builds them (one decayed and one not, plus decoupled ones)."""
    model = GPTModel(llama_config(), parallel_state.single_process())
    optimizer_config = OptimizerConfig(lr=config.optimizer.lr, decoupled_lr=config.optimizer.decoupled_lr,
                                       decoupled_min_lr=config.optimizer.decoupled_min_lr)
    groups = param_groups(optimizer_config, [(p, p) for p in model.parameters()])
    return [{key: value for key, value in group.items() if key in ("max_lr", "min_lr")} for group in groups]


@pytest.fixture(scope="module")
def reference(megatron_core, tmp_path_factory):
    directory = tmp_path_factory.mktemp("schedules")
    schedules = []
    for flags, steps in SCHEDULES:
        config = parse_args(TINY + flags)
        lr_config = lr_schedule_config(config, int(flags[flags.index("--global-batch-size") + 1]))
        schedules.append({"groups": _groups_of(config), "init_lr": lr_config.init_lr, "max_lr": lr_config.max_lr,
                          "min_lr": lr_config.min_lr, "warmup": lr_config.warmup_steps, "decay": lr_config.decay_steps,
                          "style": lr_config.decay_style, "wsd": lr_config.wsd_decay_steps,
                          "wsd_style": lr_config.wsd_decay_style, "increments": steps})
    ramps = [{"global": g, "micro": m, "dp": d, "rampup": list(r), "train_samples": n,
              "consumed": sorted({0, 1, r[2] // 3, r[2] // 2, r[2], r[2] + 1, n}
                                 | set(range(0, 2 * r[2] + 64, max(7, r[2] // 997))))}
             for g, m, d, r, n in RAMPS]
    spec = {"ramps": ramps, "schedules": schedules, "output": str(directory / "report.json")}
    (directory / "spec.json").write_text(json.dumps(spec))
    (directory / "reference.py").write_text(REFERENCE)
    megatron_core(directory / "reference.py", directory / "spec.json")
    return spec, json.loads((directory / "report.json").read_text())


def test_rampup_batch_sizes_and_iterations_are_megatrons(reference):
    spec, report = reference
    for ramp, (global_batch, micro, dp, rampup, train_samples), expected in zip(spec["ramps"], RAMPS, report["ramps"]):
        schedule = BatchSchedule(global_batch, micro * dp, rampup)
        assert [schedule.global_batch_size_at(c) for c in ramp["consumed"]] == expected["sizes"], rampup
        assert schedule.iterations_for(train_samples) == expected["iterations"], rampup


def test_learning_rates_are_megatrons(reference):
    """Every param group's lr after each step, iteration- and sample-based, with --lr-warmup-init,
    --lr-warmup-fraction, inverse-square-root past its decay, WSD's minus_sqrt tail and decoupled
    embedding/output learning rates, over a batch-size ramp."""
    spec, report = reference
    assert len(report["schedules"]) == len(SCHEDULES)
    for (flags, steps), expected in zip(SCHEDULES, report["schedules"]):
        config = parse_args(TINY + flags)
        model = GPTModel(llama_config(), parallel_state.single_process())
        optimizer = torch.optim.SGD(param_groups(
            OptimizerConfig(lr=config.optimizer.lr, decoupled_lr=config.optimizer.decoupled_lr,
                            decoupled_min_lr=config.optimizer.decoupled_min_lr),
            [(p, p) for p in model.parameters()]), lr=config.optimizer.lr)
        scheduler = OptimizerParamScheduler(optimizer, lr_schedule_config(config, steps[-1]))
        got = []
        for increment in steps:
            scheduler.step(increment)
            got += [group["lr"] for group in optimizer.param_groups]
        assert got == pytest.approx([lr for step in expected for lr in step], rel=1e-12, abs=1e-15), flags


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("keep_empty", [False, True])
def test_param_groups_hold_every_parameter_once(decoupled, keep_empty):
    model = GPTModel(llama_config(untie_embeddings_and_output_weights=True), parallel_state.single_process())
    config = OptimizerConfig(weight_decay=0.1, decoupled_lr=0.5 if decoupled else None)
    groups = param_groups(config, [(p, p) for p in model.parameters()], keep_empty=keep_empty)
    grouped = [id(p) for group in groups for p in group["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())
    own = [group for group in groups if "max_lr" in group]
    vocabulary = {id(model.embedding.word_embeddings.weight), id(model.output_layer)}
    assert {id(p) for group in own for p in group["params"]} == (vocabulary if decoupled else set())
    for group in groups:
        assert group["weight_decay"] == (0.1 if all(p.ndim > 1 for p in group["params"]) and group["params"] else
                                         group["weight_decay"])
        assert all(p.ndim > 1 for p in group["params"]) or group["weight_decay"] == 0.0
