"""Runs pretrain_gpt.py and kills the process (os._exit, as abrupt as kill -9: no cleanup, no
flush) inside the save of one iteration, at a chosen point:

    python crash_during_save.py <point> <iteration> <pretrain_gpt.py flags...>

points: mid-data (after the first tensor of the data files is written), after-data (data files and
index written, the commit not begun), at-rename (instead of renaming iter_N.incomplete to iter_N),
at-tracker (instead of replacing the tracker file). One point does not kill but fills the disk:
enospc (the second tensor written raises OSError ENOSPC, as a full disk does).
"""
import errno
import os
import runpy
import sys
from pathlib import Path

import torch.distributed.checkpoint.filesystem as dcp_filesystem

from megatron.core.checkpointing import storage

WHERE, ITERATION = sys.argv[1], int(sys.argv[2])
TARGET = f"iter_{ITERATION:07d}.incomplete"
real_save_state = storage.save_state
real_write_item = dcp_filesystem._write_item


def save_state_then_die(state, directory, **kwargs):
    if not directory.endswith(TARGET):
        return real_save_state(state, directory, **kwargs)
    if WHERE == "mid-data":
        def write_one_then_die(*args, **kw):
            real_write_item(*args, **kw)
            os._exit(9)
        dcp_filesystem._write_item = write_one_then_die
    if WHERE == "enospc":
        written = []

        def write_one_then_fill_the_disk(*args, **kw):
            if written:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written.append(real_write_item(*args, **kw))
        dcp_filesystem._write_item = write_one_then_fill_the_disk
        return real_save_state(state, directory, **kwargs)
    real_save_state(state, directory, **kwargs)
    os._exit(9)


def die_instead_of(real):
    def replacement(source, destination, *args, **kwargs):
        name = os.path.basename(str(source))
        if (WHERE == "at-rename" and name == TARGET) or (WHERE == "at-tracker" and name.startswith("latest_checkpointed")
                                                          and open(source).read() == str(ITERATION)):
            os._exit(9)
        return real(source, destination, *args, **kwargs)
    return replacement


if WHERE in ("mid-data", "after-data", "enospc"):
    storage.save_state = save_state_then_die
os.rename = die_instead_of(os.rename)
os.replace = die_instead_of(os.replace)
sys.argv = ["pretrain_gpt.py", *sys.argv[3:]]
runpy.run_path(str(Path(__file__).resolve().parents[2] / "pretrain_gpt.py"), run_name="__main__")
