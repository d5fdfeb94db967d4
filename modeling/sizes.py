"""Model sizes from one knob: the depth rule and the heads-based scaling rules.

- `depth_args(D)`: n_layers = D, dim = D x aspect_ratio rounded to a multiple of head_dim,
  n_heads = dim / head_dim (nanochat's single size knob).
- `rule_args(name, H)`: every size from the head count, by a rule in scaling_rules.yaml
  (`enoki`, `qwen3`, or your own file); `rule_lr(rule, P, optimizer)`: the rule's optional
  learning-rate power law lr = a * (b + P) ** d in the non-embedding parameter count P, one per
  optimizer (`lr: {adamw: {a, b, d}, muon: {...}}`; the older `lr: {a, b, d}` is AdamW's).

Also the sizes themselves: `ModelArgs` (one dataclass, validated in __post_init__), the named
`PRESETS`, and their arithmetic, `count_params` and `flops_per_token`. Nothing here imports torch:
`zerotrain plan` and `zerotrain params` use this module without it (modeling/model.py is the model).

Everything raises ValueError with a message that names the offending value; the launcher turns
it into a one-line flag error.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from zerotrain import resource_dir
from zerotrain.modeling.attention import KERNELS, AttentionKernel
from zerotrain.reading import read_yaml

@dataclass(frozen=True)
class ModelArgs:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (plain multi-head attention)
    ffn_hidden: int | None = None  # None: ffn_mult x dim rounded up to ffn_multiple_of
    ffn_mult: float = 8 / 3  # only used when ffn_hidden is None
    ffn_multiple_of: int = 64
    vocab_size: int = 258  # padded up to vocab_multiple_of in __post_init__
    # how vocab_size was padded (1: a Hugging Face checkpoint's, kept as it is); not compared: two models of the
    # same padded vocab_size are the same model however they got it
    vocab_multiple_of: int = field(default=64, compare=False)
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    qk_norm: bool = False
    head_dim: int | None = None  # None: dim / n_heads; set when a checkpoint's differs (Qwen3: 128 at dim 1024, 16 heads)
    # None: plain RoPE. Else Llama 3.1's frequency scaling (modeling/model.py rope_inv_freq), the keys of HF's
    # rope_scaling: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}. Not hashed (a dict); compared.
    rope_scaling: dict | None = field(default=None, hash=False)

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"model args: {msg}")

        def positive_int(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                bad(f"{name} must be a positive integer, got {v!r}")

        for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len", "vocab_multiple_of",
                     "ffn_multiple_of"):
            positive_int(name)
        for name in ("rope_theta", "norm_eps", "init_std", "ffn_mult"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                bad(f"{name} must be a positive number, got {v!r}")
        for name in ("tie_embeddings", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        positive_int("n_kv_heads")
        if self.head_dim is None:
            if self.dim % self.n_heads:
                bad(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        positive_int("head_dim")
        if self.n_heads % self.n_kv_heads:
            bad(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            bad(f"head dim {self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", _llama3_scaling(self.rope_scaling, bad))
        if self.ffn_hidden is None:
            m = self.ffn_multiple_of
            object.__setattr__(self, "ffn_hidden", m * math.ceil(int(self.ffn_mult * self.dim) / m))
        positive_int("ffn_hidden")
        padded = self.vocab_multiple_of * math.ceil(self.vocab_size / self.vocab_multiple_of)
        object.__setattr__(self, "vocab_size", padded)

    def to_dict(self) -> dict:
        return asdict(self)


LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _llama3_scaling(scaling, bad) -> dict:
    """rope_scaling checked and normalised: rope_type "llama3" and its four numbers, nothing else."""
    if not isinstance(scaling, dict) or scaling.get("rope_type") != "llama3":
        bad(f"rope_scaling must be {{'rope_type': 'llama3', ...}}, got {scaling!r}")
    unknown = sorted(set(scaling) - {"rope_type", *LLAMA3_SCALING_KEYS})
    if unknown:
        bad(f"rope_scaling: unknown key {unknown[0]!r}")
    out = {"rope_type": "llama3"}
    for key in LLAMA3_SCALING_KEYS:
        v = scaling.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            bad(f"rope_scaling {key} must be a positive number, got {v!r}")
        out[key] = int(v) if key == "original_max_position_embeddings" else float(v)
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        bad(f"rope_scaling high_freq_factor {out['high_freq_factor']} must exceed low_freq_factor"
            f" {out['low_freq_factor']}")
    return out


# Named presets: the shapes this toolkit's users train today (layers x dim). Head dim is 64 below
# dim 1536 and 128 from there; the MLP is SwiGLU with 8/3 x dim hidden units (multiple of 64)
# unless stated. `debug` is what the tests and the demo train on 2 CPU cores. The two `ws-`
# presets are the dual 48 GB workstation configurations; their names are their total counts with
# an untied 128,256-token vocabulary (the Llama 3 tokenizer): `zerotrain params --vocab-size 128256`.
PRESETS: dict[str, ModelArgs] = {
    "debug": ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=1024),
    "tiny": ModelArgs(dim=512, n_layers=12, n_heads=8),
    "small": ModelArgs(dim=768, n_layers=16, n_heads=12),
    "medium": ModelArgs(dim=1024, n_layers=24, n_heads=16),
    "medium-large": ModelArgs(dim=1152, n_layers=20, n_heads=18),
    "large": ModelArgs(dim=1536, n_layers=24, n_heads=12),
    "xlarge": ModelArgs(dim=1920, n_layers=32, n_heads=15),
    "ws-760m": ModelArgs(dim=1024, n_layers=24, n_heads=16, ffn_hidden=5376),
    "ws-1.3b": ModelArgs(dim=1536, n_layers=32, n_heads=12),
}


def preset(name: str, **overrides) -> ModelArgs:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    if {"dim", "n_heads"} & set(overrides) and "head_dim" not in overrides:
        overrides["head_dim"] = None  # derived again from the new shape, not the preset's
    return replace(PRESETS[name], **overrides)


def count_params(args: ModelArgs) -> dict:
    """Total and non-embedding parameter counts (norms included; a tied head counted once)."""
    attn = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads)
    mlp = 3 * args.dim * args.ffn_hidden
    per_layer = attn + mlp + 2 * args.dim + (2 * args.head_dim if args.qk_norm else 0)
    embed = args.vocab_size * args.dim
    non_embedding = args.n_layers * per_layer + args.dim
    total = non_embedding + embed + (0 if args.tie_embeddings else embed)
    return {"total": total, "non_embedding": non_embedding}


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (matmul params) + 12 x n_layers x dim x seq_len (attention scores).

    The attention term counts the full causal-free T x T product (the PaLM convention), an upper bound
    for packed rows where masked-out blocks are skipped by fused kernels.
    """
    n = count_params(args)["non_embedding"] + args.vocab_size * args.dim  # the head's matmul counts
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len  # n_heads x head_dim: dim, unless set


# -- which attention kernel and loss chunk a run gets (modeling/model.py runs them; here without torch,
# so that `zerotrain plan`, `--help` and the driver's start-up checks can decide before torch loads) --

ATTENTION_BACKENDS = ("auto", *KERNELS)  # modeling/attention.py: one entry per kernel
# fp32 logits per chunk of the chunked loss (modeling/model.py LMHead): 261 tokens of a 128,256-token
# vocabulary. The chunk's logits, their softmax (in place) and one 16-bit copy are alive at once.
LOSS_CHUNK_BYTES = 128 * 2**20


def loss_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of the chunked loss: as many as fit LOSS_CHUNK_BYTES of fp32 logits."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab_size))


def mlp_tiles(positions: int, dim: int) -> int:
    """Tiles a tiled MLP (--tiled-mlp) splits a rank's `positions` positions into: DeepSpeed's own rule
    (deepspeed/runtime/sequence_parallel/ulysses_sp.py, TiledMLP's docstring: ceil(seqlen / hidden_size)), so a
    tile's (tile x ffn_hidden) intermediates are about as large as the MLP's (positions x dim) input. Every
    rank of a run computes the same number: rows are always --seq-len long (a ZeRO-3 rank that ran another
    number of tiles would gather its MLP weights another number of times and hang the others)."""
    return max(1, math.ceil(positions / dim))


def varlen_available() -> bool:
    """torch.nn.attention.varlen exists (torch >= 2.9); found without importing it (the import takes ~1 s)."""
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def choose_attention(name: str, device_type: str, precision: str, varlen_installed: bool = True,
                     gqa: bool = False) -> str:
    """The kernel `name` (one of ATTENTION_BACKENDS) means for activations in `precision` ("fp32",
    "bf16", "fp16") on `device_type` ("cuda", "cpu", ...); `varlen_installed`: torch has
    torch.nn.attention.varlen (>= 2.9), the module a kernel's `module` names; `gqa`: the model has fewer kv
    heads than heads. Read from modeling/attention.py's KERNELS.

    auto: the lowest `auto_rank` kernel that can run here (varlen on CUDA in 16-bit, the flash kernel, no O(T^2)
    mask; else sdpa). An explicit name is checked against what its kernel needs; ValueError (one line, saying
    why) if it cannot run there, or if it would run PyTorch's math kernel: sdpa on CUDA with packed documents (a
    mask; every run packs) and GQA, which neither the flash kernel (no mask) nor the memory-efficient one (no GQA)
    takes.
    """
    if name != "auto" and name not in KERNELS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(('auto', *KERNELS))}")
    if name == "auto":
        ranked = sorted((k for k in KERNELS.values() if k.auto_rank is not None), key=lambda k: k.auto_rank)
        return next(k.name for k in ranked if _refusal(k, device_type, precision, varlen_installed) is None)
    refusal = _refusal(KERNELS[name], device_type, precision, varlen_installed)
    if refusal is not None:
        raise ValueError(refusal)
    if math_kernel(name, device_type, gqa):
        raise ValueError(KERNELS[name].math_refusal)
    return name


def _refusal(kernel: AttentionKernel, device_type: str, precision: str, installed: bool) -> str | None:
    """Why `kernel` cannot run on `device_type` in `precision` (its entry's one-line reason), or None."""
    if kernel.module and not installed:
        return kernel.module_refusal
    if kernel.devices and device_type not in kernel.devices:
        return kernel.device_refusal.format(device_type=device_type)
    if kernel.precisions and precision not in kernel.precisions:
        return kernel.precision_refusal.format(precision=precision)
    return None


def math_kernel(kernel: str, device_type: str, gqa: bool) -> bool:
    """PyTorch runs its math kernel for this attention: sdpa on CUDA with packed documents (a mask: every run
    packs) and fewer kv heads than heads, which neither the flash kernel (no mask) nor the memory-efficient one
    (no GQA) takes (the kernels whose entry has `math_on_cuda_gqa`). It upcasts q, k and v to fp32, repeats the
    kv heads and keeps each layer's (B, H, T, T) fp32 softmax for backward: `choose_attention` refuses sdpa named
    so, and the planner counts it where auto resolves to it (fp32 on CUDA, or a torch without varlen)."""
    entry = KERNELS.get(kernel)
    return entry is not None and entry.math_on_cuda_gqa and device_type == "cuda" and gqa


RULES_FILE = resource_dir("zerotrain.modeling", "scaling_rules.yaml")
RULE_KEYS = {"description", "head_dim", "layers_per_head", "mlp_ratio", "kv_heads_ratio", "tie_embeddings",
             "qk_norm", "lr"}


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def depth_args(depth: int, aspect_ratio: int = 64, head_dim: int = 128, **overrides) -> ModelArgs:
    """dim = depth x aspect_ratio, rounded to the nearest multiple of head_dim (ties round up)."""
    _positive_int(depth, "depth")
    _positive_int(aspect_ratio, "aspect ratio")
    _positive_int(head_dim, "head dim")
    raw = depth * aspect_ratio
    if raw < head_dim:
        raise ValueError(f"depth {depth} x aspect ratio {aspect_ratio} = {raw} is {raw / head_dim:g} heads of"
                         f" {head_dim}, not a whole head; use a larger depth or a smaller head dim")
    n_heads = (2 * raw + head_dim) // (2 * head_dim)
    return ModelArgs(dim=n_heads * head_dim, n_layers=depth, n_heads=n_heads, **overrides)


def load_rules(path: str | Path = RULES_FILE) -> dict[str, dict]:
    """The rules of a YAML file (safe_load: plain data only), each checked."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"scaling rules {path}: no such file")
    rules = read_yaml(path, f"scaling rules {path}", ValueError)
    if not isinstance(rules, dict) or not rules:
        raise ValueError(f"scaling rules {path}: expected a mapping of rule names to rules")
    for name, rule in rules.items():
        _check_rule(rule, f"scaling rules {path}: rule {name!r}")
    return rules


def _check_rule(rule, where: str) -> None:
    if not isinstance(rule, dict):
        raise ValueError(f"{where}: expected a mapping")
    unknown = sorted(set(rule) - RULE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(RULE_KEYS))})")
    for key in ("head_dim", "layers_per_head", "mlp_ratio"):
        if key not in rule:
            raise ValueError(f"{where}: missing {key}")
    _positive_int(rule["head_dim"], f"{where}: head_dim")
    lph = rule["layers_per_head"]
    if not (isinstance(lph, list) and len(lph) == 2):
        raise ValueError(f"{where}: layers_per_head must be [numerator, denominator], got {lph!r}")
    for v in lph:
        _positive_int(v, f"{where}: layers_per_head entries")
    _positive_int(rule.get("kv_heads_ratio", 1), f"{where}: kv_heads_ratio")
    _positive_number(rule["mlp_ratio"], f"{where}: mlp_ratio")
    for key in ("tie_embeddings", "qk_norm"):
        if not isinstance(rule.get(key, False), bool):
            raise ValueError(f"{where}: {key} must be true or false, got {rule[key]!r}")
    law = rule.get("lr")
    if law is not None:
        if not isinstance(law, dict) or not law:
            raise ValueError(f"{where}: lr must be a mapping: {{a, b, d}} or {{optimizer: {{a, b, d}}, ...}}"
                             " (lr = a * (b + P) ** d)")
        if set(law) & {"a", "b", "d"}:  # the single-law form (before per-optimizer laws): AdamW's
            _check_law(law, f"{where}: lr")
        else:
            for optimizer, one in law.items():
                if not isinstance(optimizer, str):
                    raise ValueError(f"{where}: lr: optimizer names must be strings, got {optimizer!r}")
                _check_law(one, f"{where}: lr.{optimizer}")


def _check_law(law, where: str) -> None:
    if not isinstance(law, dict) or set(law) != {"a", "b", "d"}:
        raise ValueError(f"{where} must be a mapping with exactly a, b and d (lr = a * (b + P) ** d)")
    for key in ("a", "b", "d"):  # PyYAML reads 1.0e5 (no sign in the exponent) as a string
        if isinstance(law[key], str):
            with contextlib.suppress(ValueError):
                law[key] = float(law[key])
    _positive_number(law["a"], f"{where}.a")
    for key in ("b", "d"):
        if isinstance(law[key], bool) or not isinstance(law[key], (int, float)) or not math.isfinite(law[key]):
            raise ValueError(f"{where}.{key} must be a number, got {law[key]!r}")
    if law["b"] < 0:
        raise ValueError(f"{where}.b must be >= 0, got {law['b']!r}")


def _positive_number(value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive number, got {value!r}")


def get_rule(name: str, rules_file: str | Path = RULES_FILE) -> dict:
    rules = load_rules(rules_file)
    if name not in rules:
        raise ValueError(f"unknown scaling rule {name!r}; known: {', '.join(rules)}")
    return rules[name]


def rule_args(rule: dict, heads: int, **overrides) -> ModelArgs:
    """ModelArgs for `heads` attention heads under `rule` (a checked entry of load_rules)."""
    _positive_int(heads, "heads")
    num, den = rule["layers_per_head"]
    n_layers = num * heads // den
    if n_layers < 1:
        raise ValueError(f"heads {heads} gives {num} * {heads} // {den} = 0 layers")
    kv_ratio = rule.get("kv_heads_ratio", 1)
    if heads % kv_ratio:
        raise ValueError(f"heads {heads} is not divisible by the rule's kv_heads_ratio {kv_ratio}")
    dim = heads * rule["head_dim"]
    args = dict(dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=heads // kv_ratio,
                ffn_hidden=64 * math.ceil(rule["mlp_ratio"] * dim / 64),
                tie_embeddings=rule.get("tie_embeddings", False), qk_norm=rule.get("qk_norm", False))
    return ModelArgs(**{**args, **overrides})


def rule_laws(rule: dict) -> dict[str, dict]:
    """The rule's lr laws by optimizer name; the single-law form is AdamW's (the only optimizer before)."""
    law = rule.get("lr")
    if law is None:
        return {}
    return {"adamw": law} if "a" in law else dict(law)


def rule_lr(rule: dict, non_embedding_params: int, optimizer: str | list[str] = "adamw") -> float | None:
    """lr = a * (b + P) ** d by the law of `optimizer` (or the first of several names that has one), or None."""
    laws = rule_laws(rule)
    for name in [optimizer] if isinstance(optimizer, str) else optimizer:
        if name in laws:
            law = laws[name]
            return float(law["a"] * (law["b"] + non_embedding_params) ** law["d"])
    return None


# The per-size default learning rate, used when neither the command line, a recipe, the scaling rule nor the
# profile gives one (zerotrain.launcher.hparams): the same law form, lr = a * (b + P) ** d in the
# non-embedding parameter count P, fitted (least squares in log-log) to the peak learning rates GPT-3 trained
# its eight sizes with (Brown et al. 2020, Table 2.1: 6e-4 at 125M ... 1e-4 at 13B, 6e-5 at 175B; P =
# 12 x layers x d_model^2), within 25% of every one of them. It gives 2.1e-4 for `xlarge` (1.4B) and 1.9e-3
# for `debug` (0.8M). An AdamW law: other optimizers have their own defaults (launcher/optimizers.py).
DEFAULT_LR_LAWS = {"adamw": {"a": 0.102, "b": 0, "d": -0.294}}


def default_lr(non_embedding_params: int) -> float:
    """The per-size default peak lr (DEFAULT_LR_LAWS) of a model with this many non-embedding parameters."""
    return rule_lr({"lr": DEFAULT_LR_LAWS}, non_embedding_params, "adamw")


def check_sequence_parallel(args: ModelArgs, size: int) -> None:
    """ValueError (one line) when `size` ranks cannot split this model's heads: query heads must divide
    by size, and kv heads divide by it or it by them (then each kv head is repeated size/kv times)."""
    if args.n_heads % size:
        raise ValueError(f"sequence parallelism over {size} ranks needs attention heads divisible by {size};"
                         f" the model has {args.n_heads}")
    if args.n_kv_heads % size and size % args.n_kv_heads:
        raise ValueError(f"sequence parallelism over {size} ranks needs kv heads divisible by {size} or dividing"
                         f" it; the model has {args.n_kv_heads}")
