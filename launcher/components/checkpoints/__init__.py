"""Checkpoints: the on-disk format (checkpoint), the Checkpointer that saves and loads (checkpointer), resume
on another world size (universal) and the run directory's lock (run_lock)."""
