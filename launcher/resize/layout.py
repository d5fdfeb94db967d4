"""Resume on another world size, or at another --sequence-parallel N: the checkpoint's layout against this launch's
(before anything is built). The world size changes through DeepSpeed's universal checkpoint (universal.py, beside
this module); the data loader's states re-split over the new row groups in zerotrain.dataio.pipeline.reshard; the global
batch stays the checkpoint's (gradient accumulation absorbs the change). Moved here from launcher/run_plan.py.
"""
from __future__ import annotations

import json
from pathlib import Path

from zerotrain.dataio.pipeline.reshard import check_reshard
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.resize import universal


def resize_layout(ds_config: dict, resume_from: Path, meta: dict, world: int, sp: int, data_world: int, data,
                  saved_ds: Path, micro_given: bool = True) -> dict:
    """The DeepSpeed dict for resuming checkpoint `resume_from` (its `meta`) on `world` ranks at --sequence-parallel
    `sp` (`data_world` row groups); `saved_ds`: the run's saved ds_config.json; `micro_given`: --micro-batch was
    given (else the profile's may be lowered to keep the global batch). The same layout: `ds_config` as it is.
    UsageError (one line) for a change that cannot be resumed."""
    saved_sp = meta.get("sequence_parallel", 1)
    saved_data_world = meta["world_size"] // saved_sp  # the row groups that saved the loader states
    if meta["world_size"] != world and saved_sp != sp:  # universal load AND new row groups at once: untested
        raise UsageError(f"--sequence-parallel {sp}: checkpoint {resume_from} was saved by {meta['world_size']}"
                         f" rank(s) at --sequence-parallel {saved_sp}; a resume may change the world size or N,"
                         f" not both (resume at --sequence-parallel {saved_sp}, or on {meta['world_size']} ranks)")
    if meta["world_size"] != world:  # ZeRO state re-partitioned over all ranks, the data over the row groups
        ds_config = resume_on_new_world(ds_config, resume_from, saved_data_world, data_world, data, saved_ds,
                                        micro_given)
    elif saved_sp != sp:  # the same ranks and ZeRO partitions, other row groups: the data re-splits, the batch stays
        ds_config = keep_global_batch(ds_config, resume_from, saved_data_world, data_world, saved_ds, data,
                                      micro_given=micro_given)
    return ds_config


def resume_on_new_world(ds_config: dict, tag_dir: Path, saved_data_world: int, data_world: int, data,
                        saved_ds: Path, micro_given: bool = True) -> dict:
    """The DeepSpeed dict for resuming a checkpoint saved by another number of ranks.

    Model and optimizer go through DeepSpeed's universal checkpoint (launcher/resize/universal.py,
    converted on rank 0 at start-up; with sequence parallelism ZeRO partitions over every rank, so the
    conversion is the same); the data re-splits what the old row groups had left of the epoch
    (dataio/pipeline/reshard.py), from the checkpoint's `saved_data_world` row groups to `data_world` (without sequence
    parallelism, the world sizes). The global batch stays what it was: grad-accum absorbs the change.
    """
    check_reshard(data, saved_data_world, data_world)  # the data first: a streamed source is named before the stages
    universal.check_supported(ds_config, tag_dir)
    return universal.ds_config_for_universal(keep_global_batch(ds_config, tag_dir, saved_data_world, data_world,
                                                                saved_ds, data, checked=True, micro_given=micro_given))


def keep_global_batch(ds_config: dict, tag_dir: Path, saved_world: int, world: int, saved_ds: Path, data,
                      checked: bool = False, micro_given: bool = True) -> dict:
    """The DeepSpeed dict whose gradient accumulation keeps the checkpoint's global batch on `world`
    data-parallel ranks (row groups, with sequence parallelism), its data re-split from `saved_world`'s
    (`checked`: the caller has checked that re-split already). A micro-batch the profile gave (not --micro-batch,
    `micro_given`) that the global batch per rank does not divide is lowered to the largest that does: a run
    started on 1 rank at the profile's 8 grows to 2 at 4."""
    if not checked:
        check_reshard(data, saved_world, world)
    saved = json.loads(saved_ds.read_text()) if saved_ds.is_file() else None
    global_batch = saved["train_batch_size"] if saved else ds_config["train_batch_size"]
    micro = ds_config["train_micro_batch_size_per_gpu"]
    if global_batch % (micro * world) and global_batch % world == 0 and not micro_given:
        micro = max(d for d in range(1, micro + 1) if (global_batch // world) % d == 0)
    if global_batch % (micro * world):
        raise UsageError(f"checkpoint {tag_dir}: its global batch of {global_batch} rows cannot be kept on {world}"
                         f" rank(s) x --micro-batch {micro}; resume with --run-id {tag_dir.parent.parent.name} (another"
                         " --micro-batch is otherwise another run) and a --micro-batch that divides"
                         f" {global_batch // world}, or none (the profile's is lowered to one that does)"
                         if global_batch % world == 0 else
                         f"checkpoint {tag_dir}: its global batch of {global_batch} rows is not divisible by {world}"
                         " ranks")
    return {**ds_config, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": global_batch // (micro * world), "train_batch_size": global_batch}
