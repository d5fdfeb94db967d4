"""A rank out of memory: CUDA's `torch.OutOfMemoryError`, or the host's `MemoryError` (an allocation Python or torch
could not get; a rank the kernel's OOM killer SIGKILLs cannot say anything and ends as a lost rank, a "crash").

The run ends as END_KINDS' "oom" (launcher/ends.py): its own exit code, never restarted by `zerotrain launch
--max-restarts` or the sbatch requeue, since the same run would run out of memory at the same place again. One line
names the step, the planner's peak for this configuration (launcher/planning `planned_here`, what the fit check
compared), the peak measured on this rank, and what to change. docs/troubleshooting.md says the rest.
"""
from __future__ import annotations

import resource

from zerotrain.launcher.planning import GiB, planned_here

def is_out_of_memory(error: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA's, on any build; matched by name: torch is not imported at this module's top)
    or MemoryError (the host's)."""
    return isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError"


def measured_peak(device: str) -> tuple[float, str]:
    """(bytes, what they are) of this rank's peak so far: CUDA's max_memory_allocated on a GPU, else the process's
    peak resident set (ru_maxrss, KiB on Linux)."""
    if device == "cuda":
        import torch  # the rank has it loaded already

        return float(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0, "peak resident memory of this rank"


def out_of_memory_message(plan, step: int, error: BaseException, device: str) -> str:
    """The one line: where, the planned and measured peaks, and what to change."""
    what = "host" if isinstance(error, MemoryError) or device == "cpu" else "CUDA"
    try:
        planned, setup, on = planned_here(plan.cfg, plan.model_args, plan.ds_config, plan.settings.values, plan.world,
                                          attention=plan.attention)
        planned_text = f"planned peak {planned.total / GiB:.2f} GiB of {setup.device_bytes / GiB:.2f} GiB ({on})"
    except Exception as e:  # noqa: BLE001  the end is said whatever the planner makes of this machine
        planned_text = f"planned peak unknown ({e})"
    peak, how = measured_peak(device)
    micro = plan.ds_config["train_micro_batch_size_per_gpu"]
    stage = (plan.ds_config.get("zero_optimization") or {}).get("stage", 0)
    changes = [f"--micro-batch {micro // 2} (the global batch kept with --global-batch-tokens)" if micro > 1 else
               "--seq-len shorter (the micro-batch is 1 already)"]
    if not plan.settings.activation_checkpointing:
        changes.append("--activation-checkpointing")
    changes.append("--offload optimizer" if stage in (1, 2) else "--offload all" if stage == 3 else
                   "a ZeRO-2/3 profile, then --offload optimizer")
    return (f"out of {what} memory on rank {plan.rank} after step {step}: {planned_text}; measured peak"
            f" {peak / GiB:.2f} GiB ({how}); change {', or '.join(changes)}; `zerotrain plan` lists what fits"
            f" (docs/troubleshooting.md) [{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}]")
