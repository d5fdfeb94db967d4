"""bf16 end to end: a user-written bf16 copy of the cpu profiles (`"bf16": {"enabled":
true}`, nothing else changed) on 2 ranks under the real `deepspeed` launcher, at ZeRO-2 (cpu-zero2) and ZeRO-3
(cpu), as every GPU profile trains. This CPU runs bf16 matmuls natively with AVX-512 BF16; where it is missing
(AVX2 CI hosts) PyTorch emulates them, slowly: the shapes stay tiny (debug model, seq 64, 8 steps).

Per stage two launches serve every assertion: one run (eval every 4 steps, saves at 4 and 8) killed with kill -9
once its step-4 checkpoint is complete and step 7 is logged (rank 0 held on entering the step-8 save, so it
cannot finish first), then resumed with `--resume auto` to the end; the steps logged before the kill are the
uninterrupted history the resume must reproduce. Shown:
- the loss falls, checkpoints save, and DeepSpeed's dict says bf16 with gradients accumulated in fp32;
- ZeRO-2 and ZeRO-3 start from the same bf16 weights and train the same model (to bf16 rounding);
- the resumed run logs the killed run's token digests and losses bit for bit;
- evaluation runs, best.json names the lowest validation loss, `zerotrain export --best` takes it;
- `zerotrain export` writes a model transformers loads, whose logits match the live model's to bf16
  tolerance. The live model is the engine's bf16 weights (DeepSpeed copies the fp32 master into them after
  every step): rebuilt from the checkpoint it reproduces the run's own last val_loss exactly, and at ZeRO-2
  the bf16 export equals the module weights the engine saved, bit for bit.
The precision code itself (launcher/profiles.py accumulate_in_fp32, the fp32 losses a bf16 model returns)
is unit-tested without a process group in tests/test_gpu_path.py.
"""
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from zerotrain.launcher.components.ds_compat import allreduce_buffer_files
from conftest import BIN, REPO, TRAIN_PY, free_port, launch, read_metrics
from test_long_runs import popen

pytestmark = pytest.mark.launches  # every test here starts a process (make test-fast leaves them out)

N = 8
FLAGS = ["--model", "debug", "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "2", "--lr", "3e-3",
         "--warmup-steps", "1", "--log-data-every-steps", "0", "--eval-tokens", "2000", "--eval-every-steps", "4",
         "--max-steps", str(N)]
STAGES = {2: "cpu-zero2", 3: "cpu"}


def bf16_copy(tmp: Path, name: str) -> str:
    """What a user writes: the shipped profile with bf16 enabled, nothing else changed."""
    profile = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    profile["bf16"] = {"enabled": True}
    path = tmp / f"{name}-bf16.json"
    path.write_text(json.dumps(profile, indent=2))
    return str(path)


def remove_shm(port: int) -> None:
    """A killed run cannot remove DeepSpeed's shared-memory all-reduce buffers (named by the master port)."""
    for leaked in allreduce_buffer_files(port):
        leaked.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mix_path):
    tmp = tmp_path_factory.mktemp("bf16")
    out = {}
    for stage, name in STAGES.items():
        args = ["--profile", bf16_copy(tmp, name), "--data", str(mix_path), "--out", str(tmp / f"z{stage}"), *FLAGS,
                "--run-id", "r", "--save-every-steps", "4"]
        run, port = tmp / f"z{stage}" / "r", free_port()
        cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), str(TRAIN_PY), *args]
        proc = popen(cmd, {"ZEROTRAIN_TEST_HANG": f"0:save:{N}"})
        marker = run / "checkpoints" / "global_step4" / "zerotrain.json"
        try:
            deadline = time.time() + 400
            while time.time() < deadline and proc.poll() is None:
                if marker.is_file() and any(m["step"] >= N - 1 for m in read_metrics(run)):
                    break
                time.sleep(0.1)
            assert proc.poll() is None and marker.is_file(), "ended, or no step-4 checkpoint, before the kill"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            proc.stdout.close()
            remove_shm(port)
        before = read_metrics(run)
        resumed = launch("deepspeed", args + ["--resume", "auto"])
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        out[stage] = {"ref": run, "before_kill": before, "stdout": resumed.stdout}
    return out


def test_bf16_trains_and_saves_under_zero2_and_zero3_with_fp32_accumulation(runs):
    for stage, r in runs.items():
        ds = json.loads((r["ref"] / "ds_config.json").read_text())
        assert ds["bf16"] == {"enabled": True} and ds["zero_optimization"]["stage"] == stage
        assert ds["data_types"] == {"grad_accum_dtype": "fp32"}  # launcher/profiles.py accumulate_in_fp32
        assert "precision: bf16" in r["stdout"] and "gradients accumulated over micro-batches in fp32" in r["stdout"]
        assert "optimizer implementation on cpu: torch.optim.AdamW(fused=True)" in r["stdout"]
        history = read_metrics(r["ref"])
        assert [m["step"] for m in history] == list(range(1, N + 1))
        losses = [m["loss"] for m in history]
        assert losses[-1] < losses[0] - 1.0, losses  # ~5.8 (ln 258 + init) down to ~3.3
        tag = r["ref"] / "checkpoints" / f"global_step{N}"
        assert (tag / "zerotrain.json").is_file()
        assert sorted(p.name for p in tag.glob("bf16_zero_pp_rank_*_optim_states.pt")) == [
            f"bf16_zero_pp_rank_{i}_mp_rank_00_optim_states.pt" for i in (0, 1)]
    # Both stages start from the same bf16 weights and train the same model; their gradient reductions round
    # differently in bf16 (ZeRO-3 divides by the world size before its all-reduce), so not bit for bit.
    z2, z3 = ([m["loss"] for m in read_metrics(runs[s]["ref"])] for s in (2, 3))
    assert z2[0] == z3[0] and z2 == pytest.approx(z3, rel=1e-3, abs=0)


def test_kill_9_and_resume_auto_reproduce_the_losses_bit_for_bit(runs):
    for stage, r in runs.items():
        history, before = read_metrics(r["ref"]), r["before_kill"]
        assert f"resumed from {r['ref'] / 'checkpoints' / 'global_step4'} at step 4" in r["stdout"], stage
        assert [m["step"] for m in history] == list(range(1, N + 1)) and len(before) >= N - 1, stage
        assert [m["tokens_sha"] for m in history[:len(before)]] == [m["tokens_sha"] for m in before], stage
        assert [m["loss"] for m in history[:len(before)]] == [m["loss"] for m in before], stage  # exactly


def test_evaluation_and_the_best_checkpoint(runs, tmp_path):
    from zerotrain.launcher.cli import main as cli

    for stage, r in runs.items():
        evals = {m["step"]: m["val_loss"] for m in read_metrics(r["ref"]) if "val_loss" in m}
        assert sorted(evals) == [4, 8] and all(v == v and v < 10 for v in evals.values())  # finite
        best = json.loads((r["ref"] / "checkpoints" / "best.json").read_text())
        assert best["step"] == min(evals, key=evals.get) and best["val_loss"] == evals[best["step"]]
        cli(["export", str(r["ref"]), "--best", "--to", str(tmp_path / f"best{stage}")])
        assert (tmp_path / f"best{stage}" / "model.safetensors").is_file()


def live_model(run_dir: Path):
    """The engine's model as it was at the end of the run: our Transformer holding the bf16 weights that
    DeepSpeed keeps as the fp32 master rounded to bf16, computing in bf16."""
    from zerotrain.launcher.commands.export import consolidated_state_dict
    from zerotrain.modeling.model import Transformer
    from zerotrain.modeling.sizes import ModelArgs

    config = json.loads((run_dir / "config.json").read_text())
    model = Transformer(ModelArgs(**config["model"]))
    model.load_state_dict(consolidated_state_dict(run_dir / "checkpoints" / f"global_step{N}"))
    model.attention = config["attention"]
    return model.to(torch.bfloat16).eval(), config


def eval_rows(config: dict, tmp: Path) -> dict:
    """The run's eval rows, as its plan made them (a dry run of the same settings elsewhere)."""
    from zerotrain.launcher.config_resolve import config_from
    from zerotrain.launcher.run_plan import plan_run

    values = {k: v for k, v in config["run"].items() if v is not None}
    return plan_run(config_from({**values, "out": str(tmp), "run_id": "plan", "dry_run": True}), 2, 0).eval_rows


def test_export_loads_in_transformers_and_matches_the_live_model(runs, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from zerotrain.launcher.cli import main as cli
    from zerotrain.launcher.components.evaluate import Evaluator
    from zerotrain.modeling import hf

    for stage, r in runs.items():
        model, config = live_model(r["ref"])
        rows = eval_rows(config, tmp_path / f"plan{stage}")
        # It is the live model: the two ranks' shares of the last evaluation give the logged val_loss exactly.
        micro = json.loads((r["ref"] / "ds_config.json").read_text())["train_micro_batch_size_per_gpu"]
        sums = sum(Evaluator(rows, rank, 2, micro).local_sums(model) for rank in (0, 1))
        logged = [m["val_loss"] for m in read_metrics(r["ref"]) if m["step"] == N][0]
        assert Evaluator(rows, 0, 2, micro).finish(sums)["val_loss"] == logged

        x = rows["prose"]["input_ids"][:2]  # (2, 64)
        with torch.no_grad():
            live = model(x).float()
        limit = 2 * 2.0 ** (torch.floor(torch.log2(live.abs().max())).item() - 7)  # 2 bf16 ulps of the largest
        for dtype in ("float32", "bfloat16"):  # the fp32 master weights (the default) and the live bf16 ones
            out = tmp_path / f"hf{stage}-{dtype}"
            cli(["export", str(r["ref"]), "--to", str(out), "--dtype", dtype])
            theirs, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
            assert type(theirs).__name__ == "LlamaForCausalLM" and not info["missing_keys"]
            assert next(theirs.parameters()).dtype == getattr(torch, dtype)
            with torch.no_grad():
                logits = theirs.eval()(x).logits.float()
            assert (logits - live).abs().max().item() <= limit, (dtype, (logits - live).abs().max().item(), limit)
        if stage == 2:  # ZeRO-2 saves the engine's whole bf16 module: the bf16 export is exactly it
            module = torch.load(r["ref"] / "checkpoints" / f"global_step{N}" / "mp_rank_00_model_states.pt",
                                weights_only=False)["module"]
            exported = load_file(tmp_path / f"hf{stage}-bfloat16" / "model.safetensors")
            expected = hf.hf_state_dict(module, model.args, torch.bfloat16)
            assert exported.keys() == expected.keys()
            assert all(torch.equal(exported[k], expected[k]) for k in expected)
