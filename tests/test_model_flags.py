"""How the flags pick the model (launcher/model_spec.py), `zerotrain params` and `zerotrain export`'s
bad input. In-process; what reaches the user is the UsageError's one line (exit 2 via fail)."""
import pytest

from zerotrain.launcher.cli import main as cli
from zerotrain.launcher.config import RunConfig
from zerotrain.launcher.config_resolve import drift, identity, identity_hash, resolve_config
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.model_spec import resolve
from zerotrain.modeling.model import count_params, preset


def spec(**kw):
    return resolve(RunConfig.from_flat(dict(data="mix.json", **kw)), vocab_size=258)


def test_each_way_of_picking_the_model():
    args, label, hf_dir = spec()
    assert label == "debug" and args == preset("debug", vocab_size=258, max_seq_len=256) and hf_dir is None
    args, label, _ = spec(depth=12, seq_len=512)
    assert label == "d12" and (args.n_layers, args.dim, args.n_heads, args.max_seq_len) == (12, 768, 6, 512)
    args, label, _ = spec(depth=4, aspect_ratio=32, head_dim=64, qk_norm=True)
    assert (args.dim, args.n_heads, args.qk_norm) == (128, 2, True)
    args, label, _ = spec(scaling_rule="enoki", heads=8)
    assert label == "enoki-h8" and (args.n_layers, args.dim, args.ffn_hidden) == (6, 512, 2048)
    assert args.vocab_size == 320  # 258 padded to a multiple of 64


@pytest.mark.parametrize("kw,message", [
    (dict(model="small", depth=4), "--model small and --depth: give one way to pick the model"),
    (dict(depth=4, scaling_rule="enoki", heads=4), "--depth and --scaling-rule: give one way"),
    (dict(heads=4), "--heads: only used with --scaling-rule"),
    (dict(aspect_ratio=32), "--aspect-ratio: only used with --depth"),
    (dict(scaling_rule="enoki"), "--scaling-rule enoki: needs --heads H"),
    (dict(scaling_rule="nope", heads=4), "--scaling-rule nope: unknown scaling rule 'nope'; known: enoki, qwen3"),
    (dict(scaling_rule="enoki", heads=1), "--scaling-rule enoki --heads 1: heads 1 gives 3 * 1 // 4 = 0 layers"),
    (dict(depth=1), "--depth 1: depth 1 x aspect ratio 64 = 64 is 0.5 heads of 128, not a whole head"),
    (dict(depth=3, head_dim=30, aspect_ratio=20), "--depth 3: model args: head dim 30"),  # fine: 30 is even
    (dict(depth=3, head_dim=15, aspect_ratio=10), "--depth 3: model args: head dim 15 must be even"),
    (dict(model="enormous"), "--model enormous: unknown model preset 'enormous'"),
    (dict(init_from="/nonexistent/llama"), "--init-from /nonexistent/llama: no such directory"),
    (dict(init_from="/tmp", qk_norm=True), "--qk-norm and --init-from: the Hugging Face config.json decides"),
])
def test_model_flag_errors_name_the_flag(kw, message):
    if message.endswith("head dim 30"):
        assert spec(**kw)[0].head_dim == 30
        return
    with pytest.raises(UsageError) as e:
        spec(**kw)
    assert message in str(e.value)


def test_scaling_rule_lr_law_applies_only_without_lr(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("mine:\n  head_dim: 64\n  layers_per_head: [1, 2]\n  mlp_ratio: 3\n"
                     "  lr: {a: 2.0, b: 1.0e+5, d: -0.5}\n")
    base = ["--data", "mix.json", "--scaling-rule", "mine", "--heads", "8", "--rules-file", str(rules)]
    cfg = resolve_config(base)
    args, label, _ = resolve(cfg, 258)
    p = count_params(args)["non_embedding"]
    assert (args.n_layers, args.dim) == (4, 512)
    lr = cfg.schedule.lr
    assert lr == pytest.approx(2.0 * (1e5 + p) ** -0.5) and cfg.schedule.min_lr == pytest.approx(lr / 10)
    assert resolve_config(base + ["--lr", "1e-3"]).schedule.lr == 1e-3
    no_law = resolve_config(["--data", "mix.json", "--scaling-rule", "enoki", "--heads", "8"])
    assert no_law.schedule.lr == 3e-3  # no law


def test_new_flags_leave_earlier_run_ids_alone():
    # the identity hashes of the foundation commit (launcher/config.py at f7f5f05): auto run ids still resume
    assert identity_hash(RunConfig.from_flat(dict(data="mix.json"))) == "cea5eb6e"
    assert identity_hash(RunConfig.from_flat(dict(data="mix.json", model="small", lr=1e-3))) == "7a3aa8e4"
    assert identity_hash(RunConfig.from_flat(dict(data="mix.json", depth=12))) != \
        identity_hash(RunConfig.from_flat(dict(data="mix.json", depth=16)))


def test_params_prints_counts_for_presets_and_rules(capsys):
    cli(["params", "ws-760m", "ws-1.3b", "--vocab-size", "128256"])
    out = capsys.readouterr().out
    assert "759,743,488" in out and "1,300,071,936" in out
    cli(["params", "--depth", "12", "--scaling-rule", "qwen3", "--heads", "4"])
    out = capsys.readouterr().out
    for args in (spec(depth=12)[0], spec(scaling_rule="qwen3", heads=4)[0]):
        assert f"{count_params(args)['non_embedding']:,}" in out


@pytest.mark.parametrize("argv,message", [
    (["params", "enormous"], "params enormous: unknown model preset"),
    (["params", "--depth", "1"], "--depth 1: depth 1 x aspect ratio 64"),
    (["params", "--heads", "4"], "--heads: only used with --scaling-rule"),
    (["export", "/nonexistent/run", "--to", "x"], "export /nonexistent/run: no such file or directory"),
    (["export", "."], "export: the following arguments are required: --to"),
    (["export", "{tmp}", "--to", "{tmp}/out"], "neither a run directory nor a complete zerotrain checkpoint"),
    (["export", "{tmp}/run", "--to", "{tmp}/out"], "the run has no complete checkpoint"),
])
def test_params_and_export_bad_input_exit_2_with_one_line(argv, message, tmp_path, capsys):
    (tmp_path / "run" / "checkpoints" / "global_step5").mkdir(parents=True)  # never completed: no marker
    with pytest.raises(SystemExit) as e:
        cli([a.replace("{tmp}", str(tmp_path)) for a in argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("zerotrain: error:")
    assert message in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.launches
def test_installed_command_finds_the_model_package(tmp_path):
    """`zerotrain params` through the console script, away from the checkout: `modeling` is a package."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([str(Path(sys.executable).parent / "zerotrain"), "params", "debug"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "869,504" in proc.stdout


def test_rope_theta_sets_the_base_for_every_way_of_picking_the_model(tmp_path):
    import torch

    from zerotrain.modeling import hf
    from zerotrain.modeling.model import Transformer

    assert spec()[0].rope_theta == 10000.0
    assert spec(rope_theta=500000.0)[0].rope_theta == 500000.0
    assert spec(depth=4, aspect_ratio=32, head_dim=64, rope_theta=1e6)[0].rope_theta == 1e6
    torch.manual_seed(0)
    base = preset("debug", vocab_size=320)
    hf.save(tmp_path, Transformer(base).state_dict(), base)  # a 2k-context base checkpoint, theta 10000
    assert spec(init_from=str(tmp_path))[0].rope_theta == 10000.0  # the checkpoint's own
    args, label, hf_dir = spec(init_from=str(tmp_path), rope_theta=1e6)  # context extension: a new base
    assert args.rope_theta == 1e6 and hf_dir == str(tmp_path) and args.n_layers == base.n_layers
    with pytest.raises(UsageError, match="--rope-theta: must be a number above 1, got 0.5"):
        spec(rope_theta=0.5)


def test_rope_theta_is_recorded_in_the_run_id_and_a_resume_with_another_is_drift():
    base = ["--data", "mix.json", "--lr", "1e-3", "--warmup-steps", "2"]
    plain, extended = resolve_config(base), resolve_config(base + ["--rope-theta", "500000"])
    assert identity_hash(plain) != identity_hash(extended)
    assert identity(extended)["rope_theta"] == 500000.0
    saved = extended.to_dict()  # config.json's "run" of a run started with --rope-theta 500000
    assert drift(resolve_config(base + ["--rope-theta", "500000"]), saved) == []
    assert drift(resolve_config(base + ["--rope-theta", "1000000"]), saved) == ["rope_theta 500000.0 -> 1000000.0"]
    assert drift(resolve_config(base), saved) == ["rope_theta 500000.0 -> None"]


def test_a_resume_gets_the_model_its_checkpoints_hold_or_a_line_naming_what_changed(tmp_path):
    """run_plan.resumed_model: config.json's "model" against what the flags give now. --init-from's config.json
    edited since the run started (the norm's epsilon, the RoPE base: weights that load and compute something else)
    is refused naming the fields; another context length is not a change of the weights; a run an older zerotrain
    started from a checkpoint of vocabulary 300, which it padded to 320, resumes with its 320 rows."""
    from dataclasses import replace

    from zerotrain.launcher.run_plan import resumed_model
    from zerotrain.modeling.sizes import ModelArgs

    now = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=300, vocab_multiple_of=1, max_seq_len=256)
    saved = now.to_dict()
    assert resumed_model(now, saved, tmp_path, "base") == now
    assert resumed_model(replace(now, max_seq_len=1024), saved, tmp_path, "base").max_seq_len == 1024
    with pytest.raises(UsageError) as e:
        resumed_model(replace(now, norm_eps=0.5, rope_theta=100.0), saved, tmp_path, "base")
    assert str(e.value) == (f"--init-from base: not the model {tmp_path / 'config.json'} records, which its checkpoints"
                            " hold (rope_theta 10000.0 -> 100.0, norm_eps 1e-05 -> 0.5); restore it, or start a new"
                            " --run-id")
    with pytest.raises(UsageError, match=r"the model flags: .*\(dim 64 -> 128, n_heads 4 -> 8\)"):
        resumed_model(replace(now, dim=128, n_heads=8), saved, tmp_path, None)
    older = {**saved, "vocab_size": 320, "vocab_multiple_of": 64}  # padded by an older zerotrain
    assert resumed_model(now, older, tmp_path, "base").vocab_size == 320
    with pytest.raises(UsageError, match=r"vocab_size 384 -> 300"):
        resumed_model(now, {**older, "vocab_size": 384}, tmp_path, "base")


def test_a_seq_len_past_the_init_from_models_context_is_said():
    """--init-from gives the model its max_position_embeddings; a longer --seq-len trains positions the model never
    saw (RoPE runs on): a start-up warning says so (run_plan's warnings). Nothing said within it, or from scratch."""
    from zerotrain.launcher.model_spec import context_warnings
    from zerotrain.modeling.sizes import ModelArgs

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=300, max_seq_len=2048)
    longer = resolve_config(["--data", "mix.json", "--init-from", "llama-dir", "--seq-len", "4096"])
    (line,) = context_warnings(longer, args, "llama-dir")
    assert line.startswith("--seq-len 4096 is longer than --init-from llama-dir's max_position_embeddings 2048")
    within = resolve_config(["--data", "mix.json", "--init-from", "llama-dir", "--seq-len", "2048"])
    assert context_warnings(within, args, "llama-dir") == []
    assert context_warnings(resolve_config(["--data", "mix.json", "--seq-len", "4096"]), args, None) == []
