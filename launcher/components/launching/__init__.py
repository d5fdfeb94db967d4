"""Starting ranks: the checks before a multi-node launch (hostfile), the restart policy (restarts), running a
job under DeepSpeed's launcher and restarting it (jobs). Used by the launch, slurm, demo and finetune commands."""
