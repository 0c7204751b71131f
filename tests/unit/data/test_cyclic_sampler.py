"""--dataloader-type cyclic: the order of Megatron-LM's own `MegatronPretrainingRandomSampler` (its
source compiled in a subprocess by megatron_lm_sampler.py), over dataset sizes, micro-batch and
data-parallel sizes, both data-sharding modes and several epochs; a resume mid-epoch continues it
exactly; and the training loader reads it epoch after epoch.

The orders Megatron-LM's sampler gives are also kept as data (megatron_lm_cyclic_orders.json, from
Megatron-LM at the commit named in it), so the comparison runs without a Megatron-LM checkout; with
one (MEGATRON_LM_REF), the live orders are compared too. Regenerate the file with
`MEGATRON_LM_REF=DIR python -m tests.unit.data.test_cyclic_sampler COMMIT`."""
import itertools
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.training.data import CyclicSampler, build_loader, endless
from tests.optional import require_megatron_lm

REFERENCE = os.path.join(os.path.dirname(__file__), "megatron_lm_sampler.py")
STORED_ORDERS = os.path.join(os.path.dirname(__file__), "megatron_lm_cyclic_orders.json")
# (samples, micro-batch, data-parallel size, data sharding): sizes that divide evenly and sizes that
# leave a partial step at the end of each epoch.
SHAPES = [(64, 2, 1, True), (64, 2, 4, True), (70, 3, 2, True), (101, 4, 3, True),
          (64, 2, 4, False), (70, 3, 2, False), (33, 1, 4, False), (57, 2, 2, False)]


def _cases() -> list:
    cases = []
    for total, micro, dp, sharding in SHAPES:
        step = micro * dp
        per_epoch = (total // step) * step
        for consumed in (0, step, per_epoch + 2 * step, 3 * per_epoch):  # start, mid-epoch, later epochs
            cases.append(dict(total=total, micro_batch_size=micro, dp=dp, data_sharding=sharding, consumed=consumed,
                              batches=3 * total // step + 2))
    return cases


def _ours(case: dict, rank: int) -> list:
    sampler = CyclicSampler(case["total"], case["consumed"], case["micro_batch_size"], rank, case["dp"],
                            case["data_sharding"])
    return list(itertools.islice(itertools.chain.from_iterable(iter(sampler) for _ in itertools.count()),
                                 case["batches"]))


def _run_megatron_lm(source: str, workdir) -> list:
    """Megatron-LM's orders for _cases(), from its sampler's source file, in a subprocess."""
    cases_file = os.path.join(workdir, "cases.json")
    with open(cases_file, "w") as f:
        json.dump(_cases(), f)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, REFERENCE, source, cases_file], capture_output=True, text=True,
                            env=env, cwd=workdir, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def _assert_orders_equal(megatron_lm_orders: list):
    cases = _cases()
    assert len(megatron_lm_orders) == len(cases)
    for case, reference in zip(cases, megatron_lm_orders):
        for rank in range(case["dp"]):
            assert _ours(case, rank) == reference[rank], f"{case}, data-parallel rank {rank}"


def test_order_equals_megatron_lm_stored_orders():
    with open(STORED_ORDERS) as f:
        stored = json.load(f)
    assert stored["cases"] == _cases(), "the stored orders were made for other cases: regenerate them"
    _assert_orders_equal(stored["orders"])


def test_order_equals_megatron_lm_live(tmp_path):
    source = require_megatron_lm("megatron/training/datasets/data_samplers.py")
    _assert_orders_equal(_run_megatron_lm(source, str(tmp_path)))


@pytest.mark.parametrize("total, micro, dp, sharding", SHAPES)
def test_resume_mid_epoch_continues_the_uninterrupted_order(total, micro, dp, sharding):
    step = micro * dp
    full = dict(total=total, micro_batch_size=micro, dp=dp, data_sharding=sharding, consumed=0, batches=4 * total // step)
    for stop in (1, total // step - 1, total // step + 1):  # in the first epoch, at its end, in the second
        resumed = dict(full, consumed=stop * step, batches=full["batches"] - stop)
        for rank in range(dp):
            assert _ours(resumed, rank) == _ours(full, rank)[stop:], f"resumed after {stop} steps, rank {rank}"


def test_each_epoch_is_a_fresh_permutation_of_the_rank_buckets():
    total, micro, dp = 48, 2, 3
    per_rank = total // dp
    for rank in range(dp):
        epochs = np.array(_ours(dict(total=total, micro_batch_size=micro, dp=dp, data_sharding=True, consumed=0,
                                     batches=3 * per_rank // micro), rank)).reshape(3, per_rank)
        for epoch in epochs:  # the rank's own contiguous bucket, each sample once
            assert sorted(epoch) == list(range(rank * per_rank, (rank + 1) * per_rank))
        assert not (epochs[0] == epochs[1]).all() and not (epochs[1] == epochs[2]).all()


def test_the_training_loader_reads_epoch_after_epoch():
    """build_loader + endless, as training runs it: the dataset's samples in the sampler's order."""
    dataset = [{"tokens": np.array([index])} for index in range(10)]
    groups = SimpleNamespace(dp_rank=1, dp_size=2, device=torch.device("cpu"))
    loader = build_loader(dataset, 4, 2, groups, 0, dataloader_type="cyclic")
    got = [batch["tokens"][:, 0].tolist() for batch in itertools.islice(endless(loader), 5)]
    want = _ours(dict(total=10, micro_batch_size=2, dp=2, data_sharding=True, consumed=4, batches=5), rank=1)
    assert got == want


def test_a_dataset_smaller_than_one_step_is_an_error_naming_the_sizes():
    with pytest.raises(ValueError, match=r"the dataset has 3 samples, fewer than one step of --micro-batch-size \(2\) "
                                         r"x data-parallel size \(2\) = 4"):
        CyclicSampler(3, 0, 2, 0, 2)


if __name__ == "__main__":  # regenerate megatron_lm_cyclic_orders.json from a Megatron-LM checkout
    import tempfile

    checkout = os.environ["MEGATRON_LM_REF"]
    with tempfile.TemporaryDirectory() as workdir:
        orders = _run_megatron_lm(os.path.join(checkout, "megatron/training/datasets/data_samplers.py"), workdir)
    with open(STORED_ORDERS, "w") as f:
        json.dump({"source": "NVIDIA Megatron-LM megatron/training/datasets/data_samplers.py",
                   "commit": sys.argv[1], "cases": _cases(), "orders": orders}, f)
        f.write("\n")
