"""Ulysses sequence parallelism (--sequence-parallel N: N ranks share each row), in one room. Callers import the
modules:

    checks   (torch-free) check_sequence_parallel_plan(cfg, settings, model_args, world): N against the launch and
             the model, one line before anything is written (the one resolution, pre-flight)
    groups   sequence_groups(N) -> (mpu, exchange); sequence_shard(N, model_args, exchange_phase) -> (mpu,
             SequenceShard) for the engine builder; with_gradient_factor(shard, engine) once the engine is built

Beside it, each in the room of its kind: the model's side (modeling/model.py SequenceShard and the exchange around
attention; modeling/sizes.py check_sequence_parallel), the planner's (launcher/planning/sequence.py: the
all-to-all's bytes and time), DeepSpeed's private names (launcher/components/ds_compat/sequence.py), the setting
(launcher/settings.py) and a resume at another N (launcher/resize/layout.py).
"""
