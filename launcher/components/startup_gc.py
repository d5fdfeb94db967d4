"""Python's cyclic garbage collector paused while a process starts, and back on (with the start-up frozen) once
its work begins.

A rank imports ~4,400 modules (torch, DeepSpeed, torch._dynamo, datasets) and builds an engine before its first
step; with the collector on, the young generations fill every few hundred allocations and each full collection
scans everything imported so far: a quarter of the import time (measured on a 2-core CPU host: 3.7 -> 2.7
CPU-s for `import zerotrain.launcher.train, deepspeed, torch._dynamo, datasets`), paid by every rank at every
start and restart. The entry points (launcher/train.py, the `zerotrain` command) call pause() first; the
training loop (Trainer.train) or the command, once imported, calls resume(): one full collection (what start-up
left in reference cycles is freed, not kept), then gc.freeze() (what is left lives as long as the process: the
collector no longer scans it), then collection on as usual. In-process use (a notebook, the Python API) never
pauses, so resume() does nothing there: a notebook's objects are never frozen.
"""
import gc

_paused = False


def pause() -> None:
    """Collection off for this process's start-up (an entry point calls it first thing)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Start-up is over: collect once, freeze what is left, collection on. Nothing if pause() was not called."""
    global _paused
    if _paused:
        _paused = False
        gc.collect()
        gc.freeze()
        gc.enable()
