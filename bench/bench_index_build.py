"""Index building for a synthetic 10B-token, 10M-document dataset: seconds and peak memory.

    python bench/bench_index_build.py [--documents 10000000] [--tokens 10000000000] [--seq-length 4096]

Writes a real `.idx` with the given document sizes and a sparse `.bin` of the matching size (no
disk space used), then times `build_gpt_datasets` end to end (document, sample and shuffle
indices plus cache writes), once with the C++ helper and once with the numpy fallback, each in
a fresh subprocess so that peak RSS is its own. Also times reopening from the cache. The build's
CPU time is printed beside its wall time: on a machine shared with other jobs it varies less.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: E402


def write_synthetic_dataset(prefix: str, documents: int, tokens: int, seed: int = 0) -> int:
    """Document sizes uniform around tokens/documents; returns the exact token count."""
    rng = np.random.default_rng(seed)
    mean = tokens // documents
    sizes = rng.integers(1, 2 * mean, size=documents, dtype=np.int64)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.sequence_lengths.frombytes(sizes.tobytes())
    builder.document_indices.frombytes(np.arange(1, documents + 1, dtype=np.int64).tobytes())
    builder.finalize(prefix + ".idx")
    total = int(sizes.sum())
    os.truncate(prefix + ".bin", total * 2)  # sparse: the index builders never read tokens
    return total


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM; unlike ru_maxrss it is not inherited across exec)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(prefix: str, seq_length: int, num_samples: int, use_cpp: bool, cache: str) -> None:
    import warnings

    from megatron.core.datasets import GPTDatasetConfig, build_gpt_datasets, helpers

    warnings.simplefilter("ignore")
    baseline_mb = peak_rss_mb()
    if not use_cpp:
        helpers._cpp = None
    elif not helpers.cpp_available():
        print(json.dumps({"error": "C++ helper not built"}))
        return
    config = GPTDatasetConfig(seq_length=seq_length, seed=1234, data_path=[prefix], split="1,0,0", data_cache_path=cache)
    start, start_cpu = time.perf_counter(), time.process_time()
    train, _, _ = build_gpt_datasets(config, (num_samples, 0, 0))
    build_seconds, build_cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    start = time.perf_counter()
    again, _, _ = build_gpt_datasets(config, (num_samples, 0, 0), is_builder_rank=False)
    load_seconds = time.perf_counter() - start
    peak_mb = peak_rss_mb()
    print(json.dumps({"build_s": build_seconds, "build_cpu_s": build_cpu_seconds, "load_s": load_seconds, "samples": len(train), "epochs": train.num_epochs,
                      "peak_rss_mb": peak_mb, "baseline_rss_mb": baseline_mb}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=10_000_000)
    parser.add_argument("--tokens", type=int, default=10_000_000_000)
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--epochs", type=float, default=1.0, help="samples requested, in epochs")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        prefix, seq_length, num_samples, use_cpp, cache = args.child
        child(prefix, int(seq_length), int(num_samples), use_cpp == "cpp", cache)
        return
    with tempfile.TemporaryDirectory() as directory:
        prefix = os.path.join(directory, "synthetic")
        start = time.perf_counter()
        total = write_synthetic_dataset(prefix, args.documents, args.tokens)
        print(f"synthetic dataset: {args.documents:,} documents, {total:,} tokens (index written in "
              f"{time.perf_counter() - start:.1f} s, .bin sparse)")
        num_samples = int(args.epochs * (total - 1) // args.seq_length)
        for variant in ("cpp", "numpy"):
            cache = os.path.join(directory, f"cache-{variant}")
            output = subprocess.run([sys.executable, __file__, "--child", prefix, str(args.seq_length), str(num_samples),
                                     variant, cache], capture_output=True, text=True, check=True).stdout
            result = json.loads(output.strip().splitlines()[-1])
            if "error" in result:
                print(f"{variant}: {result['error']}")
                continue
            print(f"{variant:>5}: build {result['build_s']:.2f} s (CPU {result['build_cpu_s']:.2f} s), reload from cache {result['load_s']:.3f} s, "
                  f"{result['samples']:,} samples of {args.seq_length} ({result['epochs']} epoch(s)), "
                  f"peak RSS {result['peak_rss_mb']:.0f} MB (after imports {result['baseline_rss_mb']:.0f} MB)")


if __name__ == "__main__":
    main()
