"""--offload on DeepSpeed's own keys (the config layer): where the offload comes from (--offload / --nvme-path or the
profile's zerotrain.offload / zerotrain.nvme_path), what it writes into zero_optimization's offload_optimizer and
offload_param, and those sections checked as a profile gives them. Moved here from launcher/profiles.py, which
calls them when it resolves a profile into the DeepSpeed dict.
"""
from __future__ import annotations

from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.settings import profile_value

# DeepSpeed 0.19's runtime/zero/offload_config.py: the keys of each offload section (pydantic refuses others
# there too, with a traceback) and the kind of value each takes.
_BOOL, _COUNT, _FRACTION = "a boolean", "a non-negative integer", "a number in [0, 1]"
OFFLOAD_KEYS = {
    "offload_param": {"device": None, "nvme_path": None, "buffer_count": _COUNT, "buffer_size": _COUNT,
                      "max_in_cpu": _COUNT, "pin_memory": _BOOL},
    "offload_optimizer": {"device": None, "nvme_path": None, "buffer_count": _COUNT, "pin_memory": _BOOL,
                          "pipeline_read": _BOOL, "pipeline_write": _BOOL, "fast_init": _BOOL, "ratio": _FRACTION,
                          "super_offload": _BOOL, "cpuadam_cores_perc": _FRACTION},
}


def _kind_ok(kind: str, v) -> bool:
    if kind == _BOOL:
        return isinstance(v, bool)
    if kind == _COUNT:
        return not isinstance(v, bool) and isinstance(v, int) and v >= 0
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v <= 1


def check_offload(zero: dict, where: str) -> None:
    """The offload sections of zero_optimization, as a profile gives them or as --offload wrote them: known keys,
    values of the right kind, a device DeepSpeed has, an nvme_path for NVMe, parameters only at ZeRO-3."""
    stage = zero.get("stage", 0)
    for section, keys in OFFLOAD_KEYS.items():
        sub = zero.get(section)
        if sub is None:
            continue
        name = f"zero_optimization.{section}"
        if not isinstance(sub, dict):
            raise UsageError(f"{where}: {name} must be an object, got {sub!r}")
        unknown = sorted(set(sub) - set(keys))
        if unknown:
            raise UsageError(f"{where}: {name} has no key {unknown[0]!r} in DeepSpeed 0.19 (known: {', '.join(keys)})")
        device = sub.get("device", "none")
        if device not in ("none", "cpu", "nvme"):
            raise UsageError(f"{where}: {name}.device must be none, cpu or nvme, got {device!r}")
        for key, kind in keys.items():
            if kind and key in sub and not _kind_ok(kind, sub[key]):
                raise UsageError(f"{where}: {name}.{key} must be {kind}, got {sub[key]!r}")
        if device == "nvme" and not isinstance(sub.get("nvme_path"), str):
            raise UsageError(f"{where}: {name} on nvme needs an nvme_path (a directory; --nvme-path DIR)")
        if device != "none" and section == "offload_param" and stage != 3:
            raise UsageError(f"{where}: {name} at ZeRO-{stage}: only ZeRO-3 partitions parameters (offload the"
                             " optimizer instead, or use a ZeRO-3 profile)")
        if device != "none" and section == "offload_optimizer" and stage == 0:
            raise UsageError(f"{where}: {name} at ZeRO-0: DeepSpeed offloads ZeRO-1/2/3 optimizer partitions")


def offload_settings(cfg, profile: dict, profile_name: str) -> tuple[str | None, str | None, str]:
    """(offload, nvme_path, where they came from): --offload / --nvme-path, else the profile's zerotrain.offload /
    zerotrain.nvme_path (launcher/settings.py declares and checks both); offload None: the profile's DeepSpeed
    keys as they are."""
    flag, flag_nvme = cfg.parallel.offload, cfg.parallel.nvme_path
    offload = flag if flag is not None else profile_value(profile, "offload")
    # --offload none turns the profile's offload off, its NVMe directory with it
    nvme = flag_nvme if flag_nvme is not None or flag == "none" else profile_value(profile, "nvme_path")
    where = "--offload" if flag is not None else f"profile {profile_name}: zerotrain.offload"
    if nvme is not None and offload in (None, "none"):
        named = "--nvme-path" if flag_nvme is not None else f"profile {profile_name}: zerotrain.nvme_path"
        raise UsageError(f"{named} {nvme}: offloads nothing without --offload optimizer or all")
    return offload, nvme, where


def apply_offload(ds: dict, offload: str | None, nvme: str | None, where: str) -> dict:
    """--offload onto DeepSpeed's own keys: "optimizer" sets zero_optimization.offload_optimizer, "all" that and
    offload_param (ZeRO-3 only), "none" removes both; the device is nvme (at `nvme`) or cpu. A profile's other
    keys in those sections (pin_memory, buffer counts, ratio) are kept. None: the dict as the profile has it."""
    if offload is None:
        return ds
    zero = dict(ds.get("zero_optimization") or {})
    stage = zero.get("stage", 0)
    if offload == "all" and stage != 3:
        raise UsageError(f"{where} all: offloads parameters, which only ZeRO-3 partitions; this profile is"
                         f" ZeRO-{stage} (use --offload optimizer, or a ZeRO-3 profile)")
    if offload == "optimizer" and stage == 0:
        raise UsageError(f"{where} optimizer: DeepSpeed offloads ZeRO-1/2/3 optimizer partitions; this profile is"
                         " ZeRO-0")
    on = {"optimizer": ("offload_optimizer",), "all": ("offload_optimizer", "offload_param")}.get(offload, ())
    for section in OFFLOAD_KEYS:
        sub = {k: v for k, v in (zero.get(section) or {}).items() if k not in ("device", "nvme_path")}
        if section not in on:
            zero.pop(section, None)
        elif nvme:
            zero[section] = {**sub, "device": "nvme", "nvme_path": nvme}
        else:
            zero[section] = {**sub, "device": "cpu"}
    return {**ds, "zero_optimization": zero}


def offloads_any(zero: dict) -> bool:
    """Whether a zero_optimization section offloads the optimizer or the parameters anywhere (host or NVMe)."""
    return any((zero.get(k) or {}).get("device", "none") != "none" for k in ("offload_optimizer", "offload_param"))
