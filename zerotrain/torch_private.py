"""Every torch name that is not its public API (torch._dynamo, torch._higher_order_ops, torch._C, ...), in one
module: each function below names what it reaches and the torch it was checked against (2.13). PRIVATE_NAMES
lists them (module, name); tests/test_torch_private_names.py looks each up in the installed torch and fails on a
private torch name used anywhere else in the package.

torch is imported inside the functions (every layer may import this module, light commands included).
"""
from __future__ import annotations

PRIVATE_NAMES = (  # (module, dotted name in it)
    ("torch._dynamo", "maybe_mark_dynamic"),
    ("torch._dynamo.utils", "counters"),
    ("torch._higher_order_ops.flex_attention", "flex_attention"),
    ("torch._C._distributed_c10d", "_dump_fr_trace_json"),
)


def mark_dynamic(t, dim: int) -> None:
    """Tell dynamo that `t`'s dimension `dim` varies (one compiled graph for every length): torch._dynamo
    maybe_mark_dynamic, which, unlike mark_dynamic, lets dynamo specialise a length of 1 (torch 2.13)."""
    import torch._dynamo

    torch._dynamo.maybe_mark_dynamic(t, dim)


def compiled_graphs() -> int:
    """How many distinct graphs torch.compile has compiled in this process: torch._dynamo.utils.counters
    ["stats"]["unique_graphs"] (torch 2.13)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def flex_attention_operator():
    """torch's flex_attention higher-order operator (torch/_higher_order_ops/flex_attention.py, torch 2.13), whose
    CPU implementation has a backward (modeling/model.py flex_on_cpu); RuntimeError, one line, on a torch that
    moved it."""
    try:
        from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_op
    except ImportError as e:  # a torch that moved it: say what to do instead of a bare import error
        raise RuntimeError(f"flex attention on a CPU needs torch's flex_attention operator, checked on torch 2.13"
                           f" ({e}); use sdpa") from None
    return flex_attention_op


def flight_recorder_json() -> bytes:
    """torch's flight recorder of this process's collectives as JSON, every collective recorded, not only the
    pending ones: torch._C._distributed_c10d._dump_fr_trace_json(True, False), what torch's watchdog writes on a
    timeout (torch 2.13). Raises whatever torch raises where it has none."""
    from torch._C._distributed_c10d import _dump_fr_trace_json

    return _dump_fr_trace_json(True, False)
