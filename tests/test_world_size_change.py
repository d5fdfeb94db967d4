"""Resume on another world size: 2 -> 1 -> 2 ranks under the real launchers,
ZeRO-2 and ZeRO-3. Model and optimizer go through DeepSpeed's universal checkpoint, the data
re-splits what was left of the epoch: the loss continues (no jump back to the initial loss,
DeepSpeed issue #6691), the global batch stays the same, and no document is repeated.
The exact equality of weights and Adam state across the change is test_universal.py's."""
import json

import pytest

from conftest import cpu_profile, launch, read_metrics

pytestmark = pytest.mark.launches  # every test here starts a process (make test-fast leaves them out)

FLAGS = ["--model", "debug", "--seq-len", "64", "--micro-batch", "2", "--lr", "3e-3", "--warmup-steps", "2",
         "--log-data-every-steps", "0", "--save-every-steps", "4"]


@pytest.mark.parametrize("stage", [3])  # ZeRO-2 across the change: test_universal.py (engine level)
def test_two_to_one_to_two_ranks(stage, tmp_path, mix_path):
    out = tmp_path / "runs"
    args = ["--profile", cpu_profile(tmp_path, stage=stage), "--data", str(mix_path), "--out", str(out), "--run-id", "r",
            *FLAGS, "--eval-tokens", "2000", "--eval-every-steps", "4", "--keep-best", "2", "--keep-last", "1"]
    first = launch("deepspeed", args + ["--max-steps", "8"])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    one = launch("python", args + ["--max-steps", "12"])  # the same run on 1 rank
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert "converted" in one.stdout and "universal" in one.stdout and "re-split over 1" in one.stdout
    assert json.loads((out / "r" / "ds_config.json").read_text())["gradient_accumulation_steps"] == 2
    two = launch("deepspeed", args + ["--max-steps", "16"])  # and back on 2
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "re-split over 2" in two.stdout
    history = read_metrics(out / "r")
    assert [m["step"] for m in history] == list(range(1, 17))
    assert [m["tokens_seen"] for m in history] == [k * 4 * 64 for k in range(1, 17)]  # global batch kept
    losses = [m["loss"] for m in history]
    initial = losses[0]
    for k in (8, 12):  # right after each change the loss continues where it was, not from scratch
        assert losses[k] < initial - 0.5 and abs(losses[k] - losses[k - 1]) < 0.5, losses
    assert len({m["tokens_sha"] for m in history}) == 16  # no step saw the same data again
    assert not (out / "r" / "checkpoints" / "universal").exists()  # removed once the new world saved
    # --keep-best 2 across both changes: the two lowest of all evaluations (steps 4, 8 on 2 ranks, 12 on 1, 16 on 2)
    evals = {m["step"]: m["val_loss"] for m in history if "val_loss" in m}
    assert sorted(evals) == [4, 8, 12, 16]
    kept = sorted(evals, key=lambda s: (evals[s], s))[:2]
    best = json.loads((out / "r" / "checkpoints" / "best.json").read_text())
    assert [b["step"] for b in best["kept"]] == kept
    assert all((out / "r" / "checkpoints" / f"global_step{s}" / "zerotrain.json").is_file() for s in kept)


def test_a_run_grows_from_one_rank_with_the_profiles_micro_batch_lowered(tmp_path):
    """keep_global_batch: a run that started on 1 rank at the profile's micro-batch 8 (global batch 8) resumes on 2
    at 4 (was: refused, and a --micro-batch to fix it refused as drift); a --micro-batch given that does not divide
    is refused in one line naming what would; the micro-batch and accumulation are no drift on another world."""
    from zerotrain.launcher.config_resolve import drift, resolve_config
    from zerotrain.launcher.errors import UsageError
    from zerotrain.launcher.resize.layout import keep_global_batch

    saved = tmp_path / "ds_config.json"
    saved.write_text(json.dumps({"train_batch_size": 8}))
    ds = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "train_batch_size": 16}
    grown = keep_global_batch(ds, tmp_path, 1, 2, saved, None, checked=True, micro_given=False)
    assert (grown["train_micro_batch_size_per_gpu"], grown["gradient_accumulation_steps"], grown["train_batch_size"]) \
        == (4, 1, 8)
    three = keep_global_batch({**ds, "train_micro_batch_size_per_gpu": 3}, tmp_path, 1, 2, saved, None, checked=True,
                              micro_given=False)
    assert (three["train_micro_batch_size_per_gpu"], three["gradient_accumulation_steps"]) == (2, 2)
    tag = tmp_path / "r1" / "checkpoints" / "global_step2"  # the advice names the run: another --micro-batch is
    with pytest.raises(UsageError, match=r"x --micro-batch 8; resume with --run-id r1 \(another --micro-batch is"
                                         r" otherwise another run\) and a --micro-batch that divides 4, or none"):
        keep_global_batch(ds, tag, 1, 2, saved, None, checked=True, micro_given=True)  # another run id otherwise
    base = ["--data", "mix.json", "--lr", "1e-3", "--warmup-steps", "2"]
    saved_run = resolve_config(base).to_dict()
    assert drift(resolve_config(base + ["--micro-batch", "4"]), saved_run) == ["micro_batch None -> 4"]
    assert drift(resolve_config(base + ["--micro-batch", "4"]), saved_run, layout_free=True) == []
