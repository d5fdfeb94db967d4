"""ZeRO-Offload (--offload optimizer|all, --nvme-path), in one room. Callers import the two modules:

    keys    (config layer) offload_settings(cfg, profile, name) -> (offload, nvme_path, source);
            apply_offload(ds, offload, nvme, source) -> ds; check_offload(zero, where); offloads_any(zero)
    ops     (components layer) check_offload_here(ds, model_args, world, dry_run): NVMe directory, libaio, room;
            ops_needed / describe / describe_builds (the JIT-built ops); check_resume(ds, tag_dir); offloaded(ds)

Beside it, each in the room of its kind: the host memory and traffic the planner gives an offloaded run
(launcher/planning/host.py), DeepSpeed's private offload state and its NVMe swap files
(launcher/components/ds_compat/offload.py), the setting itself (launcher/settings.py's table) and DeepSpeed's CPU
Adam chosen under offload (launcher/optimizers.py, the optimizer registry).
"""
