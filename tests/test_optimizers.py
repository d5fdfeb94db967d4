"""The optimizer registry (launcher/optimizers.py) and per-optimizer lr laws (modeling/sizes.py).

In-process: names, arguments and ZeRO stages refused with one line; the default keeps the run ids
and the DeepSpeed dict of before; the client optimizers against the harness's independent
references; Lion's sign(0); user classes; the lr laws and `zerotrain params --optimizer`.

Launched (2 ranks, the real `deepspeed` launcher, CPU, fp32):
- tests/helpers/optim_harness.py, one launch: every shipped optimizer under ZeRO stages 0-3 (the
  update rule equals a plain-PyTorch reference for 3 steps from a fixed state, the loss falls), and
  exact resume of muon, ademamix and lion at the cpu profile's ZeRO-3;
- the driver itself: a muon run stopped at step 2 and resumed sees bit-identical losses.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import BIN, REPO, free_port, launch, read_metrics
from zerotrain.launcher.offload.ops import offloaded
from zerotrain.launcher.cli import main as cli
from zerotrain.launcher.config import RunConfig
from zerotrain.launcher.config_resolve import config_from, drift, identity_hash, resolve_config
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.model_spec import rule_law_lr
from zerotrain.launcher.optimizers import REGISTRY, law_names, prepare_optimizer, resolve
from zerotrain.launcher.profiles import list_profiles, load_profile, resolve_ds_config
from zerotrain.modeling import sizes
from zerotrain.modeling.model import count_params

sys.path.insert(0, str(REPO / "tests" / "helpers"))
import optim_harness as ref  # noqa: E402  (the reference update rules)

HARNESS = REPO / "tests" / "helpers" / "optim_harness.py"
# Each optimizer's arguments in the launch: chosen so that its rule is far from AdamW's within 3 steps.
LAUNCHED = ["adamw", "muon", "lion", 'adamw-decaying-wd={"weight_decay": 0.01, "wd_timescale": 2}',
            'ademamix={"warmup_steps": 2, "alpha": 8, "betas": [0.9, 0.999, 0.999]}']
# Relative error of the weight change after 3 steps. Muon's Newton-Schulz runs in fp16 on this CPU
# (DeepSpeed's ns_compute_dtype("gram")), the reference in fp64; everything else is fp32 against fp64.
# Lion moves every element by exactly +-lr, so the few elements whose c is within rounding of 0 may
# flip between fp32 and fp64 (measured 0 to 3 of 49k element-steps: errors 7e-6 to 1.3e-2); a wrong
# rule moves most of them (0.7-0.9 against AdamW's).
TOLERANCE = {"muon": 6e-2, "lion": 4e-2}
DEFAULT_TOLERANCE = 1e-3


def cfg(**kw):
    return config_from({"data": "mix.json", **kw})


# ------------------------------------------------------------------------------------------------
# Names, arguments, identity
# ------------------------------------------------------------------------------------------------

def test_default_keeps_run_ids_and_the_deepspeed_dict():
    assert identity_hash(RunConfig.from_flat(dict(data="mix.json"))) == "cea5eb6e"  # the foundation commit's id
    assert identity_hash(cfg(optimizer="adamw")) == "cea5eb6e"  # the default spelled out: the same run
    assert cfg(optimizer="adamw").schedule.optimizer is None
    assert identity_hash(cfg(optimizer="muon")) != "cea5eb6e"
    assert identity_hash(cfg(optimizer="adamw", optimizer_args='{"weight_decay": 0.0}')) != "cea5eb6e"
    for name in list_profiles():  # exactly what resolve_ds_config wrote before the registry
        _, profile = load_profile(name)
        hardware = profile["zerotrain"].get("hardware", {})
        ds = resolve_ds_config(profile, cfg(lr=1e-3), hardware.get("devices_per_node", 1) * hardware.get("nodes", 1),
                               name)
        params = {**profile["optimizer"]["params"], "lr": 1e-3}
        if "optimizer" in offloaded(profile):  # CPU Adam, not torch_adam/fused (optimizers._cpu_adam_when_offloaded)
            params = {k: v for k, v in params.items() if k not in ("torch_adam", "fused")}
        assert ds["optimizer"] == {**profile["optimizer"], "params": params}
        assert ds["gradient_clipping"] == profile["gradient_clipping"] and "zero_allow_untested_optimizer" not in ds


def test_optimizer_and_its_arguments_are_identity():
    saved = cfg(optimizer="muon", optimizer_args='{"momentum": 0.9}').to_dict()
    assert saved["optimizer_args"] == {"momentum": 0.9}  # normalised: a dict in config.json
    assert drift(cfg(optimizer="muon", optimizer_args='{ "momentum":0.9 }'), saved) == []  # spacing is not drift
    assert drift(cfg(optimizer="muon"), saved) == ["optimizer_args {'momentum': 0.9} -> None"]
    assert drift(cfg(optimizer="lion", optimizer_args='{"betas": [0.9, 0.99]}', lr=0.02, min_lr=0.002), saved) == [
        "optimizer 'muon' -> 'lion'", "optimizer_args {'momentum': 0.9} -> {'betas': [0.9, 0.99]}"]


@pytest.mark.parametrize("argv,message", [
    (["--optimizer", "sgdx"], "--optimizer sgdx: unknown optimizer; known: adamw, muon, lion, adamw-decaying-wd,"
                              " ademamix, or module.path:ClassName"),
    (["--optimizer", "no_such_pkg.opt:Mine"], "--optimizer no_such_pkg.opt:Mine: cannot import no_such_pkg.opt"
                                              " (ModuleNotFoundError: No module named 'no_such_pkg')"),
    (["--optimizer", "json:JSONDecoder"], "--optimizer json:JSONDecoder: json.JSONDecoder is not a"
                                          " torch.optim.Optimizer subclass"),
    (["--optimizer", "torch.optim:NoSuch"], "--optimizer torch.optim:NoSuch: torch.optim has no NoSuch"),
    (["--optimizer", "torch.optim"], "--optimizer torch.optim: unknown optimizer"),
    (["--optimizer", "muon", "--optimizer-args", "[0.9]"], "--optimizer-args: expected a JSON object such as"
                                                           " '{\"weight_decay\": 0.0}', got [0.9]"),
    (["--optimizer", "muon", "--optimizer-args", "{momentum: 1}"], "--optimizer-args: not valid JSON"),
    (["--optimizer", "muon", "--optimizer-args", '{"beta": 0.9}'], "--optimizer-args: muon takes no argument 'beta'"
                                                                   " (known: adam_lr, betas, eps, momentum,"
                                                                   " ns_method, weight_decay)"),
    (["--optimizer", "lion", "--optimizer-args", '{"betas": 0.9}'], "--optimizer-args: lion betas must be a list of"
                                                                    " 2 numbers in [0, 1), got 0.9"),
    (["--optimizer", "muon", "--optimizer-args", '{"ns_method": "svd"}'], "muon ns_method must be 'gram' or"
                                                                          " 'standard'"),
    (["--optimizer-args", '{"lr": 1}'], "--optimizer-args: 'lr' is set by --lr"),
    (["--optimizer", "torch.optim:SGD", "--optimizer-args", '{"mom": 0.9}'], "torch.optim:SGD takes no argument"
                                                                             " 'mom' (known: dampening,"),
])
def test_bad_optimizer_input_is_one_line(argv, message):
    with pytest.raises(UsageError) as e:
        resolve_config(["--data", "mix.json", *argv])
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.launches
def test_bad_optimizer_on_the_command_line_exits_2_and_writes_nothing(tmp_path, mix_path):
    out = tmp_path / "runs"
    proc = launch("python", ["--data", str(mix_path), "--out", str(out), "--optimizer", "adam-w", "--max-steps", "1"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("zerotrain: error: --optimizer adam-w: unknown optimizer; known:"
                                                    " adamw, muon, lion, adamw-decaying-wd, ademamix, or"
                                                    " module.path:ClassName")
    assert not out.exists()


# ------------------------------------------------------------------------------------------------
# The DeepSpeed dict each entry produces (plan time)
# ------------------------------------------------------------------------------------------------

def ds_for(stage: int, **kw):
    _, profile = load_profile("cpu")
    profile["zero_optimization"]["stage"] = stage
    return resolve_ds_config(profile, cfg(**kw), 2, "cpu")


def test_muon_section_and_what_we_change_for_deepspeed():
    run = cfg(optimizer="muon", optimizer_args='{"adam_lr": 1e-3}')
    assert (run.schedule.lr, run.schedule.min_lr) == (0.02, 0.002)  # Muon's own default peak lr when --lr is not given
    ds = ds_for(3, optimizer="muon", optimizer_args='{"adam_lr": 1e-3}')
    params = ds["optimizer"]["params"]
    assert ds["optimizer"]["type"] == "Muon" and (params["muon_lr"], params["adam_lr"]) == (0.02, 1e-3)
    assert ds["zero_optimization"]["reduce_scatter"] is False  # DeepSpeed refuses Muon with it under ZeRO-3
    assert ds["gradient_clipping"] == 0.0  # it would clip Muon's update, not the gradient (DeepSpeed #8439)
    assert ds_for(0, optimizer="muon")["gradient_clipping"] == 1.0  # stage 0 clips the gradient: kept
    assert ds_for(2, optimizer="muon", lr=0.01)["optimizer"]["params"]["muon_lr"] == 0.01


@pytest.mark.parametrize("name", ["lion", "adamw-decaying-wd", "ademamix"])
def test_client_optimizers_leave_no_optimizer_section(name):
    ds = ds_for(3, optimizer=name)
    assert "optimizer" not in ds and ds["zero_allow_untested_optimizer"] is True


def test_every_registry_entry_is_documented():
    readme = (REPO / "docs" / "optimizers.md").read_text()
    for name, spec in REGISTRY.items():
        assert f"| `{name}` |" in readme, name
        assert spec.stages == (0, 1, 2, 3)  # what the launch below verifies


# ------------------------------------------------------------------------------------------------
# Client optimizers and Lion's sign(0), single process
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,args", [("adamw-decaying-wd", None), ("ademamix", None),
                                       ("adamw-decaying-wd", '{"wd_timescale": 3, "weight_decay": 0.01}'),
                                       ("ademamix", '{"warmup_steps": 3, "alpha": 8}')])
def test_client_optimizer_matches_the_reference(name, args):
    """Defaults included: wd_timescale = --max-steps // 10, ademamix's warm-up = --max-steps."""
    run = cfg(optimizer=name, optimizer_args=args, max_steps=30, lr=1e-2)
    model = torch.nn.Linear(8, 4)
    start = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    _, optimizer, _ = prepare_optimizer(run, {}, model)
    _, hp = resolve(name, args)
    update = ref.reference_update(name, hp, run, {})
    expected, state = {n: t.clone() for n, t in start.items()}, {}
    torch.manual_seed(0)
    for step in range(6):
        factor = 1.0 - 0.1 * step  # a schedule moving the lr, as LambdaLR does
        for group in optimizer.param_groups:
            group["lr"] = run.schedule.lr * factor
        for n, p in model.named_parameters():
            p.grad = torch.randn_like(p)
            update(n, expected[n], p.grad.double(), state.setdefault(n, {}), factor)
        optimizer.step()
    for n, p in model.named_parameters():
        moved = (expected[n] - start[n]).norm()
        assert float((p.detach().double() - expected[n]).norm() / moved) < 1e-5, n


def test_lion_keeps_sign_of_zero_zero():
    """DeepSpeed's Lion kernels move an element whose momentum and gradient are 0 by a full step
    (CPU: -lr, CUDA: +lr); the wrapper puts such elements back (weight decay still applied)."""
    from zerotrain.launcher.client_optimizers import sign_zero_safe

    class KernelLikeDeepSpeed(torch.optim.Optimizer):  # the CPU kernel's arithmetic, copysign included
        def __init__(self, params, lr, betas, weight_decay):
            super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                b1, b2 = group["betas"]
                for p in group["params"]:
                    m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                    c = b1 * m + (1 - b1) * p.grad
                    p.mul_(1 - group["lr"] * group["weight_decay"]).sub_(torch.copysign(torch.full_like(p, group["lr"]), c))
                    m.mul_(b2).add_(p.grad, alpha=1 - b2)

    for kernel, moves_zeros in ((KernelLikeDeepSpeed, True), (sign_zero_safe(KernelLikeDeepSpeed), False)):
        p = torch.nn.Parameter(torch.ones(4))
        opt = kernel([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
        p.grad = torch.tensor([1.0, -1.0, 0.0, 0.0])
        opt.step()
        assert torch.allclose(p[:2].detach(), torch.tensor([0.95 - 0.1, 0.95 + 0.1]))
        assert torch.allclose(p[2:].detach(), torch.full((2,), 0.95 - 0.1 if moves_zeros else 0.95))


# ------------------------------------------------------------------------------------------------
# A user's optimizer class
# ------------------------------------------------------------------------------------------------

USER_MODULE = '''
import torch

class SignSGD(torch.optim.Optimizer):
    zero_stages = (0, 1, 2)

    def __init__(self, params, lr=1e-3, momentum=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(group["lr"] * p.grad.sign())

class NoLr(torch.optim.Optimizer):
    def __init__(self, params, step_size=1e-3):
        super().__init__(params, dict(step_size=step_size))
'''


def test_user_class(tmp_path, monkeypatch):
    (tmp_path / "mylab_opt.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = cfg(optimizer="mylab_opt:SignSGD", optimizer_args='{"momentum": 0.5}', lr=0.1)
    assert run.schedule.optimizer_args == {"momentum": 0.5}
    with pytest.raises(UsageError, match="mylab_opt:SignSGD takes no argument 'nesterov' \\(known: momentum\\)"):
        cfg(optimizer="mylab_opt:SignSGD", optimizer_args='{"nesterov": true}')
    with pytest.raises(UsageError, match="NoLr.__init__ takes no lr"):
        cfg(optimizer="mylab_opt:NoLr")
    assert "optimizer" not in ds_for(2, optimizer="mylab_opt:SignSGD")
    with pytest.raises(UsageError) as e:  # the class says which stages it supports
        ds_for(3, optimizer="mylab_opt:SignSGD")
    assert str(e.value) == ("--optimizer mylab_opt:SignSGD: not supported under ZeRO stage 3 (cpu); supported"
                            " stages: 0, 1, 2")
    model = torch.nn.Linear(2, 2)
    _, optimizer, _ = prepare_optimizer(run, {}, model)
    assert type(optimizer).__name__ == "SignSGD" and optimizer.param_groups[0]["momentum"] == 0.5
    assert optimizer.param_groups[0]["lr"] == 0.1


# ------------------------------------------------------------------------------------------------
# Learning-rate laws per optimizer (modeling/scaling_rules.yaml, --scaling-rule without --lr)
# ------------------------------------------------------------------------------------------------

def test_per_optimizer_lr_laws(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("mine:\n  head_dim: 64\n  layers_per_head: [1, 2]\n  mlp_ratio: 3\n"
                     "  lr:\n    adamw: {a: 2.0, b: 1.0e+5, d: -0.5}\n    muon: {a: 40.0, b: 0, d: -0.5}\n"
                     "    adana: {a: 1.0, b: 0, d: -0.25}\n")
    rule = sizes.get_rule("mine", rules)
    p = count_params(sizes.rule_args(rule, 8))["non_embedding"]
    base = {"data": "mix.json", "scaling_rule": "mine", "heads": 8, "rules_file": str(rules)}
    assert cfg(**base).schedule.lr == pytest.approx(2.0 * (1e5 + p) ** -0.5)  # adamw: the default optimizer
    assert cfg(**base, optimizer="muon").schedule.lr == pytest.approx(40.0 * p ** -0.5)
    assert cfg(**base, optimizer="lion").schedule.lr == 3e-4  # no law for it: Lion's own default
    assert cfg(**base, optimizer="muon", lr=1e-3).schedule.lr == 1e-3  # --lr wins
    # a user's class finds its law by its class name (no import needed to pick the lr)
    assert rule_law_lr(base, law_names("mylab.dana:ADana")) == pytest.approx(p ** -0.25)
    old = tmp_path / "old.yaml"  # the single-law form: AdamW's
    old.write_text("r:\n  head_dim: 64\n  layers_per_head: [1, 2]\n  mlp_ratio: 3\n  lr: {a: 2.0, b: 0, d: -0.5}\n")
    r = sizes.get_rule("r", old)
    assert sizes.rule_lr(r, 100) == 0.2 and sizes.rule_lr(r, 100, "muon") is None
    bad = tmp_path / "bad.yaml"
    bad.write_text("r:\n  head_dim: 64\n  layers_per_head: [1, 2]\n  mlp_ratio: 3\n  lr: {muon: {a: 1, b: 0}}\n")
    with pytest.raises(ValueError, match="rule 'r': lr.muon must be a mapping with exactly a, b and d"):
        sizes.load_rules(bad)


def test_shipped_adana_law_and_params_prints_the_lr(capsys):
    enoki = sizes.get_rule("enoki")
    p = count_params(sizes.rule_args(enoki, 16))["non_embedding"]
    assert sizes.rule_laws(enoki) == {"adana": {"a": 3.72e3, "b": 3.70e3, "d": -0.894}}
    expected = 3.72e3 * (3.70e3 + p) ** -0.894
    assert math.isclose(expected, 1.402e-4, rel_tol=1e-3)
    cli(["params", "--scaling-rule", "enoki", "--heads", "16", "--optimizer", "adana"])
    out = capsys.readouterr().out
    assert f"{expected:.3e}" in out and "rule enoki's law for adana" in out
    cli(["params", "--scaling-rule", "enoki", "--heads", "16", "--optimizer", "muon"])
    assert "2.000e-02" in capsys.readouterr().out  # no law for muon in enoki: Muon's default
    with pytest.raises(SystemExit):
        cli(["params", "--scaling-rule", "enoki", "--heads", "16", "--optimizer", "sgdx"])
    assert "--optimizer sgdx: unknown optimizer" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Launched: every optimizer under every ZeRO stage; exact resume
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def harness(tmp_path_factory, mix_path):
    out = tmp_path_factory.mktemp("optim") / "results.json"
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), str(HARNESS), str(out),
           "0,1,2,3", *LAUNCHED, "--resume", "muon", 'ademamix={"warmup_steps": 2}', "lion", "--resume-stages", "3",
           "--against-the-run", str(mix_path)]
    # TORCHDYNAMO_DISABLE: DeepSpeed's torch.compile'd Muon update runs eagerly (same arithmetic, no
    # 30-60 s compile on the CPU).
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"})
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.launches
@pytest.mark.parametrize("stage", ["0", "1", "2", "3"])
def test_each_optimizer_follows_its_rule_under_each_zero_stage(harness, stage):
    expected_class = {"adamw": "AdamW", "muon": "MuonWithAuxAdam", "lion": "SignZeroSafeDeepSpeedCPULion",
                      "adamw-decaying-wd": "AdamWDecayingWD", "ademamix": "AdEMAMix"}
    state_bytes = {"adamw": 8, "muon": (4, 8), "lion": 8, "adamw-decaying-wd": 8, "ademamix": 12}
    for spec in LAUNCHED:
        name = spec.partition("=")[0]
        r = harness[stage][spec]
        assert "error" not in r, (stage, spec, r.get("error"))
        assert r["optimizer_class"] == expected_class[name]
        tol = TOLERANCE.get(name, DEFAULT_TOLERANCE)
        assert max(r["max_err"]) < tol, (stage, spec, r["max_err"], r["worst"])
        if r["contrast"] is not None:  # the check has teeth: AdamW everywhere would be far outside it
            assert min(r["contrast"][1:]) > 10 * tol, (stage, spec, r["contrast"])
        assert r["losses"][-1] < r["losses"][0] - 0.5, (stage, spec, r["losses"])  # 10 steps; lion at 3e-4: -0.97
        lo_hi = state_bytes[name] if isinstance(state_bytes[name], tuple) else (state_bytes[name],) * 2
        assert lo_hi[0] <= r["state_bytes_per_param"] <= lo_hi[1], (stage, spec, r["state_bytes_per_param"])
    muon = harness[stage]["muon"]
    assert muon["gradient_clipping"] == (1.0 if stage == "0" else 0.0)


@pytest.mark.launches
def test_exact_resume_of_the_optimizer_state_at_zero3(harness):
    for spec, r in harness["resume-3"].items():
        assert "error" not in r, (spec, r.get("error"))
        assert r["weights_equal"] and r["losses_equal"], (spec, r)


@pytest.mark.launches
def test_the_harness_builds_the_engine_the_run_builds(harness):
    """The run's engine (plan_run -> spec_from_plan -> build_engine, what Trainer._build_engine calls) and
    the harness's, for the same inputs, agree on every rank: DeepSpeed's dict, ZeRO stage, optimizer
    classes, each parameter's shape and partition, initial weights and lr schedule (a harness that built its
    engine another way, e.g. without zero.Init, with DeepSpeed's scheduler or another optimizer, differs)."""
    r = harness["against-the-run"]
    assert "error" not in r, r.get("error")
    assert r["same"] == [True, True], {k: (r["run"][k], r["harness"][k]) for k in r["run"]
                                       if r["run"][k] != r["harness"][k]}
    run = r["run"]
    assert run["zero_stage"] == 3 and run["basic_optimizer"] == "AdamW", run
    held = sum(n for _, _, n in run["partition"])
    whole = sum(math.prod(shape) for _, shape, _ in run["partition"])
    assert held < whole, (held, whole)  # partitioned: this rank holds part of every parameter
    assert run["lr_multipliers"][0] < run["lr_multipliers"][1] == 1.0, run["lr_multipliers"]  # the run's warm-up


@pytest.mark.launches
def test_muon_run_resumes_bit_identically_through_the_driver(tmp_path, mix_path):
    """The driver end to end: run 0 -> 4 saving at 2; the run directory as it was at 2, resumed -> 4."""
    from test_resume_exact import stop_at

    args = ["--profile", "cpu", "--data", str(mix_path), "--model", "debug", "--seq-len", "64", "--micro-batch", "2",
            "--grad-accum", "2", "--warmup-steps", "1", "--optimizer", "muon", "--optimizer-args",
            '{"adam_lr": 0.002}', "--run-id", "r", "--max-steps", "4"]
    env = {"TORCHDYNAMO_DISABLE": "1"}
    full = launch("deepspeed", args + ["--out", str(tmp_path / "a"), "--save-every-steps", "2"], env_extra=env)
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    assert "optimizer muon (DeepSpeed (MuonWithAuxAdam)" in full.stdout and "gradient clipping off" in full.stdout
    saved = json.loads((tmp_path / "a" / "r" / "config.json").read_text())["run"]
    assert (saved["optimizer"], saved["optimizer_args"], saved["lr"]) == ("muon", {"adam_lr": 0.002}, 0.02)
    ds = json.loads((tmp_path / "a" / "r" / "ds_config.json").read_text())
    assert ds["optimizer"]["type"] == "Muon" and ds["gradient_clipping"] == 0.0
    stop_at(tmp_path / "a" / "r", 2, tmp_path / "b" / "r")
    resumed = launch("deepspeed", args + ["--out", str(tmp_path / "b"), "--resume", "auto"], env_extra=env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    a, b = read_metrics(tmp_path / "a" / "r"), read_metrics(tmp_path / "b" / "r")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    assert [m["loss"] for m in a] == [m["loss"] for m in b] and [m["lr"] for m in a] == [m["lr"] for m in b]
