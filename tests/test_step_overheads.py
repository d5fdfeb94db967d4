"""What was made fast stays fast: the driver's per-step agreement is one collective (an
all-gather in StepRunner.agree; nothing else of ours, the trainer, the step or a participant of it, runs a
collective every step), a paused start-up is frozen before the engine is built and collection is back on in the
loop, and checkpoint
files are written without torch's zip CRC-32 (the marker's sha256 is the integrity check) while
torch's process-wide setting is left as it was; a step's clock is read once the device has finished it.
Timings are `make bench`'s, never asserted here.
"""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zerotrain.launcher.components import step_runner
from zerotrain.launcher.components.checkpoints import checkpointer
from zerotrain.launcher.components.observe.phases import PhaseClock, device_done

REPO = Path(__file__).resolve().parent.parent

COUNT_COLLECTIVES = r"""
import collections, gc, json, os, sys
from zerotrain.launcher.components import startup_gc
startup_gc.pause()  # as a rank's entry does (launcher/train.py): the collector off until the trainer resumes it
import torch.distributed as dist
from zerotrain.launcher.config_resolve import config_from
from zerotrain.launcher import trainer
from zerotrain.launcher.components import participants, run_state, step_runner
OURS = os.path.dirname(participants.__file__)  # the step's monitors: each adds fields to agree's one gather
FILES = (trainer.__file__, step_runner.__file__, run_state.__file__)  # the loop, the step, the run's state
calls = collections.Counter()
for name in ("all_gather", "all_reduce", "all_gather_object", "broadcast", "broadcast_object_list", "barrier"):
    fn = getattr(dist, name)
    def counted(*a, _fn=fn, _name=name, **k):
        f = sys._getframe(1)
        where = f.f_code.co_filename
        if where in FILES or where.startswith(OURS + os.sep):  # ours only, not DeepSpeed's
            # agree() times _agree() in the phase clock: count both under the method's name
            calls[f"{f.f_code.co_name.lstrip('_')}:{_name}"] += 1
        return _fn(*a, **k)
    setattr(dist, name, counted)
collector = {}
real_build = trainer.build_engine
def build_engine(*a, **k):  # the collector as the engine is built: on, with start-up frozen
    collector.update(enabled_at_build=gc.isenabled(), frozen_at_build=gc.get_freeze_count())
    return real_build(*a, **k)
trainer.build_engine = build_engine
cfg = json.loads(sys.argv[1])
result = trainer.run(config_from(cfg), hard_exit=False)
collector["enabled_at_end"] = gc.isenabled()
print("COUNTS " + json.dumps({"step": result.step, "calls": calls, "gc": collector}))
"""


@pytest.mark.launches
def test_one_collective_per_step(tmp_path, mix_path):
    steps = 7
    cfg = {"data": str(mix_path), "model": "debug", "profile": "cpu", "seq_len": 64, "micro_batch": 2,
           "max_steps": steps, "warmup_steps": 1, "save_every_steps": 1000, "out": str(tmp_path / "runs"),
           "resume": "never", "log_data_every_steps": 0}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, "-c", COUNT_COLLECTIVES, json.dumps(cfg)], capture_output=True, text=True,
                       cwd=REPO, timeout=300, env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("COUNTS "))[len("COUNTS "):])
    assert got["step"] == steps, got
    calls = got["calls"]
    # The first step's data is agreed alone; every later step's rides on the previous step's all-gather,
    # which also carries the loss, the stop flags and rank 0's gradient norm.
    assert calls.pop("agree:all_gather") == steps + 1, got
    assert not [k for k in calls if k.startswith("agree:")], got
    # Whatever else of ours talks to the other ranks (start-up, the final save) does so a bounded
    # number of times, not once per step.
    assert all(n < steps for n in calls.values()), got
    # The start-up ran without the cyclic collector (components/startup_gc.py): the trainer froze the imports and
    # the plan before the engine (no full scan of them in DeepSpeed's ZeRO-3 build) and the loop turned
    # collection back on; it stayed on to the end.
    assert not got["gc"]["enabled_at_build"] and got["gc"]["frozen_at_build"] > 100_000, got["gc"]
    assert got["gc"]["enabled_at_end"], got["gc"]


def test_checkpoint_writes_skip_the_zip_crc_and_restore_torchs_setting(tmp_path):
    path = tmp_path / "states.pt"
    x = {"w": torch.arange(1000, dtype=torch.float32)}
    before = torch.serialization.get_crc32_options()
    with checkpointer._no_zip_crc32():
        torch.save(x, path)
    assert torch.serialization.get_crc32_options() == before
    with zipfile.ZipFile(path) as z:
        data = [i for i in z.infolist() if "/data/" in i.filename]
    assert data and all(i.CRC == 0 for i in data)  # written without the checksum
    assert torch.equal(torch.load(path, weights_only=True)["w"], x["w"])  # and torch reads it as any other
    torch.save(x, tmp_path / "plain.pt")  # outside the context: torch's default again
    with zipfile.ZipFile(tmp_path / "plain.pt") as z:
        assert any(i.CRC != 0 for i in z.infolist() if "/data/" in i.filename)


@pytest.mark.launches
def test_driver_verifies_shards_quickly_by_default_and_fully_on_request(tmp_path, mix_path, monkeypatch):
    """Start-up (section 1.5): the driver's default is quick verification (hashes once per node,
    remembered by file identity); --verify-data full still hashes every byte. Shown with a cache
    entry that vouches for a tampered shard: quick trusts it (not hashed), full finds the damage."""
    from zerotrain.dataio.format.errors import DataError
    from zerotrain.dataio.format.shards import VerifiedCache
    from zerotrain.launcher.config_resolve import config_from
    from zerotrain.launcher.run_plan import plan_run

    monkeypatch.setenv("ZEROTRAIN_CACHE", str(tmp_path / "cache"))
    shards = tmp_path / "shards"
    prep = subprocess.run([sys.executable, "-m", "zerotrain", "prepare", "--data", str(mix_path), "--out",
                           str(shards), "--shard-tokens", "20000"], capture_output=True, text=True, cwd=REPO)
    assert prep.returncode == 0, prep.stderr
    base = {"data": str(shards), "model": "debug", "profile": "cpu", "seq_len": 64, "micro_batch": 2,
            "max_steps": 2, "out": str(tmp_path / "runs"), "resume": "never"}
    plan_run(config_from(base), 1)  # the node's first start: every shard hashed and remembered
    manifest = json.loads((shards / "manifest.json").read_text())
    first = manifest["shards"][0]
    tokens = shards / first["file"]
    raw = bytearray(tokens.read_bytes())
    raw[-1] ^= 1  # same size, other bytes
    tokens.write_bytes(bytes(raw))
    with VerifiedCache(tmp_path / "cache") as cache:  # the tampered file's new identity, vouched for
        key = cache._key(tokens)
        cache.entries[key] = {**cache.entries[key], "identity": VerifiedCache.identity(tokens)}
        cache.added[key] = cache.entries[key]
    plan_run(config_from(base), 1)  # quick: identities match the cache, nothing hashed
    try:
        plan_run(config_from({**base, "verify_data": "full"}), 1)
    except DataError as e:
        assert first["file"] in str(e) and "sha256" in str(e), e
    else:
        raise AssertionError("--verify-data full did not hash the tampered shard")


class FakeEvent:
    def __init__(self, order: list):
        self.order = order

    def record(self):
        self.order.append("event recorded")

    def synchronize(self):
        self.order.append("event waited on")


def test_the_step_clock_is_read_after_the_device_has_finished_the_step():
    """A fake accelerator with events records the order: the step's work queued, an event recorded at its end
    and waited on, then the compute phase's clock read (step_s, tokens/s, MFU and the health shares follow
    it): once per step."""
    order = []
    clock = PhaseClock(clock=lambda: order.append("clock read") or float(len(order)))
    events = []
    accel = SimpleNamespace(Event=lambda: events.append(FakeEvent(order)) or events[-1])  # the class, called
    fake = SimpleNamespace(clock=clock, accel=accel, compute=lambda batches: order.append("step queued") or 2.0)
    order.clear()
    for _ in range(2):
        assert step_runner.StepRunner.train_step(fake, ["a batch"]) == 2.0
    assert order == ["clock read", "step queued", "event recorded", "event waited on", "clock read"] * 2
    assert len(events) == 2
    device_done(SimpleNamespace(Event=None))  # DeepSpeed's CPU accelerator has none: nothing to wait for
