"""The DeepSpeed attributes read below launcher/components: modeling/ and the config layer (launcher/optimizers.py)
may not import launcher/components/ds_compat/, so the undocumented attributes they need are read here, and only
here. ds_compat.PRIVATE_NAMES lists each with the DeepSpeed source that sets it (looked up by
`check_deepspeed_version` outside the verified releases) and names this module in its ELSEWHERE.

Checked against DeepSpeed 0.19.8. Nothing is imported: every layer may use this module.
"""
from __future__ import annotations

# deepspeed/runtime/zero/partition_parameters.py Init._convert_to_deepspeed_param: every parameter built under
# zero.Init (ZeRO-3) gets ds_id (its id), ds_shape (its full shape) and ds_tensor (this rank's partition)
PARAMETER_ATTRIBUTES = ("ds_id", "ds_shape", "ds_tensor")
# deepspeed/runtime/engine.py DeepSpeedEngine._configure_optimizer: the torch optimizer the engine built from the
# config's "optimizer" section, before the ZeRO wrapper
ENGINE_ATTRIBUTES = ("basic_optimizer",)


def is_partitioned(p) -> bool:
    """`p` is a ZeRO-3 partitioned parameter."""
    return hasattr(p, "ds_id")


def full_shape(p):
    """`p`'s real shape: ZeRO-3 leaves an empty tensor in the parameter and keeps its shape in ds_shape."""
    return getattr(p, "ds_shape", None) or p.shape


def held(p):
    """What this rank holds of `p`: its ZeRO-3 partition (ds_tensor), else `p` itself."""
    return p.ds_tensor if hasattr(p, "ds_tensor") else p


def basic_optimizer(engine):
    """The torch optimizer DeepSpeed built from the config (None: a client optimizer, or none)."""
    return getattr(engine, "basic_optimizer", None)
