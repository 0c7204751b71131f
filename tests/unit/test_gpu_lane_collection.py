"""The GPU lane runs `pytest -m gpu tests/gpu` (bench/gpu_check.sh), so a test that needs CUDA
anywhere else would never run on a GPU: every `gpu` mark and every CUDA skip is under tests/gpu."""
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
CUDA_ONLY = re.compile(r"pytest\.mark\.gpu|skipif\(\s*not torch\.cuda\.is_available\(\)")


def test_every_cuda_only_test_is_in_the_gpu_lane():
    outside = [str(path.relative_to(TESTS)) for path in TESTS.rglob("*.py")
               if path.parent.name != "gpu" and path.name != "test_gpu_lane_collection.py"
               and CUDA_ONLY.search(path.read_text())]
    assert not outside, f"tests needing CUDA outside tests/gpu (the lane never runs them): {outside}"
