"""Runs tools/preprocess_data.py with one step held until a file exists, so that a test can press
Ctrl-C while the tool is certainly in that step, with no timing involved.

    python held_preprocess.py STEP RELEASE_FILE <preprocess_data.py arguments>

The first process to reach STEP writes `held STEP` to stderr; every process reaching it waits there
until RELEASE_FILE exists, then carries on unchanged.
"""
import os
import sys
import time

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, os.pardir, "tools")
sys.path.insert(0, os.path.abspath(TOOLS))

import preprocess_data as tool  # noqa: E402

STEP, RELEASE = sys.argv[1], sys.argv[2]


def held(function):
    def wrapper(*args, **kwargs):
        sys.stderr.write(f"held {STEP}\n")
        sys.stderr.flush()
        while not os.path.exists(RELEASE):
            time.sleep(0.01)
        return function(*args, **kwargs)
    return wrapper


# Each step: where it is held (the pool is forked after this patching, so workers hold too).
if STEP == "worker-start":
    tool._worker_init = held(tool._worker_init)
elif STEP == "worker-encode":
    tool.Encoder.encode = held(tool.Encoder.encode)
elif STEP == "main-write":
    tool.IndexedDatasetBuilder.add_documents = held(tool.IndexedDatasetBuilder.add_documents)
elif STEP == "merge":
    tool.IndexedDatasetBuilder.add_index = held(tool.IndexedDatasetBuilder.add_index)
elif STEP == "finalize":
    tool.IndexedDatasetBuilder.finalize = held(tool.IndexedDatasetBuilder.finalize)
else:
    raise SystemExit(f"unknown step {STEP}")
sys.exit(tool.main(sys.argv[3:]))
