"""Checkpoint save and load: time, bytes, how long an async save blocks training, and the checksums' share.

    python bench/bench_checkpoint.py --size tiny
    python bench/bench_checkpoint.py --size 1b --skip-async      # 0.85B parameters, fp32 + Adam: 10.2 GB on disk
    python bench/bench_checkpoint.py --size 350m                 # async vs sync (needs a second copy in memory)

One process on the CPU (or the current GPU). The model's weights and Adam moments are filled with
random values (a checkpoint of a trained model has the same size), then saved synchronously, loaded,
and saved asynchronously; the async figure is the time training waits (host copy) against the full
write. Reports the median of --repeats runs of each. The checksums' share: the time to checksum the
files just written (what a save adds) and to verify them (what a load adds), against the save and
the load.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron.core.checkpointing import checksums  # noqa: E402
from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.state import TrainState  # noqa: E402
from megatron.training.training import setup  # noqa: E402
from pretrain_gpt import forward_step  # noqa: E402

COMMON = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
          "--group-query-attention", "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
          "--micro-batch-size", "1", "--seq-length", "128", "--train-iters", "1", "--eval-iters", "0",
          "--distributed-backend", "gloo"]
SIZES = {
    "tiny": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--num-query-groups", "2",
             "--ffn-hidden-size", "96", "--vocab-size", "499"],
    "350m": ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--num-query-groups", "4",
             "--ffn-hidden-size", "2816", "--vocab-size", "31999"],
    "1b": ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "32", "--num-query-groups", "8",
           "--ffn-hidden-size", "5632", "--vocab-size", "31999"],
}


def build(size: str, directory: str):
    config = parse_args(COMMON + SIZES[size] + ["--save", directory])
    run = setup(config, forward_step, vocab_size=config.data.vocab_size + 1)
    for chunk in run.model.chunks:
        for buffer in chunk.buffers:  # gradients are not part of a checkpoint: free their memory
            buffer.grad_data = torch.empty(0)
    optimizer = run.model.optimizer
    optimizer.prepare_state_for_load(1)
    with torch.no_grad():
        for _, _, _, master in optimizer.state_regions():
            master.normal_()
            for key in optimizer.moment_keys():
                optimizer.optimizer.state[master][key].normal_()
    return run


def directory_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--skip-async", action="store_true", help="skip the async save (it needs a second copy)")
    args = parser.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_")
    run = build(args.size, os.path.join(root, "save"))
    params = sum(p.numel() for c in run.model.chunks for p in c.module.parameters())
    checkpointer = run.checkpointer
    save_times, load_times, blocked_times, async_totals, record_times, verify_times = [], [], [], [], [], []
    for repeat in range(args.repeats):
        shutil.rmtree(os.path.join(root, "save"), ignore_errors=True)
        state = TrainState(iteration=repeat + 1)
        start = time.perf_counter()
        checkpointer.save(run.model, state)
        save_times.append(time.perf_counter() - start)
        directory = os.path.join(root, "save", f"iter_{repeat + 1:07d}")
        size = directory_bytes(directory)
        from megatron.training.checkpointing import read_common

        start = time.perf_counter()
        checkpointer.load(run.model, directory, read_common(directory))
        load_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        recorded = checksums.gather(directory, None)
        record_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert checksums.first_mismatch(directory, recorded) is None
        verify_times.append(time.perf_counter() - start)
        if not args.skip_async:
            checkpointer.options.async_save = True
            start = time.perf_counter()
            checkpointer.save(run.model, TrainState(iteration=100 + repeat))
            blocked_times.append(time.perf_counter() - start)
            checkpointer.wait()
            async_totals.append(time.perf_counter() - start)
            checkpointer.options.async_save = False
    median = statistics.median
    print(f"model: {args.size}, {params / 1e6:.1f}M parameters (fp32 weights + Adam moments), device "
          f"{run.groups.device}, torch {torch.__version__}")
    print(f"checkpoint bytes: {size / 1e9:.3f} GB ({size / params:.2f} bytes/parameter)")
    print(f"sync save: {median(save_times):.2f} s ({size / 1e9 / median(save_times):.2f} GB/s)")
    print(f"load: {median(load_times):.2f} s ({size / 1e9 / median(load_times):.2f} GB/s)")
    print(f"checksums (crc32): recorded in {median(record_times):.2f} s ({median(record_times) / median(save_times):.0%} "
          f"of the sync save), verified in {median(verify_times):.2f} s ({median(verify_times) / median(load_times):.0%} "
          "of the load)")
    if blocked_times:
        print(f"async save: training blocked {median(blocked_times):.2f} s, written in {median(async_totals):.2f} s "
              f"(blocking {median(blocked_times) / median(save_times):.0%} of the sync save)")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
