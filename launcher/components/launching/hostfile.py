"""Checks made before a multi-node launch starts anything: the hostfile, the world size against
the profile, the hosts themselves (ssh, same zerotrain), and the environment the ranks get.

Used by `zerotrain launch --hostfile` (launcher/commands/launch.py) and `zerotrain slurm`. Everything
here either returns plain values or raises a one-line UsageError; nothing is launched.

The hostfile format is DeepSpeed's, read the way its runner reads it (deepspeed/launcher/runner.py
`fetch_hostfile` / `_parse_hostfile`, 0.19): each stripped line starting with `#` or empty is skipped;
any other must begin `HOST slots=N` (the regex `^(\S+)\s+slots=(\d+)`), and whatever follows is ignored
(`node-a slots=8 max_slots=8`, an OpenMPI hostfile's line, is 8 slots; so is `node-a slots=8  # gpu`).
A host with slots=0 is accepted too (DeepSpeed starts its launcher there, with no rank, unless --include or
--exclude leaves it out; the profile's world-size check sees its 0). What DeepSpeed
refuses (a line without a slot count, a host twice, no host at all) it refuses only after it has started,
with the whole file in the log; here each is one line naming its line number. tests/test_launch_surfaces.py
runs DeepSpeed's parser on the same inputs.

The profile's `zerotrain.env` section (read by `profile_env`):

    "env": {"set": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_IB_DISABLE": "0"},
            "pass": ["WANDB_API_KEY", "HF_TOKEN"]}

`set` gives values for every rank (a variable already set in the launching shell keeps the
shell's value); `pass` names variables whose value is copied from the launching shell to every
node. Values of `pass` variables are secrets: they are never printed, and never reach a
config, a log or a checkpoint (the launch file holding them is private and removed afterwards).

Whatever the profile (`--profile auto` too), the variables in FORWARDED (and every `WANDB_*`) are
passed the same way when the launching shell sets them: where the Hugging Face cache is and whether it
is offline, the hub token, W&B's settings, the compile caches and the CUDA allocator's settings are
what a user sets once on the node they launch from. DeepSpeed's own ssh path would forward none of
them (its runner exports only NCCL/PYTHON/MV2/UCX variables and `.deepspeed_env`). A forwarded
variable whose value DeepSpeed's pdsh command could not carry is left out and named, not refused:
the user did not ask for it. docs/launching.md lists them and how to add more.
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from zerotrain import __version__, resource_dir
from zerotrain.launcher.components import ds_compat
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.settings import profile_value

# What version_line() digests: the code and the shipped profiles, found the same way in a checkout
# and in a wheel (package -> glob patterns inside it).
CODE_FILES = {"zerotrain.launcher": ("**/*.py",), "zerotrain.modeling": ("**/*.py", "*.yaml"),
              "zerotrain.dataio": ("**/*.py",), "zerotrain.ds_configs": ("*.json",)}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")  # DeepSpeed's own pattern (runner.py _parse_hostfile)
# DeepSpeed's PDSH runner wraps a value in double quotes only; these would break out of them.
_UNSAFE_VALUE = re.compile(r'["$`\\\n\r]')
# Passed to every rank when set on the launching node, whatever the profile says (module docstring).
FORWARDED = ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_TOKEN",
             "TRITON_CACHE_DIR", "TORCH_EXTENSIONS_DIR", "PYTORCH_CUDA_ALLOC_CONF",
             # the interface between nodes: NCCL's, and gloo's (the checkpointer's hash exchange crosses nodes)
             "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
FORWARDED_PREFIXES = ("WANDB_",)


def parse_hostfile(path: str | Path) -> "OrderedDict[str, int]":
    """{host: slots} in file order; one UsageError naming the line for anything DeepSpeed would
    misread or refuse."""
    path = Path(path)
    where = f"hostfile {path}"
    if not path.is_file():
        raise UsageError(f"{where}: no such file")
    try:
        with open(path) as f:  # as DeepSpeed reads it: text mode, lines split where readlines() splits them
            lines = f.readlines()
    except UnicodeDecodeError:
        raise UsageError(f"{where}: not a text file") from None
    hosts: OrderedDict[str, int] = OrderedDict()
    first_line: dict[str, int] = {}
    for n, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _HOST_LINE.search(line)
        if match is None:
            fields = line.split()
            if len(fields) == 1:
                raise UsageError(f"{where} line {n}: host {fields[0]!r} has no slot count (expected 'HOST slots=N')")
            if fields[1].startswith("slots="):
                raise UsageError(f"{where} line {n}: {fields[1]!r}: the slot count is not a whole number")
            raise UsageError(f"{where} line {n}: malformed line {line!r} (expected 'HOST slots=N')")
        host, count = match.group(1), match.group(2)
        if host in hosts:
            raise UsageError(f"{where} line {n}: duplicate host {host} (first on line {first_line[host]})")
        hosts[host], first_line[host] = int(count), n
    if not hosts:
        raise UsageError(f"{where}: no hosts (only comments or blank lines)")
    return hosts


def active_hosts(hosts: "OrderedDict[str, int]", include: str = "", exclude: str = "", num_nodes: int = -1,
                 num_gpus: int = -1) -> "OrderedDict[str, list[int]]":
    """The hosts and slots DeepSpeed's runner will use, by DeepSpeed's own filter functions."""
    if (num_nodes >= 0 or num_gpus >= 0) and (include or exclude):
        raise UsageError("launch: --num_nodes/--num_gpus and --include/--exclude: give one (DeepSpeed refuses both)")
    try:
        active = ds_compat.runner_active_hosts(hosts, include, exclude, num_nodes, num_gpus)
    except ValueError as e:
        raise UsageError(f"launch --include/--exclude: {e}") from None
    if not active or not any(active.values()):
        raise UsageError("launch: no host and slot left after --include/--exclude/--num_nodes/--num_gpus")
    return active


def check_world(profile_name: str, profile: dict, slots_per_node: list[int]) -> None:
    """Refuse a hostfile whose nodes x slots differ from what the profile was written for
    (`zerotrain.hardware.nodes`, default 1, and `devices_per_node`). Profiles without a device
    count (the CPU one) fit any world."""
    hw = profile_value(profile, "hardware", {})
    per_node = hw.get("devices_per_node")
    if per_node is None:
        return
    nodes = hw.get("nodes", 1)
    got = f"{len(slots_per_node)} node(s) x " + (f"{slots_per_node[0]} slot(s)" if len(set(slots_per_node)) == 1
                                                 else f"({', '.join(map(str, slots_per_node))}) slots")
    if len(slots_per_node) != nodes or any(s != per_node for s in slots_per_node):
        raise UsageError(f"launch: world {sum(slots_per_node)} = {got}, but profile {profile_name} expects {nodes}"
                         f" node(s) x {per_node} device(s) = {nodes * per_node} (zerotrain.hardware); pick the"
                         " matching profile or pass --force")


# -- environment -----------------------------------------------------------------------------

def profile_env(profile: dict, where: str) -> tuple[dict[str, str], list[str]]:
    """({name: value} to set, [names to pass through]) from the profile's zerotrain.env section."""
    env = profile_value(profile, "env", {})
    if not isinstance(env, dict) or set(env) - {"set", "pass"}:
        raise UsageError(f"{where}: zerotrain.env must be an object with 'set' and/or 'pass'")
    values, names = env.get("set", {}), env.get("pass", [])
    if not isinstance(values, dict) or not all(isinstance(v, (str, int, float)) for v in values.values()):
        raise UsageError(f"{where}: zerotrain.env.set must map names to strings or numbers")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UsageError(f"{where}: zerotrain.env.pass must be a list of variable names")
    for name in [*values, *names]:
        if not _NAME.match(name):
            raise UsageError(f"{where}: zerotrain.env: {name!r} is not a variable name")
    return {k: str(v) for k, v in values.items()}, names


def forwarded_names(environ) -> list[str]:
    """The FORWARDED variables and WANDB_* set in `environ`, in a stable order."""
    return [n for n in FORWARDED if n in environ] + sorted(
        n for n in environ if n.startswith(FORWARDED_PREFIXES) and n not in FORWARDED)


def rank_env(profile: dict, where: str, environ=None) -> tuple[dict[str, str], list[str], list[str]]:
    """(variables for every rank, names passed through, names of `pass` not set here).

    The launching shell wins over the profile's `set` (an explicit `NCCL_IB_DISABLE=1 zerotrain
    launch ...` is a choice); `pass` variables not set in the shell are skipped and named. The
    FORWARDED ones set here are passed too (after the profile's `pass`, values never shown); one
    whose value DeepSpeed's ssh command cannot carry is skipped and named in `missing`.
    """
    environ = os.environ if environ is None else environ
    values, names = profile_env(profile, where)
    out = {k: environ.get(k, v) for k, v in values.items()}
    passed = [n for n in names if n in environ]
    for name in passed:
        out[name] = environ[name]
    for name, value in out.items():
        if _UNSAFE_VALUE.search(value):
            shown = value if name not in passed else "(value not shown)"
            raise UsageError(f"launch: environment variable {name} {shown}: contains one of \" $ ` \\ or a newline,"
                             " which DeepSpeed's ssh launcher cannot pass on")
    missing = [n for n in names if n not in environ]
    for name in forwarded_names(environ):
        if name in out:
            continue
        if _UNSAFE_VALUE.search(environ[name]):
            missing.append(f"{name} (set here, but its value holds a character DeepSpeed's ssh launcher cannot carry)")
            continue
        out[name] = environ[name]
        passed.append(name)
    return out, passed, missing


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a DeepSpeed environment file (DeepSpeed's own reading: split at the first =)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        if "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def write_deepspeed_env(path: Path, env: dict[str, str], cwd: Path | None = None) -> dict[str, str]:
    """Write the DeepSpeed environment file the runner exports to every node (mode 0600).

    DeepSpeed reads `.deepspeed_env` from the home directory and then the working directory
    (runner.py DEEPSPEED_ENVIRONMENT_PATHS, later wins). We point it at this file instead
    (DS_ENV_FILE), so those two are merged in first and keep their values: a user's own file
    overrides the profile. Returns what was written.
    """
    merged = {}
    for base in (Path.home(), Path(cwd or ".")):
        existing = base / ".deepspeed_env"
        if existing.is_file():
            merged.update(read_env_file(existing))
    merged = {**env, **merged}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{k}={v}\n" for k, v in merged.items())
    return merged


def describe_env(env: dict[str, str], passed: list[str], missing: list[str]) -> str:
    """One line for the log: values of `set` variables, only the names of passed-through ones."""
    shown = [f"{k}={v}" for k, v in env.items() if k not in passed]
    parts = [", ".join(shown)] if shown else []
    if passed:
        parts.append("passed through (values not shown): " + ", ".join(passed))
    if missing:
        parts.append("not set here, not passed: " + ", ".join(missing))
    return "environment for every rank: " + ("; ".join(parts) if parts else "nothing from the profile")


# -- hosts -----------------------------------------------------------------------------------

def version_line() -> str:
    """'zerotrain 0.1.0 (code 1a2b3c4d5e6f)': the version and a digest of the code and profiles,
    so two checkouts of the same version with different edits are told apart."""
    digest = hashlib.sha256()
    for package, patterns in CODE_FILES.items():
        root = resource_dir(package)
        for path in sorted(p for pattern in patterns for p in root.glob(pattern)):
            name = f"{package}/{path.relative_to(root).as_posix()}"
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return f"zerotrain {__version__} (code {digest.hexdigest()[:12]})"


def remote_version_command(cwd: Path) -> str:
    """What DeepSpeed's ssh launcher runs on each node, reduced to printing version_line()."""
    return (f"cd {shlex.quote(str(cwd))} && {shlex.quote(sys.executable)} -c "
            + shlex.quote("from zerotrain.launcher.components.launching.hostfile import version_line; print(version_line())"))


def check_hosts(hosts: list[str], ssh_port: int | None = None, cwd: Path | None = None, timeout: float = 30) -> None:
    """Every host answers over ssh (no password prompt) and runs the same zerotrain as here.

    DeepSpeed's runner only tries the first host; a typo or an outdated node further down would
    otherwise show up minutes later as a hang or an import error on one rank.
    """
    mine = version_line()
    command = remote_version_command(Path(cwd or Path.cwd()))

    def ask(host: str) -> str | None:
        ssh = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", *(["-p", str(ssh_port)] if ssh_port else []),
               host, command]
        try:
            proc = subprocess.run(ssh, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            return "no ssh command on this machine (--skip-host-checks to skip)"
        except subprocess.TimeoutExpired:
            return f"no answer over ssh within {timeout:g} s"
        if proc.returncode == 255:  # ssh's own failure, not the remote command's
            why = (proc.stderr.strip().splitlines() or ["ssh failed"])[-1]
            return f"not reachable over ssh ({why})"
        theirs = (proc.stdout.strip().splitlines() or [""])[-1]
        if proc.returncode != 0 or not theirs.startswith("zerotrain "):
            why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return f"cannot run zerotrain in {cwd or Path.cwd()} ({why})"
        if theirs != mine:
            return f"runs {theirs}, this node runs {mine}"
        return None

    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        problems = list(pool.map(ask, hosts))
    bad = [(h, p) for h, p in zip(hosts, problems) if p]
    if bad:
        more = f" (and {len(bad) - 1} more host(s))" if len(bad) > 1 else ""
        raise UsageError(f"launch: host {bad[0][0]}: {bad[0][1]}{more}; --skip-host-checks to launch anyway")
