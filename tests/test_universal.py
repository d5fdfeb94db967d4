"""Resume on another world size through DeepSpeed's universal checkpoint (launcher/resize/universal.py).

One chain of three real `deepspeed` launches (tests/helpers/universal_harness.py, CPU, gloo, fp32):
2 ranks train 3 steps and save; 1 rank converts, resumes, takes a step and saves; 2 ranks convert
that, resume and take a step. Each for ZeRO-2, ZeRO-3, and ZeRO-3 with persistent parameters
(the GPU profiles' setting). The global batch is the same at both world sizes, so what a resume
must reproduce is known exactly:

- the fp32 master weights and Adam's moments are copied, not recomputed: equal bit for bit;
- Adam's step, the lr, the scheduler's step, `global_steps` and the client_state come back;
- the first step after the resume sees the same weights and the same global batch as the step a
  same-world run took after the save, so its loss and its update agree up to the order of the
  float reductions (measured here: identical; asserted to 1e-5 of the loss, 1e-3 of the update).
  A resume "as if from scratch" (DeepSpeed issue #6691) fails the loss check, a lost Adam state
  the moment and update checks (zeroing Adam's state after the load moved the weights 1.7x the
  whole update away from the same-world run's).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import BIN, REPO, free_port
from zerotrain.launcher.resize import universal
from zerotrain.launcher.components.ds_compat import allreduce_buffer_files
from zerotrain.launcher.errors import UsageError

HARNESS = REPO / "tests" / "helpers" / "universal_harness.py"
VARIANTS = ("zero2", "zero3", "zero3-persist")
K = 3  # the harness's first save


def harness(phase: str, nproc: int, work: Path) -> None:
    port = free_port()
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(port), str(HARNESS),
           "--phase", phase, "--work", str(work), "--variants", ",".join(VARIANTS)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    leaked = allreduce_buffer_files(port)
    for path in leaked:
        path.unlink()
    assert done.returncode == 0, f"{phase}: " + done.stdout[-3000:] + done.stderr[-3000:]
    # the harness leaves with os._exit (helpers/harness_exit.py): the ranks' ~66 MB /dev/shm buffers went
    # when they joined (process_group.init_process_group), not at a teardown that never runs
    assert leaked == [], leaked


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("universal")
    for phase, nproc in (("first", 2), ("shrink", 1), ("grow", 2)):
        harness(phase, nproc, work)
    return work


@pytest.mark.launches
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("phase", ["shrink", "grow"])  # 2 -> 1 ranks, then 1 -> 2
def test_resume_on_another_world_size_continues_exactly(chain, phase, variant):
    r = json.loads((chain / f"result-{phase}-{variant}.json").read_text())
    assert r["world"] == (1 if phase == "shrink" else 2)
    assert r["param_diff"] == 0.0 and r["exp_avg_diff"] == 0.0 and r["exp_avg_sq_diff"] == 0.0, r
    assert r["loaded"] == r["saved"]  # Adam step, lr, scheduler step, global_steps
    assert r["client_state"] == r["expected_client_state"]
    assert r["loss_resumed"] == pytest.approx(r["loss_same_world"], rel=1e-5)
    assert r["loss_resumed"] < r["loss_initial"] - 0.5, r  # the loss went on falling, not back to 5.6
    assert r["update_size"] > 1e-4  # the comparison below compares a real update
    assert r["update_diff"] <= 1e-3 * r["update_size"], r
    # the conversion went to checkpoints/universal/<tag>: no temporary directory, no `latest_universal`
    assert r["universal_dir"] == [f"global_step{K if phase == 'shrink' else K + 1}"]


@pytest.mark.launches
def test_failed_conversion_stops_every_rank_with_one_line(chain):
    messages = [json.loads((chain / f"result-failure-rank{r}.json").read_text())["message"] for r in (0, 1)]
    assert messages[0] == messages[1]
    assert "\n" not in messages[0]
    assert messages[0].startswith(f"checkpoint {chain / 'corrupt' / 'checkpoints' / f'global_step{K}'}:"
                                  " DeepSpeed's universal conversion failed (exit 1): RuntimeError: ")  # its exception
    left = sorted(p.name for p in (chain / "corrupt" / "checkpoints" / "universal").iterdir())
    assert left == [f".global_step{K}.failed"]  # nothing half-written


@pytest.mark.launches
def test_convert_reuses_a_finished_conversion_and_clears_a_killed_one(chain, tmp_path, monkeypatch):
    tag = tmp_path / "checkpoints" / f"global_step{K}"
    shutil.copytree(chain / "zero3" / "first" / "checkpoints" / tag.name, tag)
    out = universal.universal_dir_for(tag)
    killed = out.parent / f".tmp-{tag.name}-999999" / tag.name  # what a kill mid-conversion leaves
    (killed / "zero").mkdir(parents=True)
    assert not universal.is_converted(tag)
    assert universal.convert(tag) == out
    assert sorted(p.name for p in out.parent.iterdir()) == [tag.name]
    assert (out / "zero" / "optimizer_state.pt").is_file()
    made = (out / universal.MARKER).stat().st_mtime_ns
    with monkeypatch.context() as m:  # reused, not converted again: no conversion process is started
        m.setattr(universal.subprocess, "run", lambda *a, **k: pytest.fail(f"converted again: {a}"))
        assert universal.convert(tag) == out and (out / universal.MARKER).stat().st_mtime_ns == made
    shard = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    os.utime(shard, ns=(made + 10**9, made + 10**9))  # the tag was saved again since (same sizes)
    assert not universal.is_converted(tag)
    assert universal.convert(tag) == out and universal.is_converted(tag)  # converted again, replacing the old
    assert sorted(p.name for p in out.parent.iterdir()) == [tag.name]


def fake_tag(root: Path, stage: int, saved_world: int = 2, shards: int = 2, marker: bool = True) -> Path:
    """A tag directory with DeepSpeed's file names (empty files: check_supported reads names only)."""
    tag = root / "checkpoints" / "global_step5"
    tag.mkdir(parents=True)
    for r in range(shards):
        (tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").touch()
        if stage == 3:
            (tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt").touch()
    if stage != 3:
        (tag / "mp_rank_00_model_states.pt").touch()
    if marker:
        (tag / "zerotrain.json").write_text(json.dumps({"step": 5, "world_size": saved_world}))
    return tag


def config(stage=3, optimizer="AdamW", **zero) -> dict:
    return {"zero_optimization": {"stage": stage, **zero}, "optimizer": {"type": optimizer, "params": {}}}


@pytest.mark.parametrize("cfg, tag_args, says", [
    (config(stage=0), None, "ZeRO stage 1, 2 or 3 (DeepSpeed's universal checkpoint), this config has stage 0"),
    (config(optimizer="SGD"), None, "carries Adam/AdamW state only, the optimizer is 'sgd'"),
    ({"zero_optimization": {"stage": 2}}, None, "the optimizer is 'not set in the config'"),
    (config(offload_optimizer={"device": "nvme"}), None, "zero_optimization.offload_optimizer on NVMe"),
    (config(offload_param={"device": "nvme"}), None, "zero_optimization.offload_param on NVMe"),
    (config(stage=3), dict(stage=2), "saved under ZeRO-1/2, this config has ZeRO-3"),
    (config(stage=2), dict(stage=3), "saved under ZeRO-3, this config has ZeRO-2"),
    (config(stage=3), dict(stage=3, shards=1), "saved by 2 ranks but 1 optimizer shard(s) are visible here"),
    (config(stage=3), dict(stage=3, marker=False), "not a complete zerotrain checkpoint (no zerotrain.json)"),
])
def test_what_deepspeed_cannot_do_is_refused_with_one_line(tmp_path, cfg, tag_args, says):
    tag = fake_tag(tmp_path, **tag_args) if tag_args else None
    with pytest.raises(UsageError) as e:
        universal.check_supported(cfg, tag)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_supported_configs_pass_and_the_load_config_is_a_copy(tmp_path):
    universal.check_supported(config(stage=2, optimizer="Adam", offload_optimizer={"device": "cpu"}),
                              fake_tag(tmp_path / "a", stage=2))
    universal.check_supported(config(stage=3), fake_tag(tmp_path / "b", stage=3, saved_world=1, shards=1))
    base = {**config(), "checkpoint": {"tag_validation": "Warn"}}
    out = universal.ds_config_for_universal(base)
    assert out["checkpoint"] == {"tag_validation": "Warn", "load_universal": True}
    assert base["checkpoint"] == {"tag_validation": "Warn"}
