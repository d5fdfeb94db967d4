"""Checkpoints are DeepSpeed's own (`engine.save_checkpoint`, tags `global_stepN`).

After every rank has written its part, rank 0 adds `zerotrain.json` to the tag directory: the
marker that the checkpoint is complete, with the step, token count and world size in plain
JSON, so a resume can be checked before anything is built or unpickled. Everything the loop and
the data need to continue travels in DeepSpeed's `client_state`.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch.distributed as dist

MARKER = "zerotrain.json"
TAG = re.compile(r"^global_step(\d+)$")


def tag_for(step: int) -> str:
    return f"global_step{step}"


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoint tag directories, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir()
             if (m := TAG.match(p.name)) and (p / MARKER).is_file()]
    return [p for _, p in sorted(found)]


def read_meta(tag_dir: Path) -> dict:
    return json.loads((tag_dir / MARKER).read_text())


def save(engine, ckpt_dir: Path, step: int, client_state: dict, meta: dict) -> Path:
    tag = tag_for(step)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state)
    dist.barrier()
    if dist.get_rank() == 0:
        (ckpt_dir / tag / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    dist.barrier()
    return ckpt_dir / tag


def load(engine, tag_dir: Path) -> dict:
    """Load a complete checkpoint into the engine; returns the client_state."""
    path, client_state = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {tag_dir}")
    return client_state
