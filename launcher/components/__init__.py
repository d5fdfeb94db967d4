"""The run's components: each owns one concern of a training run and is driven by the Trainer
(zerotrain.launcher.trainer) or a command. A component imports only the config layer (config,
profiles, model_spec, optimizers), errors, dataio and modeling, and other components; never the
run (run_plan, trainer) or a command.

Grouped by kind:
    checkpoints/   what a run leaves on disk to resume from: the format (checkpoint), the saver
                   (checkpointer), resume on another world size (universal), the run directory's lock (run_lock)
    observe/       watching a run: metrics sinks (metrics), the phase clock (phases), the hang watchdog
                   (watchdog), the speed check (health), golden steps (golden)
    launching/     starting ranks: the hostfile checks (hostfile), the restart policy (restarts), running a
                   job under DeepSpeed's launcher (jobs), the launcher's watch (launcher_watch); above
                   checkpoints/ and observe/, below the commands
    participants/  the step's monitors, each adding named fields to the step's one gather (base: the protocol)
    (here)         the rest of the step's machinery: the engine builder (engine), DeepSpeed's private names
                   (ds_compat), the process group, lr schedules (schedule), stop policies (guards), evaluation
                   (evaluate), test hooks (hooks), manifest.json (manifest), determinism, offload's ops and
                   NVMe checks (offload), a rank out of memory (oom)
The planner, beside these at the same layer, is launcher/planning/.
"""
