"""zerotrain/durable.py, the one durable atomic write: data fsynced before the rename, the directory after it,
a unique temporary name per call (concurrent writers never mix their bytes), nothing left behind on failure,
the umask's mode."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from zerotrain import durable


def test_write_json_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    order = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        order.append(("fsync dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync file"))
        real_fsync(fd)

    def replace(src, dst):
        order.append("rename")
        assert Path(src).parent == Path(dst).parent and Path(src).name.startswith(".")  # same directory, hidden
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "config.json"
    durable.write_json(path, {"a": 1})
    assert order == ["fsync file", "rename", "fsync dir"]
    assert path.read_text() == '{\n  "a": 1\n}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_concurrent_writers_leave_one_whole_file(tmp_path):
    path = tmp_path / "manifest.json"
    payloads = [{"writer": i, "pad": "x" * 200_000} for i in range(8)]
    threads = [threading.Thread(target=durable.write_json, args=(path, p)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert json.loads(path.read_text()) in payloads  # one writer's bytes, whole: no shared temporary file
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "best.json"
    durable.write_json(path, {"tag": "global_step1"})
    with pytest.raises(TypeError):
        durable.write_json(path, {"not json": object()})
    assert json.loads(path.read_text()) == {"tag": "global_step1"}
    assert [p.name for p in tmp_path.iterdir()] == ["best.json"]


def test_the_umask_decides_the_mode(tmp_path):
    old = os.umask(0o022)
    try:
        durable.write_text(tmp_path / "latest", "global_step3")
    finally:
        os.umask(old)
    assert (tmp_path / "latest").stat().st_mode & 0o777 == 0o644  # mkstemp would have made it 0600
