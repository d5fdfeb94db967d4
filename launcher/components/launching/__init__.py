"""Starting ranks: the checks before a multi-node launch (hostfile), the restart policy (restarts), running a
job under DeepSpeed's launcher and restarting it (jobs), each rank's watch on the launcher that started it
(launcher_watch). Used by the launch, slurm, demo and finetune commands."""
