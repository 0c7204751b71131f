"""Checksummed checkpoints end to end (pretrain_gpt.py under torchrun, two gloo ranks): 4 KB
overwritten in the middle of a data file (its size unchanged) stops --load naming the file, the
iteration and the previous checkpoint, before any step; tools/checkpoint/verify.py finds the same
damage offline and passes the intact checkpoint."""
import os
import subprocess
import sys

import pytest

from tests.functional.test_pretrain_gpt import ROOT
from tests.functional.test_reliability import BASE, c10d, environment, ok, run_job, torchrun

VERIFY = [sys.executable, str(ROOT / "tools" / "checkpoint" / "verify.py")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of iterations 2 and 4 saved by a two-rank job."""
    checkpoint = tmp_path_factory.mktemp("checksums") / "ckpt"
    ok(run_job(["--save", str(checkpoint), "--save-interval", "2", "--train-iters", "4"]))
    return checkpoint


def _overwrite_middle(path, count: int = 4096) -> None:
    size = os.path.getsize(path)
    assert size > 2 * count, size
    with open(path, "r+b") as handle:
        handle.seek(size // 2)
        original = handle.read(count)
        handle.seek(size // 2)
        handle.write(bytes(255 - b for b in original))  # every byte changed, the size the same


def test_intact_checkpoints_verify_and_load(saved):
    result = subprocess.run(VERIFY + [str(saved), "--all"], capture_output=True, text=True, env=environment())
    assert result.returncode == 0, result.stderr
    assert [line.split(" (")[0] for line in result.stdout.splitlines()] == [
        f"ok: {saved / 'iter_0000002'}", f"ok: {saved / 'iter_0000004'}"]
    assert "checksums match" in result.stdout
    output = ok(run_job(["--load", str(saved), "--train-iters", "5"]))
    assert "loaded weights and optimizer state of iteration 4" in output


def test_a_corrupted_data_file_is_named_on_load_and_by_verify(saved, tmp_path):
    import shutil

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(saved, checkpoint)
    damaged = checkpoint / "iter_0000004" / "__1_0.distcp"
    _overwrite_middle(damaged)
    result = subprocess.run(torchrun(2, *c10d()) + BASE + ["--load", str(checkpoint), "--train-iters", "6"],
                            capture_output=True, text=True, timeout=300, env=environment())
    output = result.stdout + result.stderr
    assert result.returncode != 0
    expected = (f"error: the checkpoint of iteration 4 is damaged: {damaged} is corrupt: its crc32 is ")
    assert expected in output, output[-3000:]
    assert (f"load the previous checkpoint with --ckpt-step 2 ({checkpoint / 'iter_0000002'}), or restore the file "
            "from a copy") in output
    assert "loaded weights" not in output and " iteration        5/" not in output
    offline = subprocess.run(VERIFY + [str(checkpoint), "--all"], capture_output=True, text=True, env=environment())
    assert offline.returncode == 1
    assert offline.stdout.startswith(f"ok: {checkpoint / 'iter_0000002'} (")
    assert offline.stderr.startswith(expected)
