"""The real driver under the real deepspeed launcher, 2 CPU ranks: ZeRO-3 construction, --init-from
a directory `transformers` wrote, `zerotrain export` from ZeRO-2 and ZeRO-3 checkpoints (DeepSpeed's
own consolidation), --compile and activation checkpointing, and the model flags' bad input."""
import json
import re

import pytest
import torch

from conftest import REPO, launch, read_metrics, synthetic_docs

pytestmark = pytest.mark.launches  # every test here starts a process (make test-fast leaves them out)

COMMON = ["--seq-len", "128", "--micro-batch", "4", "--lr", "1e-3", "--warmup-steps", "1", "--max-steps", "3"]


def profile(tmp_path, stage: int, **zerotrain) -> str:
    prof = json.loads((REPO / "ds_configs" / "cpu.json").read_text())
    prof["zero_optimization"]["stage"] = stage
    prof["zerotrain"].update(zerotrain)
    path = tmp_path / f"cpu-zero{stage}-{len(zerotrain)}.json"
    path.write_text(json.dumps(prof))
    return str(path)


@pytest.fixture(scope="module")
def assets(tmp_path_factory, mix_path):
    """A byte-level BPE tokenizer (HF format) and a tied GQA Llama saved by transformers itself."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("assets")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(synthetic_docs(300, seed=3), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (root / "tok").mkdir()
    tok.save(str(root / "tok" / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320, tie_word_embeddings=True, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(root / "llama")
    return {"tokenizer": root / "tok", "llama": root / "llama", "mix": mix_path}


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """The same fine-tuning from the same Llama directory, 2 ranks each: ZeRO-3 plain, and ZeRO-2 with
    --compile, --activation-checkpointing and --tiled-mlp (none of which may change the math; the tiled MLP's
    own autograd function, recomputing each tile in backward, under dynamo and checkpointing)."""
    tmp = tmp_path_factory.mktemp("runs")
    done = {}
    # aot_eager: dynamo capture and AOT autograd without inductor's C++ build (minutes on 2 cores);
    # profiles name their backend in zerotrain.compile_backend (default: the accelerator's, inductor).
    for stage, extra in ((3, []), (2, ["--compile", "--activation-checkpointing", "--tiled-mlp"])):
        args = ["--profile", profile(tmp, stage, compile_backend="aot_eager"), "--data", str(assets["mix"]),
                "--tokenizer", str(assets["tokenizer"]), "--init-from", str(assets["llama"]), "--out", str(tmp),
                "--run-id", f"z{stage}", *COMMON, *extra]
        proc = launch("deepspeed", args)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        done[stage] = (tmp / f"z{stage}", proc.stdout)
    return done


def held_per_rank(stdout: str) -> tuple[list[int], int]:
    m = re.search(r"parameters held per rank after construction: ([\d, ]+) of ([\d,]+)", stdout)
    assert m, stdout[-2000:]
    return [int(x.replace(",", "")) for x in m.group(1).split(", ")], int(m.group(2).replace(",", ""))


def test_zero3_construction_holds_half_the_parameters_per_rank(runs):
    held, total = held_per_rank(runs[3][1])
    assert len(held) == 2 and total > 100_000
    for n in held:  # each rank: its half of every tensor (plus at most one element of padding per tensor)
        assert abs(n - total / 2) <= 0.01 * total, (held, total)
    held2, total2 = held_per_rank(runs[2][1])
    assert held2 == [total2, total2]  # without zero.Init every rank builds everything
    assert "tiled MLP: 2 tile(s) of up to 64 of this rank's 128 positions" in runs[2][1]  # (ceil(128 / dim 64))
    assert "tiled MLP" not in runs[3][1]


def test_init_from_hf_then_zero2_and_zero3_exports_agree(runs, assets, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zerotrain.launcher.cli import main as cli

    for stage in (3, 2):
        assert "initialised from" in runs[stage][1]
    z3_dir, z2_dir = runs[3][0], runs[2][0]
    assert 4.0 < read_metrics(z3_dir)[0]["loss"] < 7.0  # the loaded random Llama: about ln(vocab)

    cli(["export", str(z3_dir), "--to", str(tmp_path / "hf3")])  # a run directory: its newest checkpoint
    cli(["export", str(z2_dir / "checkpoints" / "global_step3"), "--to", str(tmp_path / "hf2")])
    init = load_file(assets["llama"] / "model.safetensors")
    exported = {s: load_file(tmp_path / f"hf{s}" / "model.safetensors") for s in (3, 2)}
    assert exported[3].keys() == exported[2].keys() == init.keys()  # tied: no lm_head.weight anywhere
    for name, tensor in init.items():
        assert torch.allclose(exported[3][name], exported[2][name], atol=1e-5), name  # same weights either way
        moved = (exported[3][name] - tensor).abs().max().item()
        assert moved < 0.01, (name, moved)  # 3 AdamW steps of lr 1e-3 away from the loaded weights
    assert max((exported[3][n] - init[n]).abs().max().item() for n in init) > 1e-4  # and training moved them

    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf3", output_loading_info=True)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf3")
    from zerotrain.dataio.sources.tokenizer import load_tokenizer

    ours = load_tokenizer(str(assets["tokenizer"]))
    text = "the model reads every token"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == list(ours.encode(text))
    assert tokenizer.eos_token_id == ours.eos_id == model.config.eos_token_id


def test_export_shards_like_save_pretrained_and_checks_itself(runs, assets, tmp_path, capsys, monkeypatch):
    """--max-shard-size: several safetensors shards (none over the size but for a lone larger tensor) and
    their index, loaded by transformers; config.json and generation_config.json from transformers' own
    classes; the check's figure printed and in the model card. A converter bug (here the embedding rows
    shifted by one, as an off-by-one in a vocabulary mapping would) fails the check: exit 10, one line."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, GenerationConfig

    from zerotrain.launcher.cli import main as cli
    from zerotrain.modeling import hf

    out = tmp_path / "sharded"
    cli(["export", str(runs[2][0]), "--to", str(out), "--max-shard-size", "100KB"])
    printed = capsys.readouterr().out
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and not (out / "model.safetensors").exists(), printed
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [s.name for s in shards]
    total = 0
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            sizes = [f.get_tensor(k).nbytes for k in f.keys()]
        assert sum(sizes) <= 100_000 or len(sizes) == 1, (shard, sizes)
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert json.loads((out / "config.json").read_text())["transformers_version"]  # written by LlamaConfig itself
    assert GenerationConfig.from_pretrained(out).eos_token_id == model.config.eos_token_id is not None
    check = re.search(r"check: loss on [\d,]+ pseudo-random token ids \(seed 0; the run held out no documents.*\):"
                      r" checkpoint \(fp32, zerotrain\) ([\d.]+), export \(float32, transformers\) ([\d.]+),"
                      r" relative difference (\S+) \(within the float32 tolerance 0.0001\)", printed)
    assert check and float(check.group(3)) < 1e-4, printed
    card = (out / "README.md").read_text()
    assert "library_name: transformers" in card and f"relative difference {check.group(3)}" in card
    assert "**passed**" in card

    capsys.readouterr()  # transformers' own loading bars above
    for size, why in (("5 GiB", "expected bytes or a size like 5GB, 500MB, 100KB"), ("0MB", "must be more than 0")):
        with pytest.raises(SystemExit) as e:
            cli(["export", str(runs[2][0]), "--to", str(tmp_path / "never"), "--max-shard-size", size])
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert e.value.code == 2 and len(lines) == 1 and why in lines[0], lines
    assert not (tmp_path / "never").exists()

    shifted = hf.hf_state_dict  # a converter bug: every token gets its neighbour's embedding

    def off_by_one(*args, **kwargs):
        tensors = shifted(*args, **kwargs)
        return {**tensors, "model.embed_tokens.weight": tensors["model.embed_tokens.weight"].roll(1, 0)}

    monkeypatch.setattr(hf, "hf_state_dict", off_by_one)
    cli(["export", str(runs[2][0]), "--to", str(tmp_path / "bad"), "--no-check"])  # nothing compared: it passes
    assert "check: skipped (--no-check)" in capsys.readouterr().out
    assert "Not checked (`--no-check`)." in (tmp_path / "bad" / "README.md").read_text()
    with pytest.raises(SystemExit) as e:
        cli(["export", str(runs[2][0]), "--to", str(tmp_path / "bad2")])
    assert e.value.code == 10
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "the export's loss differs from the checkpoint's by" in lines[0], lines
    assert "beyond the float32 tolerance 0.0001; do not ship it" in lines[0]
    assert "FAILED: do not ship this export" in (tmp_path / "bad2" / "README.md").read_text()


def test_compile_and_activation_checkpointing_leave_the_loss_unchanged(runs):
    plain, fancy = runs[3][1], runs[2][1]
    graphs = re.search(r"torch.compile: (\d+) graphs compiled", fancy)
    assert graphs and int(graphs.group(1)) >= 1, fancy[-2000:]
    assert "graphs compiled" not in plain
    a, b = read_metrics(runs[3][0]), read_metrics(runs[2][0])
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    assert [m["loss"] for m in a] == pytest.approx([m["loss"] for m in b], rel=1e-5)
    assert a[-1]["loss"] < a[0]["loss"]


@pytest.mark.parametrize("flags,expected", [
    (lambda a: ["--init-from", str(_pickles_only(a))], "holds only pickled weights (pytorch_model.bin)"),
    (lambda a: ["--init-from", str(_not_llama(a))], "not a Llama model (model_type 'gpt2'"),
    (lambda a: ["--init-from", str(_yarn(a))], ": rope_scaling rope_type 'yarn' is not supported by this model"),
    (lambda a: ["--depth", "1"], "--depth 1: depth 1 x aspect ratio 64 = 64 is 0.5 heads of 128"),
])
def test_model_flag_bad_input_exits_2_with_one_line(flags, expected, assets, tmp_path):
    proc = launch("python", ["--data", str(assets["mix"]), "--out", str(tmp_path / "runs"), *flags(assets)])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("zerotrain: error:") and expected in lines[0], lines
    assert not (tmp_path / "runs").exists()


def _pickles_only(assets):
    import shutil

    d = assets["llama"].parent / "pickles"
    if not d.exists():
        d.mkdir()
        shutil.copy(assets["llama"] / "config.json", d)
        (d / "pytorch_model.bin").write_bytes(b"not unpickled")
    return d


def _not_llama(assets):
    d = assets["llama"].parent / "gpt2"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    return d


def _yarn(assets):
    """The Llama with a RoPE scaling our rotary embedding does not compute (weights and all, no tokenizer.json)."""
    import shutil

    d = assets["llama"].parent / "yarn"
    if not d.exists():
        shutil.copytree(assets["llama"], d)
        cfg = json.loads((d / "config.json").read_text())
        cfg["rope_parameters"] = {**cfg["rope_parameters"], "rope_type": "yarn", "factor": 4.0}
        (d / "config.json").write_text(json.dumps(cfg))
    return d
