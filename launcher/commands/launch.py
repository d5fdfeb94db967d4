"""Launch surfaces: `zerotrain launch` (local ranks or a hostfile), `zerotrain slurm`, and the
profile rule under `accelerate launch`.

    zerotrain launch -n N [--max-restarts K] [--restart-backoff S] [--] [train flags]
        the driver on N local ranks under DeepSpeed's launcher
    zerotrain launch --hostfile H [--force] [--skip-host-checks] [--max-restarts K] [--restart-backoff S]
                     [deepspeed flags] -- [train flags]
        checks first (launcher/components/launching/hostfile.py): the hostfile line by line, the world size against the
        profile's `zerotrain.hardware` (--force to override), with ssh each host's reachability and
        zerotrain version (--skip-host-checks); then DeepSpeed's runner with the profile's
        `zerotrain.env` for every rank (an environment file over ssh, the environment with --no_ssh)
    zerotrain slurm [--nodes N --gpus-per-node G --time T ...] [--max-requeues K] [--dry-run] -- [train flags]
        renders launcher/slurm/train.sbatch and submits it with sbatch (or prints it, --dry-run)

Running the job (rank 0's own exit code kept through DeepSpeed's launcher, our signals passed on, the restart
loop) is launcher/components/launching/jobs.py; this module reads the command lines and checks before launching.

Restarts (`--max-restarts K`, default 0: none): when the job ends restartably (END_KINDS' `restartable`:
hung, or a crash: a communication error, a rank killed (the kernel's OOM killer too), a segfault; never an
out-of-memory a rank caught, exit 12: it would end the same way) and we were not told
to stop, every rank process left is killed (SIGCONT, then SIGKILL to the runner's process group: stopped
ranks too) and waited for, the restart is announced in one line and recorded in RUN_DIR/manifest.json
(`restarts`), and after `--restart-backoff` seconds the whole job starts again with `--resume auto`, at
most K times. A SIGTERM/SIGINT to this command stops the job as without restarts, and one during the
backoff ends it there. The policy and what the launcher sees of its ranks: launcher/components/launching/restarts.py.
With --no_ssh each node's `zerotrain launch` restarts its own ranks (give every node the same flags; they
meet again at the master's rendezvous) and only node 0's records the restart.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from zerotrain import resource_dir
from zerotrain.cli_args import Parser, exact_integer
from zerotrain.launcher.components import ds_compat
from zerotrain.launcher.components.launching import hostfile
from zerotrain.launcher.components.launching.jobs import (TRAIN_MODULE, deepspeed_command, deepspeed_runner,
                                                          run_with_restarts)
from zerotrain.launcher.components.launching.ports import rendezvous_port
from zerotrain.launcher.components.launching.restarts import (DEFAULT_BACKOFF_S, RESTART_FLAGS, Restarts,
                                                              misplaced_restart_flag, take_restart_flags)
from zerotrain.launcher.components.observe.golden import GoldenCheck
from zerotrain.launcher.config_resolve import resolve_config
from zerotrain.launcher.ends import EXIT_SIGNAL, final_exit_codes
from zerotrain.launcher.errors import UsageError, ZerotrainError
from zerotrain.launcher.profiles import detect_profile, load_profile
from zerotrain.launcher.settings import profile_value

SBATCH_TEMPLATE = resource_dir("zerotrain.launcher", "slurm", "train.sbatch")
USAGE = ("usage: zerotrain launch -n N [--master_port P] [--master_addr A] [--max-restarts K] [--restart-backoff S]"
         " [--] [train flags]\n"
         "       zerotrain launch --hostfile H [--force] [--skip-host-checks] [--max-restarts K] [--restart-backoff S]"
         " [deepspeed flags] -- [train flags]")


def restart_run_dir(train_args: list[str]) -> Path | None:
    """The run directory restarts are recorded in (run_plan.identify); None, with a warning, if it cannot
    be named here (the job itself then says why). Called at the first restart only: run_plan imports torch (its
    data and schedule modules), which this launcher needs for nothing else (~1 s of each job's start)."""
    from zerotrain.launcher.run_plan import identify

    try:
        return identify(resolve_config(train_args)).run_dir
    except (ZerotrainError, OSError) as e:
        print(f"zerotrain launch: warning: restarts will not be recorded: {e}", file=sys.stderr, flush=True)
        return None


def launch_parser() -> Parser:
    """`zerotrain launch --help`. The command line itself is read by launch_main: after -n N (and our restart
    flags, and an optional --) every flag is a train flag, after a hostfile's -- too, and DeepSpeed's runner
    parses its own flags."""
    p = Parser(prog="zerotrain launch", usage=USAGE.removeprefix("usage: "),
               description="The driver on N local ranks, or on every node of a hostfile, under DeepSpeed's launcher,"
                           " with the profile's zerotrain.env for every rank.",
               epilog="deepspeed flags: those of DeepSpeed's runner (python -m deepspeed.launcher.runner --help), e.g."
                      " --include, --exclude, --num_nodes, --num_gpus, --no_ssh --node_rank R, --master_addr,"
                      " --master_port, --ssh_port. train flags: those of zerotrain train (see its --help)."
                      " Restartable ends: hung (exit 11) and crash (1; a rank killed, by the kernel's OOM killer too,"
                      " a segfault, a communication error); never bad input, divergence, early stop, budget, a signal,"
                      " an out-of-memory a rank caught (exit 12).")
    p.add_argument("-n", "--nproc", type=int, metavar="N", help="ranks on this node (one per GPU)")
    p.add_argument("--hostfile", "-H", metavar="H", help="DeepSpeed's hostfile: one 'HOST slots=N' per line")
    p.add_argument("--force", action="store_true", help="with --hostfile: launch although the world size differs"
                                                        " from the profile's devices_per_node x nodes")
    p.add_argument("--skip-host-checks", action="store_true", help="with --hostfile: do not check each host over"
                                                                   " ssh (reachable, same zerotrain)")
    p.add_argument("--master_port", "--master-port", type=int, metavar="P",
                   help="with -n: the rendezvous port; refused (exit 2) if another job listens on it. Default 29500,"
                        " or a free port when 29500 is busy (the start-up line says which)")
    p.add_argument("--master_addr", "--master-addr", metavar="A",
                   help="with -n: the rendezvous address, one of this node's (default: DeepSpeed's, 127.0.0.1)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="after a restartable end (hung, a lost rank, a crash), kill what is left of the job and"
                        " start it again with --resume auto, at most K times; recorded in RUN_DIR/manifest.json"
                        " (default 0: never)")
    p.add_argument("--restart-backoff", type=float, default=DEFAULT_BACKOFF_S, metavar="S",
                   help=f"seconds between the end of a job and its restart (default {DEFAULT_BACKOFF_S:g})")
    return p


RENDEZVOUS_FLAGS = ("--master-port", "--master-addr")  # launch -n's own, as DeepSpeed's runner spells them
LOCAL_FLAGS = (*RENDEZVOUS_FLAGS, *RESTART_FLAGS)


def _flag_name(arg: str) -> str:
    return arg.split("=")[0].replace("_", "-") if arg.startswith("--") else arg


def split_local_args(args: list[str]) -> tuple[Restarts, dict, list[str]]:
    """What follows `-n N`: (the restart policy, {"port": P or None, "addr": A or None}, the train flags).
    `-n N FLAGS`, `-n N -- FLAGS`, `-n N [--master_port P] [--master_addr A] [--max-restarts K]
    [--restart-backoff S] [--] FLAGS`."""
    if "--" in args:
        i = args.index("--")
        ours, train_args = args[:i], args[i + 1:]
    else:
        lead = 0  # launch's own flags open the list; the train flags follow
        while lead < len(args) and _flag_name(args[lead]) in LOCAL_FLAGS:
            lead += 1 if "=" in args[lead] else 2
        ours, train_args = args[:lead], args[lead:]
    rendezvous, rest = {"port": None, "addr": None}, []
    i = 0
    while i < len(ours):
        name, _, inline = ours[i].partition("=")
        if _flag_name(name) not in RENDEZVOUS_FLAGS:
            rest.append(ours[i])
            i += 1
            continue
        if not inline and i + 1 >= len(ours):
            raise UsageError(f"launch {name}: expected a value")
        value = inline or ours[i + 1]
        i += 1 if inline else 2
        if _flag_name(name) == "--master-addr":
            rendezvous["addr"] = value
            continue
        try:
            rendezvous["port"] = exact_integer(value)
        except ValueError as e:
            raise UsageError(f"launch {name} {value!r}: {e}") from None
    restarts, rest = take_restart_flags(rest)
    if rest:
        raise UsageError(f"launch -n N: before -- only --master_port, --master_addr, --max-restarts and"
                         f" --restart-backoff, got {rest[0]!r}")
    misplaced = misplaced_restart_flag(train_args) or next(
        (a.split("=")[0] for a in train_args if _flag_name(a) in RENDEZVOUS_FLAGS), None)
    if misplaced:
        raise UsageError(f"launch {misplaced}: a launch flag, not a train flag: put it before the train flags"
                         " (zerotrain launch -n N --master_port P --max-restarts K -- FLAGS)")
    return restarts, rendezvous, train_args


def launch_main(argv: list[str]) -> None:
    head = argv[:argv.index("--")] if "--" in argv else argv
    if argv[:1] in (["-h"], ["--help"]) or (argv[:1] not in (["-n"], ["--nproc"]) and {"-h", "--help"} & set(head)):
        launch_parser().parse_args(["--help"])  # prints the usage, exits 0: nothing starts
    if argv[:1] in (["-n"], ["--nproc"]):
        if len(argv) < 2:
            raise UsageError(USAGE)
        try:
            nproc = int(argv[1])
        except ValueError:
            raise UsageError(f"launch -n {argv[1]!r}: not an integer") from None
        if nproc < 1:
            raise UsageError(f"launch -n {nproc}: must be at least 1")
        restarts, rendezvous, train_args = split_local_args(argv[2:])
        # The profile's zerotrain.env (NCCL settings, PYTORCH_CUDA_ALLOC_CONF, ...) applies here too.
        cfg = resolve_config(train_args)  # bad train flags: one line before anything starts
        if cfg.observe.golden:  # a golden file of another config: refused before any rank starts
            GoldenCheck.load(cfg.observe.golden, cfg)
        # --profile auto: the ranks run on this node, so they detect the profile this node detects here
        name, profile = load_profile(cfg.parallel.profile if cfg.parallel.profile != "auto" else detect_profile()[0])
        profile_env = hostfile.rank_env(profile, f"profile {name}")[0]
        # a busy --master_port: one line, nothing started; none given: 29500, else a free one (two jobs here)
        port, port_line = rendezvous_port(rendezvous["port"])
        print(port_line, flush=True)
        sys.exit(run_with_restarts(lambda args: deepspeed_command(nproc, args, port, rendezvous["addr"]), train_args,
                                   {**os.environ, **profile_env}, restarts, restart_run_dir))
    if not any(a in ("--hostfile", "-H") or a.startswith("--hostfile=") for a in head):
        raise UsageError(USAGE)
    restarts = Restarts()
    if "--" in argv:
        restarts, ours = take_restart_flags(head)
        argv = [*ours, *argv[len(head):]]
    plan = plan_hostfile_launch(argv)
    for line in plan.messages:
        print(line, flush=True)
    with tempfile.TemporaryDirectory(prefix="zerotrain-env-") as tmp:  # mode 0700: only we can read it
        env = {**os.environ, **plan.rank_env}
        if plan.env_file is not None:
            # DS_ENV_FILE is joined to ~ and . by the runner; an absolute path makes both this file.
            path = Path(tmp) / ".deepspeed_env"
            hostfile.write_deepspeed_env(path, plan.env_file)
            env["DS_ENV_FILE"] = str(path)
        # The runner reads the file when it starts; it is removed when the launch ends.
        code = run_with_restarts(plan.command, plan.train_args, env, restarts,
                                 restart_run_dir if plan.records_restarts else None)
    sys.exit(code)


class HostfileLaunch:
    """What `zerotrain launch --hostfile` will run, decided before anything starts."""

    def __init__(self, cmd, rank_env, env_file, messages, train_args=(), records_restarts=True):
        self.cmd: list[str] = cmd
        self.rank_env: dict[str, str] = rank_env  # into the runner's own environment (local ranks)
        self.env_file: dict[str, str] | None = env_file  # exported to every node over ssh, or None
        self.messages: list[str] = messages
        self.train_args: list[str] = list(train_args)  # the end of cmd
        self.records_restarts = records_restarts  # this node's launcher writes manifest.json's restarts

    def command(self, train_args: list[str]) -> list[str]:
        """cmd with other train flags (a restart's --resume auto)."""
        return self.cmd[:len(self.cmd) - len(self.train_args)] + list(train_args)


def deepspeed_args(flags: list[str]) -> argparse.Namespace:
    """DeepSpeed's runner flags, parsed by the runner's own parser (one line on an error)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return ds_compat.runner_parse_args(flags + [TRAIN_MODULE])
    except SystemExit:
        why = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
        raise UsageError("launch: deepspeed flags: "
                         + (why[-1].split("error:", 1)[1].strip() if why else "not understood")) from None


def plan_hostfile_launch(argv: list[str], check_hosts_over_ssh: bool = True) -> HostfileLaunch:
    """Every check of `zerotrain launch --hostfile`, in order; raises a one-line UsageError."""
    if "--" not in argv:
        raise UsageError("launch --hostfile: put the train flags after -- (zerotrain launch --hostfile H"
                         " [deepspeed flags] -- [train flags])")
    i = argv.index("--")
    ours, train_args = argv[:i], argv[i + 1:]
    ours = launch_parser().dashed(ours)  # --skip_host_checks too; DeepSpeed's own flags are left as they are
    force, skip_hosts = "--force" in ours, "--skip-host-checks" in ours
    ds_flags = [a for a in ours if a not in ("--force", "--skip-host-checks")]
    ds = deepspeed_args(ds_flags)
    hosts = hostfile.parse_hostfile(ds.hostfile)
    active = hostfile.active_hosts(hosts, ds.include, ds.exclude, ds.num_nodes, ds.num_gpus)
    if ds.no_ssh and not 0 <= ds.node_rank < len(active):  # DeepSpeed asserts it, after starting
        raise UsageError(f"launch --no_ssh: needs --node_rank R, this node's line in {ds.hostfile} (0 to"
                         f" {len(active) - 1})" if ds.node_rank == -1 else
                         f"launch --no_ssh: --node_rank {ds.node_rank} is not a node of {ds.hostfile}"
                         f" (0 to {len(active) - 1})")
    slots = [len(s) for s in active.values()]
    messages = [f"launch: {len(active)} node(s) ({', '.join(f'{h}:{n}' for h, n in zip(active, slots))}),"
                f" world {sum(slots)}"]
    cfg = resolve_config(train_args)  # the driver's own validation of the train flags, before any node starts
    if cfg.observe.golden:  # a golden file of another config: refused before any rank starts
        GoldenCheck.load(cfg.observe.golden, cfg)
    name, profile = "auto", {}
    if cfg.parallel.profile == "auto":
        messages.append("launch: --profile auto: each node picks its profile; no world-size check, no profile"
                        " environment")
    else:
        name, profile = load_profile(cfg.parallel.profile)
        if force:
            messages.append(f"launch: --force: world size not checked against profile {name}")
        else:
            hostfile.check_world(name, profile, slots)
    # the profile's zerotrain.env, and hostfile.FORWARDED (HF_*, WANDB_*, ...) whatever the profile
    env, passed, missing = hostfile.rank_env(profile, f"profile {name}")
    messages.append("launch: " + hostfile.describe_env(env, passed, missing))
    ssh_mode = not ds.no_ssh and (len(active) > 1 or ds.force_multi)
    if ssh_mode and check_hosts_over_ssh and not skip_hosts:
        hostfile.check_hosts(list(active), ds.ssh_port)
        messages.append(f"launch: {len(active)} host(s) reachable over ssh, all running {hostfile.version_line()}")
    extra = []
    if ssh_mode and passed and ds.log_level in ("debug", "info") and not any(a.startswith("--log_level") for a in ours):
        # The runner logs its whole pdsh command, exports (secrets) included, at info level.
        extra = ["--log_level=warning"]
    cmd = [*deepspeed_runner(), *ds_flags, *extra, "--module", TRAIN_MODULE, *train_args]
    records = not ds.no_ssh or ds.node_rank == 0  # with --no_ssh every node restarts its own ranks; node 0 records
    if ssh_mode:
        return HostfileLaunch(cmd, {}, env, messages, train_args, records)
    return HostfileLaunch(cmd, env, None, messages, train_args, records)


# -- accelerate ------------------------------------------------------------------------------


# -- Slurm -----------------------------------------------------------------------------------

def slurm_parser() -> Parser:
    p = Parser(prog="zerotrain slurm", description="Render launcher/slurm/train.sbatch and submit it.",
               usage="zerotrain slurm [options] -- [train flags]",
               epilog="The train flags after -- are those of zerotrain train (see its --help).")
    p.add_argument("--nodes", type=int, default=1, help="nodes (one srun task each)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node = slots per hostfile line")
    p.add_argument("--time", default="24:00:00", help="wall-clock limit of one job (sbatch --time)")
    p.add_argument("--job-name", default="zerotrain", help="sbatch --job-name")
    p.add_argument("--partition", default=None, help="sbatch --partition")
    p.add_argument("--account", default=None, help="sbatch --account")
    p.add_argument("--cpus-per-task", type=int, default=None, help="CPU cores per node")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="one more #SBATCH line, e.g. --sbatch-arg=--exclusive (repeatable)")
    p.add_argument("--max-requeues", type=int, default=3,
                   help="requeue after a stop by signal (exit 6) or a restartable end (hung, a lost rank, a crash:"
                        " as zerotrain launch --max-restarts) at most this many times in all (0: never)")
    p.add_argument("--signal-seconds", type=int, default=120,
                   help="SIGTERM this many seconds before the time limit (#SBATCH --signal=B:TERM@S)")
    p.add_argument("--master-port", type=int, default=29500, help="the rendezvous port on the first node")
    p.add_argument("--python", default=sys.executable,
                   help="the Python of the zerotrain install on the nodes (default: the one running this command)")
    p.add_argument("--workdir", default=None, help="logs, hostfiles and exit codes (default OUT/slurm)")
    p.add_argument("--force", action="store_true", help="skip the world-size check against the profile")
    p.add_argument("--dry-run", action="store_true", help="print the script and the commands; submit nothing")
    return p


def slurm_final_codes() -> str:
    """The codes after which the script never requeues: END_KINDS' final ones, but 6 (a stop by Slurm's signal
    before the time limit: requeued to continue)."""
    return " ".join(str(c) for c in final_exit_codes() if c != EXIT_SIGNAL)


def render_sbatch(ns: argparse.Namespace, train_args: list[str], workdir: Path) -> str:
    q = shlex.quote
    extra = [f"#SBATCH --gpus-per-node={ns.gpus_per_node}"] if ns.accelerator_gpus else []
    extra += [f"#SBATCH --partition={ns.partition}"] if ns.partition else []
    extra += [f"#SBATCH --account={ns.account}"] if ns.account else []
    extra += [f"#SBATCH --cpus-per-task={ns.cpus_per_task}"] if ns.cpus_per_task else []
    extra += [f"#SBATCH {a}" for a in ns.sbatch_arg]
    values = {
        "JOB_NAME": ns.job_name, "NODES": str(ns.nodes), "TIME": ns.time, "SIGNAL_SECONDS": str(ns.signal_seconds),
        "OUTPUT": str(workdir / "%x-%j.out"), "EXTRA_SBATCH": "\n".join(extra),
        "PYTHON": q(ns.python), "CWD": q(str(Path.cwd())), "WORKDIR": q(str(workdir)),
        "GPUS_PER_NODE": str(ns.gpus_per_node), "MASTER_PORT": str(ns.master_port),
        "MAX_REQUEUES": str(ns.max_requeues), "EXIT_SIGNAL": str(EXIT_SIGNAL),
        "FINAL_CODES": slurm_final_codes(),
        "LAUNCH_ARGS": " ".join(["--force"] if ns.force else []),
        "TRAIN_ARGS": " ".join(q(a) for a in train_args),
    }
    text = SBATCH_TEMPLATE.read_text()
    for key, value in values.items():
        text = text.replace(f"@@{key}@@", value)
    return text


def node_commands(ns: argparse.Namespace, train_args: list[str], workdir: Path, hosts: list[str],
                  job_dir: str) -> list[str]:
    """The command each node's srun task runs (what the script's srun line expands to)."""
    cmds = []
    for rank, _ in enumerate(hosts):
        argv = [ns.python, "-m", "zerotrain", "launch", "--hostfile", f"{job_dir}/hostfile", "--no_ssh",
                "--node_rank", str(rank), "--master_addr", hosts[0], "--master_port", str(ns.master_port),
                *(["--force"] if ns.force else []), "--", *train_args, "--resume", "auto"]
        cmds.append(f"ZEROTRAIN_EXIT_FILE={job_dir}/exit.{rank} " + shlex.join(argv))
    return cmds


def slurm_main(argv: list[str]) -> None:
    i = argv.index("--") if "--" in argv else len(argv)
    ns, train_args = slurm_parser().parse_args(argv[:i]), argv[i + 1:]
    for name in ("nodes", "gpus_per_node", "signal_seconds", "master_port"):
        if getattr(ns, name) < 1:
            raise UsageError(f"slurm --{name.replace('_', '-')}: must be at least 1, got {getattr(ns, name)}")
    if ns.max_requeues < 0:
        raise UsageError(f"slurm --max-requeues: must be 0 or more, got {ns.max_requeues}")
    if any(a == "--resume" or a.startswith("--resume=") for a in train_args):
        raise UsageError("slurm: --resume: the script always resumes with --resume auto (a requeued job continues"
                         " its run); drop it")
    cfg = resolve_config(train_args + ["--resume", "auto"])  # the driver's checks, before anything is queued
    if cfg.observe.golden:  # a golden file of another config: refused before any rank starts
        GoldenCheck.load(cfg.observe.golden, cfg)
    ns.accelerator_gpus = True
    if cfg.parallel.profile != "auto":
        name, profile = load_profile(cfg.parallel.profile)
        ns.accelerator_gpus = profile_value(profile, "hardware", {}).get("accelerator") != "cpu"
        if not ns.force:
            hostfile.check_world(name, profile, [ns.gpus_per_node] * ns.nodes)
    workdir = Path(ns.workdir or Path(cfg.run.out) / "slurm").resolve()
    script = render_sbatch(ns, train_args, workdir)
    if ns.dry_run:
        print(script, end="" if script.endswith("\n") else "\n")
        print("# --- what it would run ---")
        print(f"sbatch {workdir}/{ns.job_name}.sbatch")
        hosts = allocated_hosts() or [f"<node {n}>" for n in range(ns.nodes)]
        job_id, restarts = os.environ.get("SLURM_JOB_ID", "<job id>"), os.environ.get("SLURM_RESTART_COUNT", "0")
        job_dir = f"{workdir}/job-{job_id}-r{restarts}"
        print(f"# hostfile {job_dir}/hostfile:")
        for host in hosts:
            print(f"#   {host} slots={ns.gpus_per_node}")
        for rank, cmd in enumerate(node_commands(ns, train_args, workdir, hosts, job_dir)):
            print(f"# node {rank} ({hosts[rank]}), srun task:\n{cmd}")
        print(f"# after a stop by signal (node 0 exits {EXIT_SIGNAL}) or a restartable end (node 0 exits any code"
              f" but {slurm_final_codes()}), with fewer than {ns.max_requeues} requeues so far (SLURM_RESTART_COUNT):"
              " scontrol requeue $SLURM_JOB_ID")
        return
    if shutil.which("sbatch") is None:
        raise UsageError("slurm: no sbatch command here (not a Slurm login node?); --dry-run prints the script")
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"{ns.job_name}.sbatch"
    path.write_text(script)
    proc = subprocess.run(["sbatch", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UsageError(f"slurm: sbatch {path} failed: {(proc.stderr.strip().splitlines() or ['no message'])[-1]}")
    print(proc.stdout.strip())
    print(f"script {path}; logs {workdir}/{ns.job_name}-<job id>.out")


def allocated_hosts() -> list[str]:
    """The hostnames of the current Slurm allocation (scontrol show hostnames), [] outside one."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist or shutil.which("scontrol") is None:
        return []
    proc = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
    return proc.stdout.split() if proc.returncode == 0 else []
