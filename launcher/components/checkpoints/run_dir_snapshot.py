"""What a refused start-up leaves of the run directory: nothing. A refusal found once the directory is written
(--init-from weights holding NaN, an older checkpoint's loader state, a conversion that fails) puts it back as it
was before the launch: a directory this launch created is removed; in an existing one, files this launch created
are removed, files it rewrote (config.json, manifest.json) get their bytes back, and logs it appended to
(metrics.jsonl, train.log) their length. Checkpoints are never touched (a start-up only reads them; a universal
conversion it wrote is new, so removed).

    snapshot = RunDirSnapshot.take(run_dir, existed)   rank 0, the lock held (no other process writes the
                                                       directory), before this launch writes it
    snapshot.restore()                                 rank 0, once the refusal is known and the lock released

Plain files: no torch.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

# Files up to this size are kept whole (they are rewritten in place: config.json, ds_config.json, manifest.json);
# larger ones by length only (logs a start-up appends to). A run directory's files outside its checkpoints are
# a few KiB to a few MiB.
KEEP_BYTES = 1 << 20


class RunDirSnapshot:
    def __init__(self, run_dir: Path, existed: bool, files: dict[str, tuple[int, bytes | None]],
                 dirs: set[str], out_existed: bool = True):
        self.run_dir, self.existed, self.files, self.dirs = run_dir, existed, files, dirs
        self.out_existed = out_existed

    @classmethod
    def take(cls, run_dir: Path, existed: bool = True, out_existed: bool = True) -> RunDirSnapshot:
        """`existed`: whether the directory was there before this launch made it (the lock's mkdir);
        `out_existed`: whether its parent (--out) was (an --out the launch made, left empty, goes too)."""
        run_dir = Path(run_dir)
        if not existed or not run_dir.is_dir():
            return cls(run_dir, False, {}, set(), out_existed)
        files, dirs = {}, set()
        for root, subdirs, names in os.walk(run_dir):
            rel_root = Path(root).relative_to(run_dir)
            dirs.update(str(rel_root / d) for d in subdirs)
            for name in names:
                path = Path(root) / name
                rel = str(rel_root / name)
                if rel_root.parts[:1] == ("checkpoints",) or path.is_symlink():
                    files[rel] = (-1, None)  # listed (never removed), never read
                    continue
                size = path.stat().st_size
                files[rel] = (size, path.read_bytes() if size <= KEEP_BYTES else None)
        return cls(run_dir, True, files, dirs)

    def restore(self) -> None:
        """Best effort: a file another process holds open or a permission lost is left as it is (the refusal's
        own line is what the user must see, not a second error about tidying up)."""
        if not self.existed:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            if not self.out_existed:
                with contextlib.suppress(OSError):  # not empty (another run, a finetune() mix): kept
                    self.run_dir.parent.rmdir()
            return
        if not self.run_dir.is_dir():
            return
        new_dirs = []
        for root, subdirs, names in os.walk(self.run_dir):
            rel_root = Path(root).relative_to(self.run_dir)
            new_dirs += [Path(root) / d for d in subdirs if str(rel_root / d) not in self.dirs]
            subdirs[:] = [d for d in subdirs if str(rel_root / d) in self.dirs]  # a new directory goes whole
            for name in names:
                path, rel = Path(root) / name, str(rel_root / name)
                try:
                    if rel not in self.files:
                        path.unlink()
                    else:
                        self._put_back(path, *self.files[rel])
                except OSError:
                    pass
        for path in new_dirs:
            shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def _put_back(path: Path, size: int, data: bytes | None) -> None:
        if size < 0:
            return
        if data is not None:
            if path.read_bytes() != data:
                tmp = path.with_name(path.name + ".restore")
                tmp.write_bytes(data)
                os.replace(tmp, path)
        elif path.stat().st_size > size:
            os.truncate(path, size)
