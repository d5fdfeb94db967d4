"""Hugging Face format, in-process: our logits against the real `transformers` classes, the byte
round trip, import from a directory `transformers` itself wrote, and what a bad directory gets."""
import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from zerotrain.modeling import hf
from zerotrain.modeling.model import ModelArgs, Transformer


def random_configs(n: int, seed: int = 0):
    """Random small shapes covering GQA/MHA/MQA, tied/untied, QK-norm, unpadded vocab, rope theta."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        head_dim = rng.choice([8, 16])
        n_heads = rng.choice([2, 4, 6])
        n_kv = rng.choice([h for h in (1, 2, 3, n_heads) if n_heads % h == 0])
        out.append(dict(dim=head_dim * n_heads, n_layers=rng.choice([1, 2, 3]), n_heads=n_heads, n_kv_heads=n_kv,
                        ffn_hidden=rng.choice([40, 96, 130]), vocab_size=rng.choice([100, 128, 200]),
                        rope_theta=rng.choice([10000.0, 500000.0]), norm_eps=rng.choice([1e-5, 1e-6]),
                        tie_embeddings=i % 2 == 1, qk_norm=i % 3 == 2, max_seq_len=64))
    return out


# Llama 3.1/3.2's RoPE scaling (its real numbers, the original context shrunk so that a 23-token test spans the
# interpolated band: wavelengths 4..16 positions), and an explicit head_dim as Qwen3 has it (twice hidden / heads).
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CONFIGS = random_configs(6) + [
    dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=130, tie_embeddings=True),
    dict(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, tie_embeddings=True, rope_theta=500000.0,
         rope_scaling=LLAMA3, head_dim=16),  # Llama 3.2-like: tied, scaled, head_dim != dim / heads
    dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, tie_embeddings=True, qk_norm=True,
         head_dim=16, rope_theta=1000000.0, norm_eps=1e-6),  # Qwen3-like: QK-norm, head_dim 2 x dim / heads
]


def config_id(kw):
    return (f"h{kw['n_heads']}kv{kw['n_kv_heads']}{'-tied' if kw['tie_embeddings'] else ''}"
            f"{'-qknorm' if kw.get('qk_norm') else ''}{'-hd%d' % kw['head_dim'] if 'head_dim' in kw else ''}"
            f"{'-llama3' if kw.get('rope_scaling') else ''}")


def build(kw, seed=0):
    args = ModelArgs(**kw)
    torch.manual_seed(seed)
    model = Transformer(args).eval()
    with torch.no_grad():  # norms away from 1 so that a mixed-up norm weight shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return args, model


@pytest.mark.parametrize("kw", CONFIGS, ids=config_id)
def test_exported_model_logits_match_transformers(kw, tmp_path):
    from transformers import AutoModelForCausalLM

    args, model = build(kw)
    hf.save(tmp_path, model.state_dict(), args, bos_id=1, eos_id=2)
    theirs, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    expected = "Qwen3ForCausalLM" if args.qk_norm else "LlamaForCausalLM"
    assert type(theirs).__name__ == expected
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert theirs.config.tie_word_embeddings == args.tie_embeddings
    assert theirs.config.vocab_size == args.vocab_size and args.vocab_size % 64 == 0
    x = torch.randint(0, kw["vocab_size"], (2, 23))
    with torch.no_grad():
        ours, their_logits = model(x), theirs.eval()(x).logits
    assert ours.shape == their_logits.shape
    assert torch.allclose(ours, their_logits, atol=1e-4, rtol=0), (ours - their_logits).abs().max()


@pytest.mark.parametrize("kw", CONFIGS[:3] + CONFIGS[-2:], ids=config_id)
def test_export_import_export_is_byte_identical(kw, tmp_path):
    args, model = build(kw, seed=5)
    hf.save(tmp_path / "a", model.state_dict(), args)
    cfg = hf.read_config(tmp_path / "a")
    args_back = hf.args_from_config(cfg, "a")
    assert args_back == args
    hf.check_weights(tmp_path / "a", args_back)
    torch.manual_seed(99)  # different init: every tensor must come from the file
    again = Transformer(args_back)
    hf.load_weights(again, tmp_path / "a")
    hf.save(tmp_path / "b", again.state_dict(), args_back)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and a[k].numpy().tobytes() == b[k].numpy().tobytes() for k in a)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert (tmp_path / "a" / "config.json").read_text() == (tmp_path / "b" / "config.json").read_text()


def test_import_from_a_directory_transformers_wrote(tmp_path):
    """A real LlamaForCausalLM.save_pretrained directory of vocabulary 100, which our own models would pad to 128:
    imported as it is (padded rows would enter the softmax), so the logits and the loss are transformers'."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, vocab_size=100, rope_theta=50000.0, rms_norm_eps=1e-5)
    theirs = LlamaForCausalLM(cfg).eval()
    theirs.save_pretrained(tmp_path)
    raw = hf.read_config(tmp_path)
    args = hf.args_from_config(raw, str(tmp_path))
    assert (args.dim, args.n_heads, args.n_kv_heads, args.ffn_hidden, args.vocab_size) == (48, 6, 2, 80, 100)
    hf.check_weights(tmp_path, args)
    ours = Transformer(args).eval()
    hf.load_weights(ours, tmp_path)
    x = torch.randint(0, 100, (2, 17))
    with torch.no_grad():
        assert torch.allclose(ours(x), theirs(x).logits, atol=1e-4, rtol=0)
        loss = ours(x, labels=x)  # our loss shifts the labels itself, as transformers' does
        assert abs(loss.item() - theirs(x, labels=x).loss.item()) < 1e-5


def _llama32_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=100, tie_word_embeddings=True,
                       rope_theta=500000.0, rope_scaling=dict(LLAMA3), max_position_embeddings=128)


def _qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=100, tie_word_embeddings=True,
                       rms_norm_eps=1e-6, max_position_embeddings=128)


@pytest.mark.parametrize("make_config", [_llama32_config, _qwen3_config], ids=["llama3.2", "qwen3"])
def test_import_and_export_of_a_llama32_or_qwen3_directory(make_config, tmp_path):
    """What transformers itself writes for a Llama 3.2 (llama3 RoPE scaling, explicit head_dim, tied) and a Qwen3
    (QK-norm, head_dim 2 x hidden / heads, tied): imported, the same logits; exported back in its architecture."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(make_config()).eval()
    with torch.no_grad():  # norms away from 1, as `build` does
        for name, p in theirs.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    theirs.save_pretrained(tmp_path / "theirs")
    raw = hf.read_config(tmp_path / "theirs")
    args = hf.args_from_config(raw, "theirs")
    assert args.head_dim == 16 and args.head_dim * args.n_heads != args.dim
    hf.check_weights(tmp_path / "theirs", args)
    ours = Transformer(args).eval()
    hf.load_weights(ours, tmp_path / "theirs")
    x = torch.randint(0, 100, (2, 40))  # past original_max_position_embeddings (16): the scaled band is used
    with torch.no_grad():
        their_logits = theirs(x).logits
        assert torch.allclose(ours(x), their_logits, atol=1e-4, rtol=0)
    hf.save(tmp_path / "ours", ours.state_dict(), args)
    back = hf.read_config(tmp_path / "ours")
    assert (back["architectures"], back["model_type"]) == (raw["architectures"], raw["model_type"])
    assert hf.args_from_config(back, "ours") == args
    # transformers 4.x's keys too (5.x's save_pretrained keeps rope_parameters only): 4.x readers see the same RoPE
    assert (back["rope_theta"], back["rope_scaling"]) == (args.rope_theta, args.rope_scaling)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()  # 5.x reads the config with both
    with torch.no_grad():
        assert torch.allclose(again(x).logits, their_logits, atol=1e-4, rtol=0)


def test_sharded_safetensors_directory_is_read(tmp_path):
    args, model = build(CONFIGS[0])
    hf.save(tmp_path / "one", model.state_dict(), args)
    tensors = load_file(tmp_path / "one" / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    out = tmp_path / "sharded"
    out.mkdir()
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, out / file, metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    (out / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    hf.check_weights(out, args)
    loaded = Transformer(args)
    hf.load_weights(loaded, out)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), loaded.parameters()))


def _llama_dir(tmp_path, **config_changes):
    args, model = build(CONFIGS[0])
    hf.save(tmp_path, model.state_dict(), args)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(config_changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _tied_with_a_head(directory, same: bool):
    """A tied config whose weights also hold lm_head.weight: the embedding's values, or others (transformers 5
    then loads it untied, 4.x tied)."""
    _llama_dir(directory, tie_word_embeddings=True)
    tensors = load_file(directory / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone() + (0 if same else 1e-3)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_a_tied_config_with_the_embedding_stored_as_its_head_too_is_read(tmp_path):
    directory = _tied_with_a_head(tmp_path, same=True)
    args = hf.args_from_config(hf.read_config(directory), "d")
    assert args.tie_embeddings
    hf.check_weights(directory, args)


def _truncated(directory):
    file = directory / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    return directory


def _shard_swapped(directory):
    """Two shards and an index that places one tensor in the shard that does not hold it."""
    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, directory / file)
    weight_map = {n: file for file, part in shards.items() for n in part}
    weight_map[names[0]] = "b.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


@pytest.mark.parametrize("change,message", [
    (lambda d: _llama_dir(d, model_type="gpt2", architectures=["GPT2LMHeadModel"]), "not a Llama model"),
    (lambda d: _llama_dir(d, rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     "rope_scaling low_freq_factor must be a positive number, got None"),
    (lambda d: _llama_dir(d, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "rope_scaling rope_type 'yarn' is not supported"),
    (lambda d: _llama_dir(d, rope_scaling={"type": "linear", "factor": 2.0}), "rope_type 'linear' is not supported"),
    (lambda d: _llama_dir(d, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "rope_scaling rope_type 'dynamic' is not supported"),
    (lambda d: _llama_dir(d, rope_scaling={**LLAMA3, "attention_factor": 2.0}), "rope_scaling attention_factor 2.0"),
    (lambda d: _llama_dir(d, partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported"),
    (lambda d: _llama_dir(d, attention_bias=True), "attention_bias True is not supported"),
    (lambda d: _llama_dir(d, layer_types=["full_attention", "sliding_attention"]),
     "layer_types 'sliding_attention' is not supported"),
    (lambda d: _llama_dir(d, hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda d: _llama_dir(d, head_dim=4), "tensor model.layers.0.self_attn.q_proj.weight has shape [64, 64],"
     " config.json implies [16, 64]"),
    (lambda d: _llama_dir(d, num_key_value_heads=3), "n_heads 4 is not divisible by n_kv_heads 3"),
    (lambda d: _llama_dir(d, intermediate_size=12), "has shape"),
    (lambda d: _llama_dir(d, num_hidden_layers=9), "missing tensor model.layers."),
    (lambda d: (_llama_dir(d), (d / "model.safetensors").rename(d / "pytorch_model.bin"))[0],
     "holds only pickled weights (pytorch_model.bin); zerotrain never unpickles"),
    (lambda d: d, "no config.json"),
    (lambda d: _llama_dir(d) / "config.json", "config.json: a file; give the directory that holds it"),
    (lambda d: _llama_dir(d) / "model.safetensors", "model.safetensors: a file; give the directory that holds it"),
    (lambda d: _tied_with_a_head(d, same=False), "config.json ties the head to the embedding (tie_word_embeddings"
     " true) but lm_head.weight holds other values"),
    (lambda d: (d / "config.json").write_text(json.dumps({"run": {}, "model": {}})) and d,
     "a zerotrain run directory, not a Hugging Face model; `zerotrain export RUN --to DIR`"),
    (lambda d: _truncated(_llama_dir(d)), "model.safetensors: not a readable safetensors file"),
    (lambda d: (_llama_dir(d), (d / "model.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"not a header...."))[0],
     "model.safetensors: not a readable safetensors file"),
    (lambda d: _shard_swapped(_llama_dir(d)), "which model.safetensors.index.json places in it"),
])
def test_bad_hf_directories_are_refused(tmp_path, change, message):
    directory = change(tmp_path)
    with pytest.raises(ValueError) as e:
        raw = hf.read_config(directory)
        args = hf.args_from_config(raw, str(directory))
        hf.check_weights(directory, args)
    assert message in str(e.value)


def test_shapes_of_a_model_too_large_for_this_host_come_from_the_meta_device():
    """expected_shapes (every --init-from check, the plan, the dry run) builds the model on the meta device and
    draws no values: an embedding of 2**40 elements (4 TiB in fp32) gives its shape at once, where drawing its
    values on the CPU, as init_weights does for a real model, could not even allocate them (and took 12 s and
    5.6 GB for each check of a 1.4B model before)."""
    args = ModelArgs(dim=2**20, n_layers=1, n_heads=2**10, n_kv_heads=2**10, vocab_size=2**20)
    shapes = hf.expected_shapes(args)
    assert shapes["embed_tokens.weight"] == (2**20, 2**20)
    small = Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=32))
    assert set(shapes) == {name for name, _ in small.named_parameters()}
