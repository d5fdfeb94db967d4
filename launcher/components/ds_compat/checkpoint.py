"""DeepSpeed's checkpoint internals: every rank's save fails together (the write guard), and a rollback after
a resume on another world size (a universal load) reads its own checkpoint again (deepspeed/runtime/engine.py)."""
from __future__ import annotations

from zerotrain.launcher.components.ds_compat.names import PrivateName

# the DeepSpeed names this part relies on (ds_compat.PRIVATE_NAMES gathers them; check_deepspeed_version)
NAMES = (
    PrivateName("deepspeed.runtime.engine", "DeepSpeedEngine._copy_recovery_script",
                "a failed checkpoint write on one rank fails the save on every rank (no hang)", True),
    PrivateName("deepspeed.runtime.engine", "DeepSpeedEngine.save_checkpoint",
                "a failed checkpoint write on one rank fails the save on every rank (no hang)", True,
                source_has="self.checkpoint_engine.makedirs"),
    PrivateName("deepspeed.runtime.engine", "DeepSpeedEngine.load_universal_checkpoint",
                "a rollback after a resume on another world size loads its own checkpoint", True,
                source_has="self._config.load_universal_checkpoint"),
)


def route_checkpoint_writes(engine, guard) -> None:
    """Send every file write of `engine.save_checkpoint` through `guard` (components/checkpoints/checkpointer.py's
    _WriteGuard, which has the checkpoint engine's interface).

    Matches deepspeed/runtime/engine.py (0.19.8): save_checkpoint, _save_checkpoint,
    _save_zero_checkpoint and _create_checkpoint_file write only through `self.checkpoint_engine`
    (makedirs, save); rank 0 also copies the recovery scripts with `self._copy_recovery_script(save_path)`
    (a shutil.copyfile outside the checkpoint engine), which is wrapped here.
    """
    engine.checkpoint_engine = guard
    copy_scripts = getattr(engine, "_copy_recovery_script", None)
    if copy_scripts is not None:
        engine._copy_recovery_script = lambda save_path: guard.run(copy_scripts, save_path)


def stop_loading_universal(engine) -> None:
    """After a universal resume: later load_checkpoint calls of this engine (a rollback to one of our
    own same-world tags) read the regular layout again.

    Matches deepspeed/runtime/engine.py (0.19.8): DeepSpeedEngine.load_universal_checkpoint() returns
    `self._config.load_universal_checkpoint`, read only inside load_checkpoint and _load_checkpoint.
    """
    engine._config.load_universal_checkpoint = False
