"""Python's cyclic garbage collector paused while a process starts, and back on (with the start-up frozen) once
its work begins.

A rank imports ~4,400 modules (torch, DeepSpeed, torch._dynamo, datasets), plans its run and builds its engine
before its first step; with the collector on, the young generations fill every few hundred allocations and each
full collection scans everything imported so far: a quarter of the import time (measured on a 2-core CPU host:
3.7 -> 2.7 CPU-s for `import zerotrain.launcher.train, deepspeed, torch._dynamo, datasets`), paid by every rank
at every start and restart. So:

- pause(): the entry points (launcher/train.py, the `zerotrain` command) turn collection off first thing;
- freeze(): once the imports and the plan are done, before the engine is built (Trainer.__init__), what they
  made is frozen (gc.freeze, the pattern CPython's documentation gives): no collection scans it again, not the
  `gc.collect()` DeepSpeed runs in a ZeRO-3 build (zero/utils.py defragment), which scanned all ~480,000 objects
  (0.40-0.45 CPU-s a rank). It is not collected first: what imports and planning leave in reference cycles is
  small (a 2-rank debug run: ~8,500 of ~483,000 objects, no tensors; a full collection to free it costs
  0.29-0.35 CPU-s a rank) and the model, its weights and any `--init-from` checkpoint are made after it;
- resume(): at the training loop (Trainer.train) or once a command is imported: one collection of what is not
  frozen (the engine build's garbage: a checkpoint's discarded tensors are freed here, never frozen), then
  gc.freeze() and collection on as usual.

Measured (a 2-rank debug run, 2 steps, on a 2-core CPU host; CPU-s in collections a rank, from gc.callbacks):
0.79-0.81 -> 0.33-0.35 at ZeRO-3 (DeepSpeed's collect 0.40-0.45 -> 0.19, ours 0.35 -> 0.15), 0.35-0.48 -> 0.17-0.18
at ZeRO-2. In-process use (a notebook, the Python API, pre-flight's scratch trainers) never pauses, so freeze()
and resume() do nothing there: a notebook's objects are never frozen.
"""
import gc

_paused = False


def pause() -> None:
    """Collection off for this process's start-up (an entry point calls it first thing)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def freeze() -> None:
    """Start-up's imports and plan are done: freeze them, collection still off. Nothing if not paused."""
    if _paused:
        gc.freeze()


def resume() -> None:
    """Start-up is over: collect what is not frozen, freeze what is left, collection on. Nothing if pause()
    was not called."""
    global _paused
    if _paused:
        _paused = False
        gc.collect()
        gc.freeze()
        gc.enable()
