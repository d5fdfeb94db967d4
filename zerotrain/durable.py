"""The one durable atomic write, for every file the project reads back (run directory JSON, checkpoint
markers, best.json, the lock's neighbours, pre-flight reports, shard manifests).

    write_json(path, obj)    JSON (indent 2, a final newline)
    write_text(path, text)   any text (DeepSpeed's `latest`, a cache)
    write_bytes(path, data)  any bytes (a cached .npy: zerotrain.dataio.format.tokenfile)
    fsync_dir(path)          after a rename done by hand (a directory moved into place)

A reader, or a crash (kill -9, a node losing power) at any moment, sees the old file or the new one,
never a torn or empty one: the data goes to a temporary file in the same directory (a rename across
filesystems is not atomic), is fsynced, renamed over `path`, and the directory is fsynced so that the
rename itself survives a power loss. The temporary name is unique per call (pid and a random part:
two threads, two processes, or two hosts on a shared filesystem may write the same file at once; the
last rename wins, whole) and starts with "." so that globs of a run's files never see it. The file is
created with open()'s default mode, so the umask applies, as for every other file of the run
(tempfile.mkstemp would make it 0600).

In the root package, importing nothing of the project: dataio (shards) and launcher both use it.
"""
from __future__ import annotations

import errno
import json
import os
import secrets
from pathlib import Path


def write_text(path: str | os.PathLike, text: str) -> None:
    """Replace `path` with `text` (UTF-8), durably and atomically (see the module docstring)."""
    write_bytes(path, text.encode("utf-8"))


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` with `data`, durably and atomically (see the module docstring)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:  # "x": never write into a file another writer created
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json(path: str | os.PathLike, obj, *, indent: int | None = 2, sort_keys: bool = False,
               default=None) -> None:
    """`obj` as JSON (a final newline), durably and atomically."""
    write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys, default=default) + "\n")


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename (or a create) inside directory `path` survive a power loss.

    Some filesystems (a few network and FUSE mounts) refuse fsync on a directory: there the rename
    is as durable as the filesystem makes it, and refusing to write would help nobody."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)
