"""The run's components: each owns one concern of a training run and is driven by the Trainer
(zerotrain.launcher.trainer) or a command. A component imports only the config layer (config,
profiles, model_spec, optimizers), errors, dataio and modeling, and other components; never the
run (run_plan, trainer) or a command."""
