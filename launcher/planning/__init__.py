"""The planner: memory per GPU, time and money of a run before it starts (`zerotrain plan`), and the
driver's fit check (`fit_check`), which refuses a config that cannot fit before anything is built.

    zerotrain plan [driver flags] [--gpus N --gpu-mem GiB --nodes M] [--zero S] [--mfu F] [--json]

One source of truth with the model: parameters and training FLOPs per token come from
`zerotrain.modeling.sizes.count_params` / `flops_per_token`; the batch from `zerotrain.launcher.profiles.resolve_batch`;
the optimizer's state bytes from the optimizer registry (launcher/optimizers.py `state_bytes_per_param`).

Memory per rank = model states + ZeRO buffers + activations + context, plus a fragmentation allowance. The rooms,
lowest first (each module's docstring holds its formulas):

    units         GiB and the figures as the plan writes them
    hardware      Setup: what memory depends on besides the model (hardware, precision, ZeRO section, optimizer);
                  the context, fragmentation, this machine's RAM and device
    activations   what autograd keeps of our block for one micro-batch, and the peak (Activations)
    memory        model states (DeepSpeed's estimators), ZeRO buffers, one configuration's Memory, the largest
                  micro-batch that fits
    host          host memory (HostMemory) and host-link traffic (Traffic) with offload
    sequence      sequence parallelism: the N accepted, the all-to-all (AllToAll), the longest row that fits
    alternatives  what would fit instead
    budget        steps, tokens, hours, dollars, compute-optimal size
    evaluation    --eval-tasks: the scorings over a run and the time of one from its forward FLOPs
    report        the plan (a JSON-ready dict: docs/planning.md), its verdict and its lines
    fit           the driver's fit check, the planned peak an out-of-memory end names, the start-up's offload
                  lines, the micro-batch of a --profile auto profile

Callers import from here (zerotrain.launcher.planning), not from the rooms.
"""
from zerotrain.launcher.planning.activations import (Activations, activation_bytes, flex_block_mask_bytes,
                                                     run_loss_chunk)
from zerotrain.launcher.planning.budget import CHINCHILLA_TOKENS_PER_PARAM, budget
from zerotrain.launcher.planning.evaluation import (EvalCost, describe_cost, eval_cost, every_steps,
                                                   scorings)
from zerotrain.launcher.planning.fit import fit_check, offload_lines, planned_here, size_auto_micro_batch
from zerotrain.launcher.planning.hardware import (Setup, available_ram, device_memory_here, optimizer_state_bytes,
                                                  setup_from)
from zerotrain.launcher.planning.host import HostMemory, Traffic, host_memory, offload_traffic
from zerotrain.launcher.planning.memory import (OFFLOAD, STAGES, Memory, deepspeed_model_states, largest_layer,
                                                max_micro_batch, memory, stage_key)
from zerotrain.launcher.planning.report import make_plan, render, verdict
from zerotrain.launcher.planning.sequence import (AllToAll, all_to_all_bytes, check_sequence_parallel, max_seq_len,
                                                  sequence_link)
from zerotrain.launcher.planning.units import GiB

__all__ = ["Activations", "activation_bytes", "flex_block_mask_bytes", "run_loss_chunk", "CHINCHILLA_TOKENS_PER_PARAM",
           "budget", "EvalCost", "describe_cost", "eval_cost", "every_steps", "scorings", "fit_check", "offload_lines", "planned_here", "size_auto_micro_batch", "Setup", "available_ram",
           "device_memory_here", "optimizer_state_bytes", "setup_from", "HostMemory", "Traffic", "host_memory",
           "offload_traffic", "OFFLOAD", "STAGES", "Memory", "deepspeed_model_states", "largest_layer",
           "max_micro_batch", "memory", "stage_key", "make_plan", "render", "verdict", "AllToAll", "all_to_all_bytes",
           "check_sequence_parallel", "max_seq_len", "sequence_link", "GiB"]
