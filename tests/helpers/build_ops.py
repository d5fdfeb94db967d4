"""Load (and so JIT-build where needed) the DeepSpeed ops the CPU suite uses, in the order it first needs them.

    python tests/helpers/build_ops.py [shm] [background]

`shm`: DeepSpeed's shared-memory allreduce op (deepspeed_shm_comm), which every CPU launch loads.
`background`: CPU Adam (the offload runs), CPU Lion (the optimizer tests), async I/O (NVMe; only where libaio is
there to build it). Neither: both, shm first. An op already built loads in seconds; torch rebuilds one built by
another virtual environment's DeepSpeed (the include paths are part of its build's hash), and a process that
loads an op another process is building waits on torch's lock for it.

Run by tests/conftest.py (its `shm` once the tests are collected, its `background` beside the tests) and by the
Makefile, which starts it as soon as DeepSpeed is installed on a fresh `make test`, on the core pip leaves idle.
Every caller gives it the environment the suite's ranks have (tests/conftest.py pytest_configure: `CXX`,
`CUDA_VISIBLE_DEVICES=""`): ninja rebuilds an op whose compiler command changed. Imports DeepSpeed only, so
that it can run while pip is still installing the rest.
"""
import sys

# in the order the suite first needs them (tests/conftest.py LONGEST_FIRST): CPU Adam (test_eval_tasks), CPU Lion
# (test_optimizers), async I/O (test_offload_runs, after them)
BACKGROUND_OPS = {"cpu_adam": "CPUAdamBuilder", "cpu_lion": "CPULionBuilder", "async_io": "AsyncIOBuilder"}


def build_shm() -> None:
    from deepspeed.comm.torch import build_shm_op

    if build_shm_op() is None:
        raise SystemExit("build_ops: DeepSpeed's deepspeed_shm_comm op is not compatible with this host")


def build_background() -> None:
    from deepspeed.ops import op_builder

    for name in BACKGROUND_OPS.values():
        builder = getattr(op_builder, name)()
        if builder.is_compatible(False):
            builder.load(verbose=False)


def main(argv: list[str]) -> None:
    which = argv or ["shm", "background"]
    unknown = set(which) - {"shm", "background"}
    if unknown:
        raise SystemExit(f"build_ops: unknown part(s) {', '.join(sorted(unknown))}: shm, background")
    if "shm" in which:
        build_shm()
    if "background" in which:
        build_background()


if __name__ == "__main__":
    main(sys.argv[1:])
