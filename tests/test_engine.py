"""One engine builder (launcher/components/engine.py): the run, pre-flight (its Trainers), every test harness
and every benchmark build engines through it, so what a test measures is what the run builds.

Read from the code: no file of the repository but engine.py calls `deepspeed.initialize` or
`deepspeed.zero.Init`, and none but process_group.py calls `deepspeed.init_distributed` (Python embedded
in a test's strings included, aliases and `from deepspeed import ...` followed); the Trainer, the harnesses
and the engine-building benchmarks call `build_engine`. That the harness's engine is the run's for the same
inputs (config, ZeRO stage, optimizer classes, partitioning, weights, schedule) is asserted on 2 real
ranks in tests/test_optimizers.py (test_the_harness_builds_the_engine_the_run_builds).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from test_architecture import _sources

REPO = Path(__file__).resolve().parent.parent
OWNERS = {  # DeepSpeed's entry -> the one file that may call it
    "deepspeed.initialize": "launcher/components/engine.py",
    "deepspeed.zero.Init": "launcher/components/engine.py",
    "deepspeed.runtime.zero.partition_parameters.Init": "launcher/components/engine.py",
    "deepspeed.init_distributed": "launcher/components/process_group.py",
    "deepspeed.comm.init_distributed": "launcher/components/process_group.py",
    "deepspeed.comm.comm.init_distributed": "launcher/components/process_group.py",
}
BUILDERS = [  # every file that builds an engine, and builds it through build_engine
    "launcher/trainer.py", "tests/helpers/optim_harness.py", "tests/helpers/ckpt_harness.py",
    "tests/helpers/eval_harness.py", "tests/helpers/head_zero3_harness.py", "tests/helpers/universal_harness.py",
    "tests/helpers/sft_loss_harness.py", "tests/helpers/sp_harness.py", "benchmarks/profile_step.py",
    "benchmarks/checkpoints.py"]


def trees(where: str, text: str):
    """The module's tree, and the tree of every string constant in it that is a Python program (a test's
    script run with `python -c`)."""
    tree = ast.parse(text)
    yield tree
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "deepspeed" in node.value \
                and "import" in node.value:
            try:
                yield ast.parse(node.value)
            except SyntaxError:
                pass


def deepspeed_uses(tree) -> list[tuple[str, int]]:
    """(dotted DeepSpeed name, line) for every import of, and every reference to, a DeepSpeed name, with
    `import deepspeed as ds` and `from deepspeed.zero import Init as I` resolved."""
    alias, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
                found.append((f"{node.module}.{a.name}", node.lineno))
    for node in ast.walk(tree):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in alias:
            found.append((".".join([alias[node.id], *reversed(parts)]), node.lineno))
    return found


def test_only_the_builder_calls_deepspeeds_constructors():
    sources = _sources()
    assert len(sources) > 100, len(sources)  # the walk found the repository
    strays, owned = [], set()
    for where, text in sources:
        if where == "tests/test_engine.py":  # its examples of what the walk must catch
            continue
        for tree in trees(where, text):
            for name, line in deepspeed_uses(tree):
                if name in OWNERS:
                    (owned.add((name, where)) if where == OWNERS[name] else strays.append(f"{where}:{line} {name}"))
    assert not strays, ("build engines with zerotrain.launcher.components.engine.build_engine (and join the process"
                        " group with process_group.init_process_group), not:\n" + "\n".join(strays))
    # the walk sees the calls where they are allowed (a broken walk would find nothing anywhere)
    assert {("deepspeed.initialize", OWNERS["deepspeed.initialize"]), ("deepspeed.zero.Init", OWNERS["deepspeed.zero.Init"]),
            ("deepspeed.init_distributed", OWNERS["deepspeed.init_distributed"])} <= owned, owned


def test_the_walk_sees_every_spelling():
    spelled = """
import deepspeed as ds
from deepspeed import initialize as init, zero
from deepspeed.zero import Init
from deepspeed.comm import init_distributed
ds.initialize(model=m)
with zero.Init(config_dict_or_path=c):
    pass
SCRIPT = '''
import deepspeed
deepspeed.init_distributed(dist_backend="gloo")
'''
"""
    names = {name for tree in trees("x.py", spelled) for name, _ in deepspeed_uses(tree)} & set(OWNERS)
    assert names == {"deepspeed.initialize", "deepspeed.zero.Init", "deepspeed.comm.init_distributed",
                     "deepspeed.init_distributed"}, names


def test_every_engine_is_built_by_build_engine():
    for rel in BUILDERS:
        calls = [n for n in ast.walk(ast.parse((REPO / rel).read_text()))
                 if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "build_engine"]
        assert calls, f"{rel} builds no engine through build_engine"
    trainer = ast.parse((REPO / "launcher" / "trainer.py").read_text())
    run_build = [n for n in ast.walk(trainer) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "build_engine"]
    # the run: from its plan (and the clock its all-to-all phase is measured by)
    assert [ast.unparse(n) for n in run_build] == \
        ["build_engine(spec_from_plan(plan, exchange_phase=lambda: self.clock.phase('all_to_all')))"]


def test_the_runs_spec_carries_what_the_plan_decided():
    """spec_from_plan: the pretrained weights only on a fresh start; --deterministic, the attention kernel,
    activation checkpointing (flag, else the profile's), --sequence-parallel and the process group's settings reach
    the builder."""
    from types import SimpleNamespace

    from zerotrain.launcher.components.engine import spec_from_plan
    from zerotrain.launcher.config_resolve import config_from

    cfg = config_from({"data": "mix.json", "seed": 7})
    from zerotrain.launcher.settings import resolve

    zt = {"activation_checkpointing": True, "dist_backend": "gloo", "hang_timeout": 1200,  # the run's settings:
          "tiled_mlp": True}
    plan = SimpleNamespace(cfg=cfg, settings=resolve(cfg, "p", {"zerotrain": zt}),
                           ds_config={"zero_optimization": {"stage": 3}}, model_args="args", init_from="hf-dir",
                           resume_from=None, attention="sdpa", deterministic=True, loss_chunk_tokens=900,
                           sequence_parallel=2)
    spec = spec_from_plan(plan)
    assert (spec.seed, spec.run, spec.model_args, spec.zero_stage, spec.init_from) == (7, cfg, "args", 3, "hf-dir")
    assert (spec.deterministic, spec.attention, spec.activation_checkpointing) == (True, "sdpa", True)
    assert spec.loss_chunk_tokens == 900  # the planner's chunk for this device (None on a CPU)
    assert spec.sequence_parallel == 2  # --sequence-parallel: the builder makes DeepSpeed's SP groups and the shard
    assert spec.tiled_mlp is True and spec.exchange_phase is None  # --tiled-mlp (here the profile's); no clock given
    assert (spec.dist_backend, spec.comm_timeout_s) == ("gloo", 2400.0)  # twice the profile's hang timeout
    assert spec.optimizer is None and spec.lr_scheduler is None  # the registry's and the run's schedule
    resumed = spec_from_plan(SimpleNamespace(**{**vars(plan), "resume_from": "ckpt", "deterministic": False}))
    assert resumed.init_from is None and resumed.deterministic is False  # a resume loads its checkpoint instead
    assert resumed.resumes is True and spec.resumes is False  # ... and draws no initial weights for it


def test_a_resume_builds_its_model_without_drawing_the_initial_weights():
    """build_model with `resumes` (spec_from_plan sets it when a checkpoint is loaded next) skips init_weights,
    whose values the load overwrites (its CPU draws, and at ZeRO-3 a gather per parameter, at every restart); a
    fresh start draws them as before, and so does any Transformer built after the context."""
    import torch

    from zerotrain.launcher.components.engine import EngineSpec, build_model
    from zerotrain.modeling.initial import init_weights, weights_loaded_after
    from zerotrain.modeling.model import PRESETS, Transformer

    def built(resumes: bool):
        spec = EngineSpec(ds_config={"zero_optimization": {"stage": 2}}, model_args=PRESETS["debug"], seed=3,
                          resumes=resumes)
        return dict(build_model(spec).named_parameters())

    fresh, resumed = built(False), built(True)
    assert fresh.keys() == resumed.keys()
    torch.manual_seed(3)
    with weights_loaded_after():
        drawn_by_modules = Transformer(PRESETS["debug"])
    init_weights(drawn_by_modules)
    assert all(torch.equal(fresh[n], p) for n, p in drawn_by_modules.named_parameters())  # fresh: init_weights'
    assert not any(torch.equal(fresh[n], resumed[n]) for n in fresh if "norm" not in n)  # resumed: not drawn
    torch.manual_seed(3)
    assert all(torch.equal(fresh[n], p) for n, p in Transformer(PRESETS["debug"]).named_parameters())


def test_init_from_builds_without_drawing_and_holds_the_checkpoints_values_only(tmp_path, monkeypatch):
    """build_model with `init_from` (a Hugging Face directory of vocabulary 300, which our own models would pad to
    320) skips init_weights, whose values the load overwrites (3.4 s of 5.8 for the 0.68B model here,
    benchmarks/RESULTS.md); the model has the checkpoint's vocabulary, no padded rows (they would enter the
    softmax: the loss would not be transformers'), and every value is the file's, whatever the seed."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    import zerotrain.modeling.model as model_module  # where Transformer looks init_weights up
    from zerotrain.launcher.components.engine import EngineSpec, build_model
    from zerotrain.modeling import hf

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, vocab_size=300)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    args = hf.args_from_config(hf.read_config(tmp_path), str(tmp_path))
    assert args.vocab_size == 300 and not args.tie_embeddings
    file = load_file(tmp_path / "model.safetensors")

    def built(seed):
        spec = EngineSpec(ds_config={"zero_optimization": {"stage": 2}}, model_args=args, seed=seed, init_from=tmp_path)
        return dict(build_model(spec).named_parameters())

    def refuse(model):
        raise AssertionError("init_weights ran for a model whose weights are loaded next")

    monkeypatch.setattr(model_module, "init_weights", refuse)
    params, other = built(3), built(4)
    assert {hf.hf_name(n) for n in params} == set(file)
    for name, p in params.items():
        assert torch.equal(p, file[hf.hf_name(name)]), name
        assert torch.equal(p, other[name]), name


def test_init_from_weights_holding_nan_are_refused_in_one_line(tmp_path):
    """A checkpoint with a NaN (or an infinity) in one tensor is refused when it is loaded, naming the tensor, on
    every rank alike (engine.check_finite; one all-gather): it used to train, and stop at step 1 as diverged."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerotrain.launcher.components.engine import EngineSpec, build_model
    from zerotrain.launcher.errors import UsageError
    from zerotrain.modeling import hf

    cfg = LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, vocab_size=300)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    args = hf.args_from_config(hf.read_config(tmp_path), str(tmp_path))
    spec = EngineSpec(ds_config={"zero_optimization": {"stage": 2}}, model_args=args, seed=0, init_from=tmp_path)
    build_model(spec)  # finite: built
    tensors = load_file(tmp_path / "model.safetensors")
    for bad in (float("nan"), float("inf")):
        broken = dict(tensors)
        broken["model.layers.1.mlp.up_proj.weight"] = broken["model.layers.1.mlp.up_proj.weight"].clone()
        broken["model.layers.1.mlp.up_proj.weight"][3, 5] = bad
        save_file(broken, tmp_path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(UsageError) as e:
            build_model(spec)
        assert str(e.value) == (f"--init-from {tmp_path}: tensor model.layers.1.mlp.up_proj.weight holds NaN or"
                                " infinite values (a corrupt or badly converted checkpoint)")
