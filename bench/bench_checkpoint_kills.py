"""kill -9 torchrun jobs at random moments and check that the latest checkpoint always loads.

    python bench/bench_checkpoint_kills.py --trials 20            # 2 gloo processes per job, CPU

Each trial starts `torchrun pretrain_gpt.py` (a tiny Llama, distributed optimizer over 2 ranks,
a save every --save-interval iterations, synchronous or --async-save on alternate trials), waits a
random time, and kills the whole job with SIGKILL (the agent and every worker, as a node failure
would). It then reads the tracker's checkpoint completely (index, every data file, common.json) and
resumes from it for one iteration. It reports how many kills landed inside a save, how many
checkpoints failed to load (must be 0) and the most iterations lost to a kill (at most one save
interval plus the iteration in flight).
"""
import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention",
         "--num-query-groups", "2", "--ffn-hidden-size", "96", "--seq-length", "32", "--micro-batch-size", "1",
         "--global-batch-size", "8", "--lr", "1e-3", "--normalization", "RMSNorm", "--swiglu",
         "--position-embedding-type", "rope", "--disable-bias-linear", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "500", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
         "--distributed-backend", "gloo", "--use-distributed-optimizer", "--train-iters", "100000"]


def torchrun(extra: list) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "localhost:0", str(ROOT / "pretrain_gpt.py"), *FLAGS, *extra]


def trial(index: int, root: Path, rng: random.Random, save_interval: int) -> dict:
    checkpoint = root / f"trial{index}"
    asynchronous = index % 2 == 1
    extra = ["--save", str(checkpoint), "--save-interval", str(save_interval)] + (["--async-save"] if asynchronous else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    log = root / f"trial{index}.log"
    with open(log, "w") as handle:
        process = subprocess.Popen(torchrun(extra), stdout=handle, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        deadline = time.time() + 300
        while "iteration        1/" not in log.read_text(errors="replace"):  # past start-up
            if time.time() > deadline or process.poll() is not None:
                raise RuntimeError(f"trial {index} did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
        time.sleep(rng.uniform(0.0, 6.0))
        os.killpg(process.pid, signal.SIGKILL)  # the agent and the workers (torchrun starts them in new sessions)
        process.wait()
        for line in subprocess.run(["pgrep", "-f", str(checkpoint)], capture_output=True, text=True).stdout.split():
            os.kill(int(line), signal.SIGKILL)
    text = log.read_text(errors="replace")
    logged = [int(m) for m in re.findall(r" iteration +(\d+)/", text)]
    in_save = any(name.endswith(".incomplete") for name in os.listdir(checkpoint)) if checkpoint.exists() else False
    outcome = {"async": asynchronous, "killed_at": max(logged, default=0), "in_save": in_save}
    outcome.update(check(checkpoint, env))
    return outcome


def check(checkpoint: Path, env: dict) -> dict:
    from megatron.core.checkpointing.storage import read_full_tensors
    from megatron.training.checkpointing import checkpoint_dir, read_common, read_tracker

    if not (checkpoint / "latest_checkpointed_iteration.txt").exists():
        return {"saved": 0, "loads": True, "resumes": None}
    iteration = read_tracker(str(checkpoint))
    directory = checkpoint_dir(str(checkpoint), iteration)
    try:
        read_common(directory)
        read_full_tensors(directory)
        loads = True
    except Exception as error:  # reported, not raised: the point is to count these
        print(f"  checkpoint {directory} failed to load: {error}")
        loads = False
    resume = subprocess.run(torchrun(["--load", str(checkpoint), "--train-iters", str(iteration + 1)]),
                            capture_output=True, text=True, env=env, timeout=600)
    return {"saved": iteration, "loads": loads, "resumes": resume.returncode == 0}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--save-interval", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="bench_kills_") as root:
        for index in range(args.trials):
            outcome = trial(index, Path(root), rng, args.save_interval)
            outcomes.append(outcome)
            print(f"trial {index:2d} ({'async' if outcome['async'] else 'sync '}): killed after iteration "
                  f"{outcome['killed_at']:3d}{' inside a save' if outcome['in_save'] else ''}; tracker at "
                  f"{outcome['saved']:3d}; loads: {outcome['loads']}; resumes: {outcome['resumes']}", flush=True)
    lost = [o["killed_at"] - o["saved"] for o in outcomes]
    print(f"{len(outcomes)} kills ({sum(o['in_save'] for o in outcomes)} inside a save): "
          f"{sum(not o['loads'] for o in outcomes)} checkpoints failed to load, "
          f"{sum(o['resumes'] is False for o in outcomes)} failed to resume; at most {max(lost)} iterations lost "
          f"(save interval {args.save_interval})")


if __name__ == "__main__":
    main()
