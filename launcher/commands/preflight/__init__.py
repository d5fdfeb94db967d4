"""Pre-flight: staged checks before a long run (`zerotrain preflight`).

    zerotrain preflight --stage v1|v2|v3[,v2,...] [--steps N] [--sweep 4,8,16] [--sweep-steps K]
                        [--loader-seconds S] TRAIN-FLAGS
    deepspeed --num_gpus 8 --module zerotrain.launcher.commands.preflight --stage v1 TRAIN-FLAGS
                                          (the real run's own launch; also python -m, torchrun -m: __main__.py)

Run it with exactly the flags, the launcher and the world size of the intended run: it IS that
run, reduced in steps. Every rank runs every check; each check's verdict is agreed by all ranks
(one all-gather), rank 0 prints it as PASS/FAIL/SKIP with its time and writes
RUN_DIR/preflight/<stage>.json (RUN_DIR: the directory the real run will use). Any FAIL exits with the
"preflight-failed" code of launcher/ends.py's END_KINDS and says what to fix. The training it does
runs in scratch run directories, RUN_DIR/preflight/scratch/<name>/ (wiped before use, checkpoints
deleted after), built with the driver's own pieces (`plan_run`, `Trainer`) from the run's RunConfig
with only run-kind fields changed (steps, out, run id, resume; no mirror, no sinks, no budgets):
nothing of the real run's checkpoints or metrics is touched. The driver's own output goes to RUN_DIR/preflight/<stage>.log.

v1 stability   backend on every rank; all-reduce and all-gather values; with --sequence-parallel N > 1, N
               checked as the run checks it and one layer's forward all-to-all (q, k, v, output at the run's
               shapes) timed over the sequence-parallel group, GB/s next to the planner's figure; the data (prepared shards:
               every checksum, `zerotrain.dataio.format.shards.verify`; a mix: every local source read, the first
               record of a streamed one); the model and engine build; one training step; one
               checkpoint written and verified against its marker; read back into a fresh engine
               and compared tensor by tensor (sha256 of every parameter and optimizer-state tensor
               this rank holds, the loader state, step and tokens); one evaluation on all ranks
               (the run's eval rows, else rows of the training mix); one resumed step.
v2 throughput  a micro-batch sweep (--sweep, default micro/2, micro, 2x, 4x; grad-accum 1; --sweep-steps
               steps each: tokens/s per rank and peak memory, GPU max_memory_allocated or host peak
               RSS, max over ranks; the planner's fit check first, larger ones skipped after one that
               does not fit or runs out of memory; the fastest that fits marked); the data loader
               alone (--loader-seconds), tokens/s per rank, against what the model consumes per rank
               (its step time minus the data wait; ratio >= DATA_RATIO_MIN); the fraction of step time
               waiting on data (<= DATA_WAIT_MAX); both at the configured micro-batch. With NVMe offload,
               first the write and read throughput at --nvme-path (measure.disk_throughput), a line.
v3 rehearsal   N steps of the full config (--steps, default `rehearsal_steps`), saves and evaluations
               at the run's cadence (at least one of each that the run has); golden steps recorded
               in RUN_DIR/preflight/golden.json; passes only if the median MFU against the profile's
               peak reaches the resolved `mfu_threshold`.

The package: harness.py (the command line, the runner, the verdict every rank agrees on, reports),
stability.py (v1), throughput.py (v2), rehearsal.py (v3), measure.py (what the stages measure with).
`--golden PATH` on a real run compares it with v3's golden steps: components/observe/golden.py. Test hooks
(ZEROTRAIN_TEST_PREFLIGHT_READBACK, ZEROTRAIN_TEST_SLOW_LOADER) are read once: components/hooks.py.
"""
from zerotrain.launcher.commands.preflight.harness import STAGES, Preflight, main, parse_args  # noqa: F401
from zerotrain.launcher.commands.preflight.measure import DATA_RATIO_MIN, DATA_WAIT_MAX, rehearsal_steps  # noqa: F401
