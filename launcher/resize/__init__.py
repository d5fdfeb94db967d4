"""Resume on another world size (or at another --sequence-parallel N), in one room. Callers import the modules:

    layout      resize_layout(ds, tag_dir, meta, world, sp, data_world, data, saved_ds) -> ds: the checkpoint's
                layout against this launch's, before anything is built (run_plan); UsageError for what cannot be
                resumed
    universal   DeepSpeed's universal checkpoint: check_supported, convert_on_rank0 (rank 0 converts, the others
                wait), ds_config_for_universal, load (the Trainer, at start-up)

Beside it: the data loader's states re-split over the new row groups (zerotrain.dataio.pipeline.reshard, below the
launcher), and a rollback after a universal load reading its own checkpoint again
(launcher/components/ds_compat/checkpoint.py stop_loading_universal).
"""
