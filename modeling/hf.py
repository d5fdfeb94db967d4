"""The Hugging Face format: `config.json` <-> ModelArgs, `*.safetensors` <-> our parameters.

Our parameter names are Hugging Face Llama's without the leading `model.` (`lm_head.weight`
keeps its name) and the rotary layout is HF's `rotate_half` one, so the conversion is a rename:
no permutation, no reshaping. A model with QK-norm is written as `Qwen3ForCausalLM` (Llama has
no QK-norm; Qwen3 is Llama plus a per-head RMSNorm on q and k before the rotation, which is
exactly ours). Tied embeddings are written HF's way: `tie_word_embeddings: true` and no
`lm_head.weight` tensor; read, a tied config's stored `lm_head.weight` must equal the embedding (transformers 5
would load a different one untied, 4.x tie it: refused). An explicit `head_dim` (hidden_size / heads or not) and Llama 3.1's `llama3`
rope_scaling are read into ModelArgs and written back; what our model cannot compute exactly (other
rope types, biases, sliding windows, other activations) is refused naming the key. A checkpoint's vocabulary is
kept as it is, not padded to a multiple of 64 as our own models' are: padded rows would take part in the softmax
and change every loss and the exported model (a Llama of vocabulary 300 gave step 1 a loss 1% above transformers'
for the same weights and tokens, and exported as a vocabulary of 320).

Reading a directory never unpickles: config.json through `json`, weights through
`safetensors.safe_open`, one tensor at a time. A directory that holds only `pytorch_model.bin`
pickles is refused. Errors are ValueError with a message naming the file and what is wrong.

torch (and transformers, for writing config.json) is imported by the functions that handle tensors:
reading and checking a config.json needs none (`zerotrain plan --init-from` resolves the model through
this module).
"""
from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

from zerotrain import ds_attributes
from zerotrain.modeling.sizes import LLAMA3_SCALING_KEYS, ModelArgs
from zerotrain.reading import read_json_object

if TYPE_CHECKING:  # annotations only: torch is imported where tensors are handled
    import torch

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


# -- config.json ---------------------------------------------------------------------------------

def hf_config(args: ModelArgs, bos_id: int | None = None, eos_id: int | None = None,
              dtype: str = "float32") -> dict:
    model_type = "qwen3" if args.qk_norm else "llama"
    cfg = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,  # our models' padded (ids past the tokenizer's are never produced); an import's as it was
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta,  # transformers 4.x
        # transformers 4.x: None, or the llama3 type's parameters (a copy: transformers 5 adds rope_theta in place)
        "rope_scaling": dict(args.rope_scaling) if args.rope_scaling else None,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta, **(args.rope_scaling or {})},  # 5.x
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": args.init_std,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "dtype": dtype,
        "use_cache": True,
    }
    if model_type == "llama":
        cfg["mlp_bias"] = False
    else:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=args.n_layers)
    return cfg


def read_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if Path(hf_dir).is_file():  # config.json, model.safetensors, ...: the directory is what is read
        raise ValueError(f"{hf_dir}: a file; give the directory that holds it ({Path(hf_dir).parent})")
    if not Path(hf_dir).is_dir():
        raise ValueError(f"{hf_dir}: no such directory")
    if not path.is_file():
        raise ValueError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    return read_json_object(path, str(path), ValueError, column=False)


def args_from_config(cfg: dict, where: str) -> ModelArgs:
    """ModelArgs for a Llama (or QK-norm Qwen3) config.json, its vocabulary unpadded (the module docstring);
    refuses what our model cannot express."""
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type is None and "run" in cfg and "model" in cfg:  # a zerotrain run directory's own config.json
        raise ValueError(f"{where}: a zerotrain run directory, not a Hugging Face model; `zerotrain export RUN"
                         " --to DIR` makes one of its checkpoint (the notebook's finetune(model=RUN) does it for you)")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{where}: not a Llama model (model_type {model_type!r}, architectures {archs});"
                         f" supported: {', '.join(ARCHITECTURES.values())}")
    if archs and ARCHITECTURES[model_type] not in archs:
        raise ValueError(f"{where}: architectures {archs} is not {ARCHITECTURES[model_type]}")

    def unsupported(key, value):
        raise ValueError(f"{where}: {key} {value!r} is not supported by this model")

    if cfg.get("hidden_act", "silu") != "silu":
        unsupported("hidden_act", cfg["hidden_act"])
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if cfg.get(key):
            unsupported(key, cfg[key])
    if cfg.get("quantization_config"):
        unsupported("quantization_config", "(quantized weights)")
    if cfg.get("pretraining_tp", 1) != 1:
        unsupported("pretraining_tp", cfg["pretraining_tp"])
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        unsupported("partial_rotary_factor", cfg["partial_rotary_factor"])
    layer_types = set(cfg.get("layer_types") or ()) - {"full_attention"}
    if layer_types:  # transformers 5.x's per-layer sliding window
        unsupported("layer_types", sorted(layer_types)[0])
    rope = cfg.get("rope_parameters") or {}
    scaling = _rope_scaling(cfg.get("rope_scaling") or rope, unsupported)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in cfg:
            raise ValueError(f"{where}: missing {key}")
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    vocab = cfg["vocab_size"]
    try:
        return ModelArgs(
            dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=heads,
            n_kv_heads=cfg.get("num_key_value_heads") or heads, ffn_hidden=cfg["intermediate_size"],
            vocab_size=vocab, vocab_multiple_of=1,
            max_seq_len=cfg.get("max_position_embeddings", 2048),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            init_std=float(cfg.get("initializer_range", 0.02)), qk_norm=model_type == "qwen3",
            head_dim=cfg.get("head_dim"), rope_scaling=scaling)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def _rope_scaling(scaling: dict, unsupported) -> dict | None:
    """ModelArgs.rope_scaling for config.json's rope_scaling (transformers 4.x) or rope_parameters (5.x): None for
    plain RoPE, the llama3 type's four numbers; any other type, or a key the llama3 type does not have, is refused
    (yarn, dynamic, linear, longrope: not computed by our rotary embedding)."""
    if not isinstance(scaling, dict):
        unsupported("rope_scaling", scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        unsupported("rope_scaling rope_type", rope_type)
    extra = sorted(set(scaling) - {"rope_type", "type", "rope_theta", *LLAMA3_SCALING_KEYS})
    if extra:
        unsupported(f"rope_scaling {extra[0]}", scaling[extra[0]])
    return {"rope_type": "llama3", **{k: scaling.get(k) for k in LLAMA3_SCALING_KEYS}}


# -- names ---------------------------------------------------------------------------------------

def hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Our parameter names and shapes, built on the meta device (no memory)."""
    import torch

    from zerotrain.modeling.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied: lm_head left out


# -- weights -------------------------------------------------------------------------------------

def weight_files(hf_dir: str | Path) -> dict[str, Path]:
    """{HF tensor name: safetensors file} for a single-file or sharded directory."""
    hf_dir = Path(hf_dir)
    if (hf_dir / SINGLE_FILE).is_file():
        with _opened(hf_dir / SINGLE_FILE) as f:
            return {k: hf_dir / SINGLE_FILE for k in f.keys()}
    if (hf_dir / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((hf_dir / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{hf_dir / INDEX_FILE}: not a safetensors index (no weight_map)") from None
        files = {k: hf_dir / v for k, v in weight_map.items()}
        missing = sorted({str(p) for p in files.values() if not p.is_file()})
        if missing:
            raise ValueError(f"{hf_dir / INDEX_FILE}: shard {missing[0]} does not exist")
        return files
    pickles = sorted(p.name for p in hf_dir.glob("*.bin")) + sorted(p.name for p in hf_dir.glob("*.pt*"))
    if pickles:
        raise ValueError(f"{hf_dir}: holds only pickled weights ({pickles[0]}); zerotrain never unpickles"
                         " untrusted files: convert them to safetensors first")
    raise ValueError(f"{hf_dir}: no {SINGLE_FILE} or {INDEX_FILE}")


def check_weights(hf_dir: str | Path, args: ModelArgs) -> dict[str, Path]:
    """Every tensor our model needs is there, in the file the index names, with the shape config.json implies
    (headers only; safetensors checks that each file is as long as its header says: a truncated or corrupt file
    is named here, before any process builds a model)."""
    files = weight_files(hf_dir)
    want = expected_shapes(args)
    hf_names = {hf_name(n) for n in want}
    ignored = {k for k in files if k.endswith("rotary_emb.inv_freq") or (k == "lm_head.weight" and args.tie_embeddings)}
    unexpected = sorted(set(files) - hf_names - ignored)
    if unexpected:
        raise ValueError(f"{hf_dir}: unexpected tensor {unexpected[0]} for this config")
    missing = sorted(hf_names - set(files))
    if missing:
        raise ValueError(f"{hf_dir}: missing tensor {missing[0]}")
    if "lm_head.weight" in ignored and _head_differs(files["model.embed_tokens.weight"], files["lm_head.weight"]):
        raise ValueError(f"{hf_dir}: config.json ties the head to the embedding (tie_word_embeddings true) but"
                         " lm_head.weight holds other values (transformers 5 loads the stored head, 4.x the"
                         " embedding: two different models); set tie_word_embeddings to false to train with the stored"
                         " head, or remove lm_head.weight to tie them")
    for file in sorted(set(files.values())):
        with _opened(file) as f:
            held = set(f.keys())
            for name, shape in want.items():
                if files[hf_name(name)] != file:
                    continue
                if hf_name(name) not in held:
                    raise ValueError(f"{file}: does not hold {hf_name(name)}, which {INDEX_FILE} places in it")
                got = tuple(f.get_slice(hf_name(name)).get_shape())
                if got != shape:
                    raise ValueError(f"{hf_dir}: tensor {hf_name(name)} has shape {list(got)},"
                                     f" config.json implies {list(shape)}")
    return files


@functools.lru_cache(maxsize=8)  # a run checks its --init-from directory up to three times (plan, tokenizer, finetune)
def _head_differs(embed_file: Path, head_file: Path, rows: int = 4096) -> bool:
    """A tied config's stored lm_head.weight is not the embedding, compared a block of rows at a time (an 8B model's
    embedding is 1 GiB in bf16: never two whole copies in memory)."""
    import torch

    with _opened(embed_file) as e, _opened(head_file) as h:
        embed, head = e.get_slice("model.embed_tokens.weight"), h.get_slice("lm_head.weight")
        if embed.get_shape() != head.get_shape():
            return True
        return any(not torch.equal(embed[lo:lo + rows], head[lo:lo + rows])
                   for lo in range(0, embed.get_shape()[0], rows))


@contextlib.contextmanager
def _opened(file: Path):
    """safetensors' `safe_open` of `file`, its errors (a header that is not safetensors', a file shorter than its
    header says) as ValueError naming the file: safetensors raises its own SafetensorError, which is no ValueError."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None


def _tensor(f, file: Path, name: str):
    """Tensor `name` from an open safetensors file, a read error as ValueError naming the file."""
    from safetensors import SafetensorError

    try:
        return f.get_tensor(name)
    except SafetensorError as e:
        raise ValueError(f"{file}: tensor {name} cannot be read ({e})") from None


def load_weights(model, hf_dir: str | Path) -> None:
    """Copy a checked HF directory's tensors into `model` (plain or ZeRO-3 partitioned): every value of every
    parameter (`check_weights`: the same shapes), so a model built without its initial weights
    (`weights_loaded_after`) is whole.

    A plain parameter is read by every rank. A ZeRO-3 partitioned one is gathered by all ranks
    together, read and written by rank 0 only, and scattered back by DeepSpeed, so no rank holds
    more than one full tensor at a time.
    """
    import torch

    from zerotrain.modeling.initial import gathered

    files = weight_files(hf_dir)
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            with gathered(param):
                if rank0 or not ds_attributes.is_partitioned(param):
                    with _opened(files[hf_name(name)]) as f:
                        param.copy_(_tensor(f, files[hf_name(name)], hf_name(name)))


def hf_state_dict(state_dict: dict[str, torch.Tensor], args: ModelArgs, dtype=None) -> dict:
    """Our (consolidated) state dict under HF names, contiguous, in `dtype` (default float32); tied lm_head dropped."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    want = expected_shapes(args)
    extra = sorted(set(state_dict) - set(want) - {"lm_head.weight"})
    missing = sorted(set(want) - set(state_dict))
    if extra or missing:
        raise ValueError(f"state dict does not match the model config: "
                         f"{'unexpected ' + extra[0] if extra else 'missing ' + missing[0]}")
    return {hf_name(n): state_dict[n].detach().to(dtype).contiguous() for n in want}


def save(out_dir: str | Path, state_dict: dict[str, torch.Tensor], args: ModelArgs, bos_id=None, eos_id=None,
         dtype: torch.dtype | None = None, pad_id=None, max_shard_size: int | str = "5GB") -> list[str]:
    """A Hugging Face directory shaped as `save_pretrained` leaves one, for our state dict (names as in
    Transformer.state_dict()) in `dtype` (default float32); returns the weight files written.

    Weights: safetensors shards of at most `max_shard_size` (bytes, or "5GB"/"500MB"/"100KB" as in
    save_pretrained; one tensor larger than that gets a shard of its own), split by huggingface_hub's
    `split_torch_state_dict_into_shards` (what save_pretrained calls): one `model.safetensors`, or
    `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`. config.json and
    generation_config.json (bos/eos/pad) are written by transformers' own config classes."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    dtype = torch.float32 if dtype is None else dtype
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(state_dict, args, dtype)
    # Split by shape and dtype alone (meta tensors): DeepSpeed's consolidated fp32 weights are views of one
    # flat buffer, which huggingface_hub would take for tied tensors and keep in one shard; ours share
    # nothing (a tied head is dropped by hf_state_dict).
    split = split_torch_state_dict_into_shards({n: t.to("meta") for n, t in tensors.items()},
                                               max_shard_size=max_shard_size)
    for file, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in sorted(names)}, str(out_dir / file), metadata={"format": "pt"})
    if split.is_sharded:  # the index save_pretrained writes: metadata.total_size and the weight map
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    cfg = hf_config(args, bos_id, eos_id, dtype=str(dtype).removeprefix("torch."))
    config = AutoConfig.for_model(cfg.pop("model_type"), pad_token_id=pad_id, **cfg)
    config.save_pretrained(out_dir)
    _keep_4x_rope_keys(out_dir / "config.json", args)
    GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id).save_pretrained(out_dir)
    return sorted(split.filename_to_tensors)


def _keep_4x_rope_keys(path: Path, args: ModelArgs) -> None:
    """transformers 5's save_pretrained writes RoPE's base and scaling in `rope_parameters` only; transformers 4.x
    (and vLLM, llama.cpp's converter, ...) read `rope_theta` and `rope_scaling`, and without them would load the
    export with plain RoPE at base 10000: a different model. Both spellings are kept (transformers 5 reads a
    config.json that has both, as 4.x wrote them)."""
    written = json.loads(path.read_text())
    keys = {"rope_theta": args.rope_theta, "rope_scaling": dict(args.rope_scaling) if args.rope_scaling else None}
    missing = {k: v for k, v in keys.items() if k not in written}
    if missing:
        path.write_text(json.dumps({**written, **missing}, indent=2, sort_keys=True) + "\n")
