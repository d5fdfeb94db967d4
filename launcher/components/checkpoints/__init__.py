"""Checkpoints: the on-disk format (checkpoint), the Checkpointer that saves and loads (checkpointer) and the run
directory's lock (run_lock). A resume on another world size is launcher/resize/."""
