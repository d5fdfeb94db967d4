"""Launch surfaces: `zerotrain launch --hostfile` checks and environment, the accelerate
configs and their profile rule, `zerotrain slurm` and its script's requeue after a stop by signal.

No Slurm, pdsh or second machine here: `ssh`, `pdsh`, `scontrol`, `srun`, `scancel` and `sbatch`
are small scripts put first on PATH that run each "node" on this machine, so DeepSpeed's real
runner, accelerate's real launcher and the real driver do the rest. Three tests launch ranks.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, free_port, read_metrics

from zerotrain.launcher.components.launching import hostfile
from zerotrain.launcher.ends import final_exit_codes
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.commands import launch as launch_cmd
from zerotrain.launcher.commands.launch import plan_hostfile_launch
from zerotrain.launcher.profiles import profile_from_accelerate

TRAIN = ["--model", "debug", "--seq-len", "64", "--micro-batch", "2", "--warmup-steps", "1"]
SECRET = "s3cr3t-wandb-key-0123"


def fake_bin(tmp_path: Path, scripts: dict[str, str]) -> Path:
    d = tmp_path / "fakebin"
    d.mkdir(exist_ok=True)
    for name, body in scripts.items():
        p = d / name
        p.write_text("#!/bin/bash\n" + body)
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return d


# ssh HOST CMD: runs CMD here. Host "down" is unreachable (ssh's own exit 255); host "old" answers
# with another zerotrain version.
FAKE_SSH = r'''
while [ $# -gt 0 ]; do case "$1" in -o|-p) shift 2;; -*) shift;; *) break;; esac; done
host=$1; shift
if [ "$host" = down ]; then echo "ssh: connect to host down port 22: Connection refused" >&2; exit 255; fi
if [ "$host" = old ]; then echo "zerotrain 0.0.1 (code 000000000000)"; exit 0; fi
exec bash -c "$*"
'''

# pdsh -S -f N -w h1,h2 CMD: CMD once per host (%n = its index), each in a login-like empty
# environment, so only what DeepSpeed exports in CMD reaches the ranks. Records CMD.
FAKE_PDSH = r'''
while [ $# -gt 0 ]; do case "$1" in -S) shift;; -f) shift 2;; -w) hosts=$2; shift 2;; *) break;; esac; done
cmd="$*"
printf 'CMD %s\nDS_ENV_FILE %s\n' "$cmd" "$DS_ENV_FILE" >> "$FAKE_LOG"
IFS=, read -ra hs <<< "$hosts"
i=0; pids=()
for h in "${hs[@]}"; do
    env -i PATH="$PATH" HOME="$HOME" bash -c "${cmd//%n/$i}" & pids+=($!); i=$((i + 1))
done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
'''


def env_profile(tmp_path: Path) -> Path:
    """The cpu profile plus a zerotrain.env section."""
    p = json.loads((REPO / "ds_configs" / "cpu.json").read_text())
    p["zerotrain"]["env"] = {"set": {"NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": "1"},
                             "pass": ["WANDB_API_KEY", "ZT_TEST_NOT_SET"]}
    path = tmp_path / "cpu-env.json"
    path.write_text(json.dumps(p))
    return path


# -- the hostfile ------------------------------------------------------------------------------

# What DeepSpeed's own parser (deepspeed/launcher/runner.py fetch_hostfile) accepts, ours accepts with the same
# hosts and slots; what it refuses, ours refuses with one line naming the line. Both run on the same file.
HOSTFILES_DEEPSPEED_ACCEPTS = [
    "node-a slots=8\nnode-b slots=8\n",
    "# cluster\n\nnode-a slots=8   # first\n  node-b slots=4\n",
    "node-a slots=8 max_slots=8\nnode-b slots=8 max_slots=8\n",  # an OpenMPI hostfile: max_slots ignored
    "node-a\tslots=2\r\nnode-b slots=2\r\n",  # tabs, CRLF line ends
    "   # indented comment\n\t\nnode-a slots=1\n",
    "node-a slots=8\nnode-b slots=0\n",  # a host without slots (see the test below)
    "node#1 slots=2\n",  # '#' only starts a comment at the start of a line
    "node-a slots=8 node-b slots=8\n",  # DeepSpeed reads the first host of the line only
    "node-a slots=16gpus\n",
    "node-a slots=8",  # no newline at the end
]
HOSTFILES_DEEPSPEED_REFUSES = [
    ("node-a slots=8\nnode-b slots=8\nnode-a slots=8\n", "line 3: duplicate host node-a (first on line 1)"),
    ("node-a slots=eight\n", "line 1: 'slots=eight': the slot count is not a whole number"),
    ("node-a slots=-1\n", "line 1: 'slots=-1': the slot count is not a whole number"),
    ("node-a slots=8\nnode-b\n", "line 2: host 'node-b' has no slot count (expected 'HOST slots=N')"),
    ("node-a slots=8\nnode-b gpus=8\n", "line 2: malformed line 'node-b gpus=8' (expected 'HOST slots=N')"),
    ("node-a slots = 8\n", "line 1: malformed line 'node-a slots = 8'"),
    ("slots=8\n", "line 1: host 'slots=8' has no slot count"),
    ("# nothing\n\n", "no hosts (only comments or blank lines)"),
    ("", "no hosts (only comments or blank lines)"),
]


@pytest.mark.parametrize("text", HOSTFILES_DEEPSPEED_ACCEPTS)
def test_hostfile_accepts_what_deepspeed_accepts(tmp_path, text):
    from deepspeed.launcher.runner import fetch_hostfile

    path = tmp_path / "hostfile"
    path.write_bytes(text.encode())
    assert dict(hostfile.parse_hostfile(path)) == dict(fetch_hostfile(str(path)))


@pytest.mark.parametrize("text, message", HOSTFILES_DEEPSPEED_REFUSES)
def test_hostfile_refuses_what_deepspeed_refuses_in_one_line_naming_the_line(tmp_path, text, message):
    from deepspeed.launcher.runner import fetch_hostfile

    path = tmp_path / "hostfile"
    path.write_bytes(text.encode())
    with pytest.raises(ValueError):
        fetch_hostfile(str(path))
    with pytest.raises(UsageError) as e:
        hostfile.parse_hostfile(path)
    assert str(e.value).startswith(f"hostfile {path}") and message in str(e.value) and "\n" not in str(e.value)


def test_a_host_without_slots_is_what_deepspeed_makes_of_it(tmp_path):
    # DeepSpeed keeps it (its launcher starts there, with no rank) unless a filter names it; the profile's
    # world-size check then sees its 0 slots.
    path = tmp_path / "hostfile"
    path.write_text("node-a slots=8\nnode-b slots=0\n")
    hosts = hostfile.parse_hostfile(path)
    assert hostfile.active_hosts(hosts) == {"node-a": list(range(8)), "node-b": []}
    assert hostfile.active_hosts(hosts, exclude="node-b") == {"node-a": list(range(8))}
    with pytest.raises(UsageError, match=r"world 8 = 2 node\(s\) x \(8, 0\) slots"):
        hostfile.check_world("h100-80g-x8", {"zerotrain": {"hardware": {"devices_per_node": 8}}}, [8, 0])


def test_hostfile_comments_blank_lines_and_deepspeed_filters(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("# cluster\n\nnode-a slots=8   # first\n  node-b slots=4\n")
    hosts = hostfile.parse_hostfile(path)
    assert dict(hosts) == {"node-a": 8, "node-b": 4}
    assert hostfile.active_hosts(hosts, num_nodes=1) == {"node-a": list(range(8))}
    assert hostfile.active_hosts(hosts, exclude="node-a") == {"node-b": list(range(4))}
    with pytest.raises(UsageError, match="--num_nodes/--num_gpus and --include/--exclude"):
        hostfile.active_hosts(hosts, include="node-a", num_gpus=2)


def test_world_size_must_match_the_profile_unless_forced(tmp_path, mix_path):
    hf = tmp_path / "hostfile"
    hf.write_text("node-a slots=8\nnode-b slots=8\n")
    train = ["--data", str(mix_path), "--model", "debug"]

    def plan(ds_flags, profile, *more):
        return plan_hostfile_launch(["--hostfile", str(hf), *ds_flags, "--", "--profile", profile, *train, *more])

    node0 = ["--no_ssh", "--node_rank", "0"]
    with pytest.raises(UsageError) as e:
        plan(node0, "h100-80g-x8")
    assert str(e.value) == ("launch: world 16 = 2 node(s) x 8 slot(s), but profile h100-80g-x8 expects 1 node(s) x 8"
                            " device(s) = 8 (zerotrain.hardware); pick the matching profile or pass --force")
    forced = plan([*node0, "--force"], "h100-80g-x8")
    assert "--force" not in forced.cmd and forced.cmd[-len(train) - 2:] == ["--profile", "h100-80g-x8", *train]
    assert any("--force: world size not checked" in m for m in forced.messages)
    plan(node0, "h100-80g-2x8-multinode")  # the 2 x 8 profile fits; with --num_nodes 1 it does not
    with pytest.raises(UsageError, match=r"world 8 = 1 node\(s\) x 8 slot\(s\), but profile h100-80g-2x8-multinode"):
        plan(["--num_nodes", "1", *node0], "h100-80g-2x8-multinode")
    # the train flags get the driver's own checks before any node starts; --node_rank must be a node
    with pytest.raises(UsageError, match="--seq-len: must be a positive integer, got 0"):
        plan(node0, "cpu", "--seq-len", "0")
    with pytest.raises(UsageError, match="--no_ssh: needs --node_rank R, this node's line in"):
        plan(["--no_ssh"], "cpu")
    with pytest.raises(UsageError, match="--node_rank 2 is not a node"):
        plan(["--no_ssh", "--node_rank", "2"], "cpu")
    with pytest.raises(UsageError, match="^launch: deepspeed flags: unrecognized arguments: --bogus$"):
        plan(["--bogus"], "cpu")
    with pytest.raises(UsageError, match="put the train flags after --"):
        plan_hostfile_launch(["--hostfile", str(hf), *train])


@pytest.mark.launches
def test_zerotrain_launch_refuses_a_bad_hostfile_before_starting_anything(tmp_path, mix_path):
    hf = tmp_path / "hostfile"
    hf.write_text("node-a slots=1\nnode-a slots=1\n")
    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "zerotrain", "launch", "--hostfile", str(hf), "--", "--data",
                           str(mix_path), "--out", str(out)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"zerotrain: error: hostfile {hf} line 2: duplicate host node-a (first on line 1)"
    assert not out.exists()


def test_host_checks_over_ssh(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_bin(tmp_path, {'ssh': FAKE_SSH})}:{os.environ['PATH']}")
    hostfile.check_hosts(["node-a", "node-b"], cwd=REPO)  # both answer with this checkout's version
    with pytest.raises(UsageError) as e:
        hostfile.check_hosts(["node-a", "down", "old"], cwd=REPO)
    assert str(e.value).startswith("launch: host down: not reachable over ssh (ssh: connect to host down port 22:"
                                   " Connection refused) (and 1 more host(s)); --skip-host-checks")
    with pytest.raises(UsageError, match=r"host old: runs zerotrain 0.0.1 \(code 000000000000\), this node runs"
                                         r" zerotrain .* \(code [0-9a-f]{12}\)"):
        hostfile.check_hosts(["old"], cwd=REPO)


def test_profile_environment_for_the_ranks(tmp_path, monkeypatch):
    profile = json.loads(env_profile(tmp_path).read_text())
    environ = {"WANDB_API_KEY": SECRET, "NCCL_ASYNC_ERROR_HANDLING": "0"}
    env, passed, missing = hostfile.rank_env(profile, "profile p", environ)
    # the launching shell wins over the profile's value; pass-through only when set here
    assert env == {"NCCL_ASYNC_ERROR_HANDLING": "0", "OMP_NUM_THREADS": "1", "WANDB_API_KEY": SECRET}
    assert passed == ["WANDB_API_KEY"] and missing == ["ZT_TEST_NOT_SET"]
    line = hostfile.describe_env(env, passed, missing)
    assert SECRET not in line and "WANDB_API_KEY" in line and "NCCL_ASYNC_ERROR_HANDLING=0" in line
    with pytest.raises(UsageError) as e:  # a value DeepSpeed's pdsh command would break on; never shown
        hostfile.rank_env(profile, "profile p", {"WANDB_API_KEY": 'a"b$c'})
    assert "WANDB_API_KEY (value not shown)" in str(e.value) and 'a"b$c' not in str(e.value)
    with pytest.raises(UsageError, match="zerotrain.env must be an object with 'set' and/or 'pass'"):
        hostfile.profile_env({"zerotrain": {"env": {"NCCL_IB_DISABLE": "0"}}}, "profile p")
    # HF_*, WANDB_*, the compile caches and the allocator's settings go whatever the profile (none here);
    # a forwarded value pdsh cannot carry is left out and named, never shown, never a refusal
    forwarded = {"HF_HOME": "/hf", "HF_TOKEN": SECRET, "HF_HUB_OFFLINE": "1", "WANDB_PROJECT": "p",
                 "WANDB_NOTES": 'say "hi"', "TRITON_CACHE_DIR": "/t",
                 "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                 "OTHER": "not forwarded"}
    env, passed, missing = hostfile.rank_env({}, "profile auto", forwarded)
    assert env == {k: v for k, v in forwarded.items() if k not in ("OTHER", "WANDB_NOTES")}
    assert passed == ["HF_HOME", "HF_HUB_OFFLINE", "HF_TOKEN", "TRITON_CACHE_DIR", "PYTORCH_CUDA_ALLOC_CONF",
                      "WANDB_PROJECT"]
    line = hostfile.describe_env(env, passed, missing)
    assert SECRET not in line and "/hf" not in line and '"hi"' not in line and "WANDB_NOTES (set here, but" in line
    # the environment file: private, and a user's own .deepspeed_env (home, then here) keeps its values
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".deepspeed_env").write_text("OMP_NUM_THREADS=4\nMY_VAR=x\n")
    path = tmp_path / "env"
    written = hostfile.write_deepspeed_env(path, env, cwd=tmp_path)
    assert written == {**env, "OMP_NUM_THREADS": "4", "MY_VAR": "x"}
    assert hostfile.read_env_file(path) == written and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_launch_n_gives_the_ranks_the_profile_env_with_profile_auto_too(tmp_path, monkeypatch, mix_path):
    """`zerotrain launch -n N`: the runner (and so every rank) gets the profile's zerotrain.env, the profile
    --profile auto detects on this node (where the ranks run) as well as a named one."""
    profile = env_profile(tmp_path)
    monkeypatch.setattr(launch_cmd, "detect_profile", lambda: (str(profile), "this node"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    seen = []
    monkeypatch.setattr(launch_cmd, "run_with_restarts",
                        lambda command, args, env, *rest: seen.append(env) or 0)
    for spec in ("auto", str(profile)):
        with pytest.raises(SystemExit):
            launch_cmd.launch_main(["-n", "2", "--data", str(mix_path), "--profile", spec])
    assert [env.get("OMP_NUM_THREADS") for env in seen] == ["1", "1"]


def extensions_dir() -> str:
    """The directory DeepSpeed's JIT-built ops already are in, forwarded as a user would, so the ranks load them and
    rebuild nothing (the communication op: ~90 CPU-s). Unset, torch builds in its default root's py311_cpu (python,
    then accelerator) folder; a TORCH_EXTENSIONS_DIR it is given is that folder itself (cpp_extension's
    _get_build_directory): forwarding the default root would have the ranks build every op again, in a new place."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    assert torch.version.cuda is None and torch.version.hip is None  # the CPU wheel: the folder is pyXY_cpu
    return os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}"
                                                  f"{getattr(sys, 'abiflags', '')}_cpu")


@pytest.mark.launches
def test_ssh_launch_exports_the_profile_env_and_keeps_secrets_out_of_logs(tmp_path, mix_path):
    """DeepSpeed's real ssh path (pdsh) on two loopback 'nodes': the profile's env reaches the ranks
    through the environment file; the secret is in the remote command only, never in the output
    or the run directory, and the file is gone afterwards."""
    fake = fake_bin(tmp_path, {"ssh": FAKE_SSH, "pdsh": FAKE_PDSH})
    hf = tmp_path / "hostfile"
    hf.write_text("node-a slots=1\nnode-b slots=1\n")
    out, log = tmp_path / "runs", tmp_path / "pdsh.log"
    # what a user sets once on the launching node: forwarded to every rank without a profile entry
    forwarded = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
                 "HF_DATASETS_CACHE": str(tmp_path / "hf" / "ds"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                 "HF_TOKEN": SECRET + "-hf", "WANDB_PROJECT": "x", "WANDB_MODE": "offline",
                 "TRITON_CACHE_DIR": str(tmp_path / "triton"), "TORCH_EXTENSIONS_DIR": extensions_dir(),
                 "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1", "WANDB_API_KEY": SECRET,
           "FAKE_LOG": str(log), **forwarded}
    shm_op = Path(forwarded["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    built = shm_op.stat().st_mtime_ns  # the conftest built it before any launch
    # the compiler the suite builds ops with (conftest: CXX), passed by the profile as a user passes their own: a
    # rank with another compiler command would rebuild the op
    profile = env_profile(tmp_path)
    cxx = ["CXX"] if os.environ.get("CXX") else []
    p = json.loads(profile.read_text())
    p["zerotrain"]["env"]["pass"] += cxx
    profile.write_text(json.dumps(p))
    proc = subprocess.run([sys.executable, "-m", "zerotrain", "launch", "--hostfile", str(hf), "--master_addr",
                           "127.0.0.1", "--master_port", str(free_port()), "--",
                           "--profile", str(profile), "--data", str(mix_path), "--out", str(out),
                           "--run-id", "ssh", *TRAIN, "--max-steps", "2"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert shm_op.stat().st_mtime_ns == built  # the ranks loaded the forwarded cache's op, built none
    assert "2 host(s) reachable over ssh, all running zerotrain" in proc.stdout
    assert f"passed through (values not shown): {', '.join(['WANDB_API_KEY', *cxx])}, HF_HOME," in proc.stdout
    assert "; not set here, not passed: ZT_TEST_NOT_SET" in proc.stdout
    assert [m["step"] for m in read_metrics(out / "ssh")] == [1, 2]
    assert json.loads((out / "ssh" / "config.json").read_text())["world_size"] == 2
    recorded = log.read_text()
    assert "export NCCL_ASYNC_ERROR_HANDLING=1;" in recorded and f"export WANDB_API_KEY={SECRET};" in recorded
    for name, value in forwarded.items():  # the ranks run in an empty environment (FAKE_PDSH): only exports reach them
        assert f"export {name}={value};" in recorded, name
        assert name in proc.stdout.split("passed through (values not shown): ", 1)[1].split("\n", 1)[0]
    assert SECRET not in proc.stdout + proc.stderr and forwarded["HF_HOME"] not in proc.stdout + proc.stderr
    assert not any(SECRET.encode() in p.read_bytes() for p in (out / "ssh").rglob("*") if p.is_file())
    env_file = Path(recorded.split("DS_ENV_FILE ", 1)[1].split()[0])
    assert env_file.name == ".deepspeed_env" and not env_file.exists()
    assert not (REPO / ".deepspeed_env").exists()


# -- accelerate ----------------------------------------------------------------------------------

ACCELERATE_DIR = REPO / "launcher" / "accelerate"


@pytest.mark.parametrize("name", ["h100-1node-8gpu.yaml", "h100-2node-node0.yaml", "h100-2node-node1.yaml"])
def test_shipped_accelerate_configs(name):
    from accelerate.commands.config.config_args import load_config_from_file

    from zerotrain.launcher.profiles import load_profile

    load_config_from_file(str(ACCELERATE_DIR / name))  # accelerate's own reading: unknown keys refused
    cfg = yaml.safe_load((ACCELERATE_DIR / name).read_text())
    ds_file = REPO / cfg["deepspeed_config"]["deepspeed_config_file"]
    assert cfg["distributed_type"] == "DEEPSPEED" and ds_file.parent == REPO / "ds_configs" and ds_file.is_file()
    hw = load_profile(str(ds_file))[1]["zerotrain"]["hardware"]
    assert cfg["num_machines"] == hw.get("nodes", 1)
    assert cfg["num_processes"] == hw.get("nodes", 1) * hw["devices_per_node"]
    if cfg["num_machines"] > 1:
        other = yaml.safe_load((ACCELERATE_DIR / name.replace("node0", "nodeX").replace("node1", "node0")
                                .replace("nodeX", "node1")).read_text())
        assert {cfg["machine_rank"], other["machine_rank"]} == {0, 1}
        assert {k: v for k, v in cfg.items() if k != "machine_rank"} == \
            {k: v for k, v in other.items() if k != "machine_rank"}


def test_profile_comes_from_accelerates_deepspeed_config_file(tmp_path):
    shipped = "ds_configs/h100-80g-x8.json"
    env = {"ACCELERATE_DEEPSPEED_CONFIG_FILE": str(REPO / shipped)}
    assert profile_from_accelerate({}, {}) == {}
    assert profile_from_accelerate({}, env) == {"profile": "h100-80g-x8"}  # same run id as --profile h100-80g-x8
    assert profile_from_accelerate({"profile": "h100-80g-x8"}, env) == {"profile": "h100-80g-x8"}
    assert profile_from_accelerate({"profile": str(REPO / shipped)}, env) == {"profile": "h100-80g-x8"}
    with pytest.raises(UsageError) as e:
        profile_from_accelerate({"profile": "cpu"}, env)
    assert str(e.value) == (f"--profile cpu and accelerate's deepspeed_config_file {REPO / shipped}"
                            " (ACCELERATE_DEEPSPEED_CONFIG_FILE): two different profiles; drop --profile (under"
                            " accelerate the config file decides)")
    own = env_profile(tmp_path)
    assert profile_from_accelerate({}, {"ACCELERATE_DEEPSPEED_CONFIG_FILE": str(own)}) == {"profile": str(own)}
    with pytest.raises(UsageError, match=r"deepspeed_config_file ds_configs/nope.json"
                                         r" \(ACCELERATE_DEEPSPEED_CONFIG_FILE\): no such file"):
        profile_from_accelerate({}, {"ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/nope.json"})


def test_config_from_applies_the_accelerate_rule(monkeypatch, mix_path):
    from zerotrain.launcher.config_resolve import resolve_config

    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(REPO / "ds_configs" / "h100-80g-x8.json"))
    assert resolve_config(["--data", str(mix_path)]).parallel.profile == "h100-80g-x8"
    with pytest.raises(UsageError, match="--profile cpu and accelerate's deepspeed_config_file"):
        resolve_config(["--data", str(mix_path), "--profile", "cpu"])


# -- Slurm ----------------------------------------------------------------------------------------

# scontrol: `show hostnames` prints FAKE_HOSTS; `requeue ID` is recorded. srun: runs its command once
# per node here with SLURM_NODEID set, remembering the pids for scancel, which sends them the signal.
FAKE_SCONTROL = r'''
case "$1 $2" in
    "show hostnames") printf '%s\n' $FAKE_HOSTS;;
    requeue*) echo "requeue $2" >> "$FAKE_LOG";;
    *) echo "fake scontrol: $*" >&2; exit 1;;
esac
'''
FAKE_SRUN = r'''
while [ $# -gt 0 ]; do case "$1" in --*) shift;; *) break;; esac; done
n=0; pids=()
for h in $FAKE_HOSTS; do SLURM_NODEID=$n SLURM_PROCID=$n "$@" & pids+=($!); n=$((n + 1)); done
echo "${pids[@]}" > "$FAKE_LOG.pids"
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
'''
FAKE_SCANCEL = r'''
echo "scancel $*" >> "$FAKE_LOG"
for p in $(cat "$FAKE_LOG.pids"); do kill -TERM "$p" 2>/dev/null; done
'''
FAKE_SBATCH = r'''
echo "sbatch $*" >> "$FAKE_LOG"; echo "Submitted batch job 4242"
'''
# Stands in for the Python on the nodes: records its arguments, exits with FAKE_CODE through the
# exit file as `zerotrain launch` does.
FAKE_PYTHON = r'''
echo "node $SLURM_NODEID: $*" >> "$FAKE_LOG"
echo "$FAKE_CODE" > "$ZEROTRAIN_EXIT_FILE"; exit "$FAKE_CODE"
'''


def slurm_env(tmp_path: Path, hosts: str, **extra) -> dict:
    fake = fake_bin(tmp_path, {"scontrol": FAKE_SCONTROL, "srun": FAKE_SRUN, "scancel": FAKE_SCANCEL,
                               "sbatch": FAKE_SBATCH, "python-node": FAKE_PYTHON})
    return {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "FAKE_HOSTS": hosts,
            "FAKE_LOG": str(tmp_path / "slurm.log"), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]",
            "SLURM_JOB_NUM_NODES": "2", "OMP_NUM_THREADS": "1", **extra}


def zerotrain_slurm(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerotrain", "slurm", *args], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(REPO)}, cwd=cwd, timeout=120)


@pytest.mark.launches
def test_slurm_dry_run_prints_the_script_and_each_nodes_command(tmp_path, mix_path):
    env = slurm_env(tmp_path, "gpu-01 gpu-02")
    proc = zerotrain_slurm(["--nodes", "2", "--gpus-per-node", "8", "--time", "2:00:00", "--max-requeues", "5",
                            "--dry-run", "--", "--profile", "h100-80g-2x8-multinode", "--data", str(mix_path),
                            "--out", str(tmp_path / "runs")], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for line in ("#SBATCH --nodes=2", "#SBATCH --signal=B:TERM@120", "#SBATCH --requeue", "#SBATCH --time=2:00:00",
                 "#SBATCH --gpus-per-node=8", "ZT_MAX_REQUEUES=5", "#   gpu-01 slots=8", "#   gpu-02 slots=8",
                 "scontrol requeue $SLURM_JOB_ID", f"job_dir=\"$ZT_WORKDIR/job-$SLURM_JOB_ID-r$restarts\"",
                 f"ZT_FINAL_CODES=\" {' '.join(str(c) for c in final_exit_codes() if c != 6)} \""):
        assert line in text, line
    job_dir = f"{tmp_path / 'runs' / 'slurm'}/job-4242-r0"
    for rank in (0, 1):
        assert (f"# node {rank} (gpu-0{rank + 1}), srun task:\nZEROTRAIN_EXIT_FILE={job_dir}/exit.{rank} "
                f"{sys.executable} -m zerotrain launch --hostfile {job_dir}/hostfile --no_ssh --node_rank {rank}"
                f" --master_addr gpu-01 --master_port 29500 -- --profile h100-80g-2x8-multinode") in text
    assert text.count("--resume auto") >= 2
    assert not (tmp_path / "slurm.log").exists() and not (tmp_path / "runs").exists()  # nothing submitted or written
    bad = zerotrain_slurm(["--nodes", "1", "--dry-run", "--", "--profile", "h100-80g-2x8-multinode", "--data",
                           str(mix_path)], env, tmp_path)
    assert bad.returncode == 2 and "world 8 = 1 node(s) x 8 slot(s), but profile h100-80g-2x8-multinode" in bad.stderr
    bad = zerotrain_slurm(["--dry-run", "--", "--data", str(mix_path), "--resume", "never"], env, tmp_path)
    assert bad.returncode == 2 and "the script always resumes with --resume auto" in bad.stderr


@pytest.mark.launches
def test_slurm_submits_with_sbatch(tmp_path, mix_path):
    env = slurm_env(tmp_path, "n1")
    proc = zerotrain_slurm(["--nodes", "1", "--gpus-per-node", "1", "--job-name", "zt", "--", "--data", str(mix_path),
                            "--out", str(tmp_path / "runs")], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / "runs" / "slurm" / "zt.sbatch"
    assert "Submitted batch job 4242" in proc.stdout and (tmp_path / "slurm.log").read_text() == f"sbatch {script}\n"
    assert "#SBATCH --gpus-per-node" not in script.read_text()  # the cpu profile asks for no GPU


@pytest.mark.launches
@pytest.mark.parametrize("code, restarts, requeued", [(6, "0", True), (6, "2", False), (0, "0", False),
                                                     (5, "0", False), (3, "1", False), (2, "0", False),
                                                     (11, "0", True), (1, "1", True), (247, "0", True),
                                                     (11, "2", False)])
def test_slurm_script_requeues_after_a_signal_stop_or_a_restartable_end_within_max_requeues(
        tmp_path, mix_path, code, restarts, requeued):
    """6 (Slurm's own SIGTERM before the time limit) and END_KINDS' restartable ends (hung 11, crash 1, a lost
    rank: a code no kind has) are requeued; the script's list of final codes is rendered from END_KINDS."""
    env = slurm_env(tmp_path, "n1 n2", SLURM_RESTART_COUNT=restarts, FAKE_CODE=str(code))
    out = tmp_path / "runs"
    node_python = str(tmp_path / "fakebin" / "python-node")
    proc = zerotrain_slurm(["--nodes", "2", "--gpus-per-node", "1", "--max-requeues", "2", "--python", node_python,
                            "--", "--data", str(mix_path), "--out", str(out)], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    run = subprocess.run(["bash", str(out / "slurm" / "zerotrain.sbatch")], capture_output=True, text=True, env=env,
                         timeout=60)
    assert run.returncode == code, run.stdout + run.stderr
    log = (tmp_path / "slurm.log").read_text()
    assert ("requeue 4242" in log) == requeued, log
    job_dir = out / "slurm" / f"job-4242-r{restarts}"
    assert (job_dir / "hostfile").read_text() == "n1 slots=1\nn2 slots=1\n"
    for rank in (0, 1):
        assert (f"node {rank}: -m zerotrain launch --hostfile {job_dir}/hostfile --no_ssh --node_rank {rank}"
                f" --master_addr n1 --master_port 29500 -- --data {mix_path} --out {out} --resume auto") in log
    if code in (6, 11) and not requeued:
        assert "not requeued: 2 requeue(s) used of --max-requeues 2" in run.stdout
    if code == 11 and requeued:
        assert "ended restartably (exit 11: hung, a lost rank or a crash): requeueing job 4242" in run.stdout


@pytest.mark.launches
def test_slurm_sigterm_saves_then_requeues(tmp_path, mix_path):
    """The real chain on two loopback 'nodes': Slurm's SIGTERM to the batch shell -> scancel
    --signal=TERM -> every zerotrain launch -> every rank saves at the step boundary -> node 0
    exits 6 -> scontrol requeue."""
    env = slurm_env(tmp_path, "127.0.0.1 localhost")
    out = tmp_path / "runs"
    proc = zerotrain_slurm(["--nodes", "2", "--gpus-per-node", "1", "--master-port", str(free_port()), "--",
                            "--profile", "cpu", "--data", str(mix_path), "--out", str(out), "--run-id", "zt",
                            *TRAIN, "--max-steps", "100000"], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    batch = subprocess.Popen(["bash", str(out / "slurm" / "zerotrain.sbatch")], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env)
    metrics = out / "zt" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and batch.poll() is None and not (metrics.is_file() and metrics.read_text().strip()):
        time.sleep(0.5)
    batch.send_signal(signal.SIGTERM)  # what --signal=B:TERM@120 does: the batch shell only
    output = batch.communicate(timeout=300)[0]
    assert batch.returncode == 6, output[-4000:]
    log = (tmp_path / "slurm.log").read_text()
    assert "scancel --signal=TERM 4242" in log and "requeue 4242" in log, log
    steps = [m["step"] for m in read_metrics(out / "zt")]
    tag = out / "zt" / "checkpoints" / f"global_step{steps[-1]}"
    assert (tag / "zerotrain.json").is_file() and json.loads((tag / "zerotrain.json").read_text())["world_size"] == 2
    assert "requeueing job 4242 (requeue 1 of --max-requeues 3); it resumes with --resume auto" in output
