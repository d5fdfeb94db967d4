"""Rules the code keeps, read from the source (AST and text, nothing run): each guards a leftover that was
cleaned up from coming back.

- DeepSpeed's shared-memory buffer name is spelled in launcher/components/ds_compat.py only (tests and
  benchmarks list leaked buffers with `ds_compat.allreduce_buffer_files`).
"""
from __future__ import annotations

from test_architecture import _sources

DS_COMPAT = "launcher/components/ds_compat.py"


def test_the_shm_buffer_name_is_spelled_in_ds_compat_only():
    name = "deepspeed_allreduce" + "_buffer"  # spelled in two halves: this file is a source too
    bad = [where for where, text in _sources() if name in text and where != DS_COMPAT]
    assert not bad, f"DeepSpeed's shm buffer name outside {DS_COMPAT} (use ds_compat.allreduce_buffer_files): {bad}"
