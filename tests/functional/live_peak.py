"""Runs pretrain_gpt.py's main (under torchrun or alone) while counting the bytes held by live
tensors, and prints this rank's peak: `live tensor peak (rank R): N bytes`."""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)))

import pretrain_gpt  # noqa: E402
from megatron.training.memory import LiveTensorBytes  # noqa: E402

if __name__ == "__main__":
    with LiveTensorBytes() as counter:
        pretrain_gpt.main(sys.argv[1:])
    print(f"live tensor peak (rank {os.environ.get('RANK', '0')}): {counter.peak} bytes", flush=True)
