"""DeepSpeed's launcher internals: its runner's parser and host selection (zerotrain launch), and the CPU
shared-memory all-reduce buffer each launch leaves in /dev/shm."""
from __future__ import annotations

import os
from pathlib import Path

from zerotrain.launcher.components.ds_compat.names import PrivateName

# the DeepSpeed names this part relies on (ds_compat.PRIVATE_NAMES gathers them; check_deepspeed_version)
NAMES = (
    PrivateName("deepspeed.launcher.runner", "parse_args", "zerotrain launch: deepspeed flags checked", True),
    PrivateName("deepspeed.launcher.runner", "parse_inclusion_exclusion",
                "zerotrain launch --hostfile: the hosts DeepSpeed will use", True),
    PrivateName("deepspeed.launcher.runner", "apply_num_nodes_and_gpus",
                "zerotrain launch --hostfile: the hosts DeepSpeed will use", True),
    PrivateName("deepspeed", "", "each CPU launch removes its 66 MB /dev/shm buffer", False,
                source_has='#define SHM_BUFFER_NAME "deepspeed_allreduce_buffer"', file="ops/csrc/cpu/comm/shm.cpp"),
)


SHM_BUFFER_NAME = "deepspeed_allreduce_buffer"  # shm.cpp's SHM_BUFFER_NAME (checked in NAMES above)


def shm_buffer_path(rank: int) -> Path:
    """The file DeepSpeed's CPU shared-memory all-reduce maps for `rank` of this launch.

    Matches deepspeed/ops/csrc/cpu/comm/shm.cpp (0.19.8), shm_initialize: SHM_BUFFER_NAME
    "deepspeed_allreduce_buffer", then "_%d_%s_%s" of getuid(), MASTER_ADDR, MASTER_PORT, then "_%d"
    of the rank; shm_open puts it under /dev/shm.
    """
    return Path(f"/dev/shm/{SHM_BUFFER_NAME}_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
                f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def allreduce_buffer_files(port: int | str | None = None) -> list[Path]:
    """This user's CPU shared-memory all-reduce buffers in /dev/shm (named as shm_buffer_path says): those of
    the launch whose MASTER_PORT is `port`, or of every launch (None). A killed launch leaves its buffers
    (~66 MB a rank) behind; whoever started it removes them with these names."""
    pattern = f"{SHM_BUFFER_NAME}_{os.getuid()}_*" + (f"_{port}_*" if port is not None else "")
    return sorted(Path("/dev/shm").glob(pattern))


def unlink_shm_buffer(rank: int) -> None:
    """Remove this rank's ~66 MB shared-memory all-reduce buffer, which DeepSpeed creates in
    init_distributed and never removes (a test suite or a notebook leaks RAM with every launch).

    Safe once init_distributed has returned and a collective has completed: every rank has mapped every
    buffer by then (shm.cpp's shm_initialize spins until they exist), and the mappings stay valid until
    the processes exit; only the name goes.
    """
    try:
        os.unlink(shm_buffer_path(rank))
    except OSError:
        pass


# -- DeepSpeed's launcher (deepspeed/launcher/runner.py) -------------------------------------------

def runner_parse_args(argv: list[str]):
    """DeepSpeed's runner flags parsed by the runner's own parser (SystemExit on an error, as argparse).

    Matches deepspeed/launcher/runner.py (0.19.8) parse_args(args): the `deepspeed` command's parser,
    module-level, not part of DeepSpeed's documented API.
    """
    from deepspeed.launcher.runner import parse_args

    return parse_args(argv)


def runner_active_hosts(hosts, include: str, exclude: str, num_nodes: int, num_gpus: int):
    """The hosts and slots DeepSpeed's runner will use, by its own filters.

    Matches deepspeed/launcher/runner.py (0.19.8): parse_inclusion_exclusion(resource_pool,
    inclusion, exclusion) (ValueError on a bad filter), then apply_num_nodes_and_gpus(active_resources,
    num_nodes, num_gpus), as its main() applies them.
    """
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus, parse_inclusion_exclusion

    return apply_num_nodes_and_gpus(parse_inclusion_exclusion(hosts, include, exclude), num_nodes, num_gpus)
