"""The run's components: each owns one concern of a training run and is driven by the Trainer
(zerotrain.launcher.trainer) or a command. A component imports only the config layer (config,
settings, profiles, model_spec, optimizers, ...), errors and ends, dataio and modeling, and its own layer (other
components, the planner, the feature rooms); never the run (resolution, run_plan, trainer) or a command.

Grouped by kind:
    checkpoints/   what a run leaves on disk to resume from: the format (checkpoint), the saver
                   (checkpointer), the run directory's lock (run_lock)
    observe/       watching a run: metrics sinks (metrics), the phase clock (phases), the hang watchdog
                   (watchdog), the speed check (health), golden steps (golden), a profiler's summary (torch_profile)
    launching/     starting ranks: the hostfile checks (hostfile), the restart policy (restarts), running a
                   job under DeepSpeed's launcher (jobs), the launcher's watch (launcher_watch); above
                   checkpoints/ and observe/, below the commands
    participants/  the step's monitors, each adding named fields to the step's one gather (base: the protocol)
    tasks/         --eval-tasks: sharding and scoring over ranks (__init__), lm-evaluation-harness's LM (lm)
    ds_compat/     every DeepSpeed private name, a part per concern (checkpoint, offload, sequence, launching,
                   zero), each listing its names for the version check
    (here)         the rest of the step's machinery: the engine builder (engine), the process group, lr schedules
                   (schedule), stop policies (guards), evaluation (evaluate), test hooks (hooks), manifest.json
                   (manifest), determinism, a rank out of memory (oom)
Beside these at the same layer: the planner (launcher/planning/) and the feature rooms launcher/offload/ (ZeRO-Offload),
launcher/sequence/ (sequence parallelism) and launcher/resize/ (a resume on another world size).
"""
