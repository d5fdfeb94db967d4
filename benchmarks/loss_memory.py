"""`loss_memory`: peak memory and time of one forward + backward of a model whose
vocabulary dwarfs it, with the loss computed two ways on the same weights and batch:

- full logits: `next_token_loss(model(ids, pos), labels)`, the definition and what the model did before
  the chunked loss (the (B, T, V) logits, their fp32 copy, the log-softmax and its gradient);
- chunked: `model(ids, pos, labels=labels)`, the model's own path (`LMHead`, `chunked_next_token_loss`).

Shape: the issue's, a 16.5M-parameter model (dim 64, 2 layers, 4 heads, untied) with Llama 3's
128,256-token vocabulary, micro-batch 4 x 1,024 tokens of packed documents, fp32, one process. Each
variant runs in a fresh process, so its peak RSS (VmHWM, what `/usr/bin/time -v` reports as maximum
resident set size) is its own; the losses of the two are printed side by side.

    python benchmarks/run.py loss_memory
    python benchmarks/loss_memory.py --variant chunked   one variant, one JSON line (what run.py starts)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from harness import TINY

HERE = Path(__file__).resolve().parent
SHAPE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=128256)
MICRO, SEQ = 4, 1024
TARGET_GB = 2.5  # the target for this shape (7.1 GB measured before, through the driver)


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def one_variant(variant: str, vocab: int, micro: int, seq: int, steps: int, chunk_tokens: int | None) -> dict:
    """Build the model, run `steps` forward + backward passes of one batch; report loss, time, peak RSS."""
    import torch

    from zerotrain.modeling.loss import next_token_loss
    from zerotrain.modeling.model import ModelArgs, Transformer, count_params, loss_chunk_tokens

    args = ModelArgs(**{**SHAPE, "vocab_size": vocab})
    torch.manual_seed(0)
    model = Transformer(args)
    model.lm_head.chunk_tokens = chunk_tokens  # None: the model's default (loss_chunk_tokens)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (micro, seq), generator=g)
    doc = max(2, seq // 8)  # packed rows: documents of seq/8 tokens
    pos = (torch.arange(seq) % doc).expand(micro, seq)
    before = peak_rss_bytes()
    times, loss = [], None
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if variant == "chunked":
            loss = model(ids, pos, labels=ids)
        else:
            loss = next_token_loss(model(ids, pos), ids)
        loss.backward()
        times.append(time.perf_counter() - t0)
    return {"variant": variant, "params": count_params(args)["total"], "loss": loss.item(),
            "step_s": min(times), "peak_rss": peak_rss_bytes(), "rss_before_step": before,
            "threads": torch.get_num_threads(),
            "chunk_tokens": chunk_tokens or loss_chunk_tokens(args.vocab_size)}


def bench_loss_memory() -> list[dict]:
    # tiny: small enough for the smoke test, big enough that full logits (~200 MB) show in the RSS
    vocab, micro, seq, steps, chunk = (32768, 2, 256, 1, 64) if TINY else (SHAPE["vocab_size"], MICRO, SEQ, 2, None)
    got = {}
    for variant in ("full", "chunked"):
        r = subprocess.run([sys.executable, str(HERE / "loss_memory.py"), "--variant", variant, "--vocab", str(vocab),
                            "--micro", str(micro), "--seq", str(seq), "--steps", str(steps)]
                           + (["--chunk-tokens", str(chunk)] if chunk else []),
                           capture_output=True, text=True, timeout=1200)
        if r.returncode:
            raise RuntimeError(f"loss_memory {variant}: exit {r.returncode}: {r.stderr[-1500:]}")
        got[variant] = json.loads(r.stdout.strip().splitlines()[-1])
    setting = (f"{got['full']['params'] / 1e6:.1f}M params, vocab {vocab:,}, micro {micro} x {seq}, fp32,"
               f" 1 process x {got['full']['threads']} threads")
    rows = []
    full = got["full"]["loss"]
    for variant, label in (("full", "full logits (before)"), ("chunked", "chunked (LMHead)")):
        m = got[variant]
        how = f", chunks of {m['chunk_tokens']} tokens" if variant == "chunked" else ""
        same = f" (relative difference {abs(m['loss'] - full) / abs(full):.1e})" if variant == "chunked" else ""
        rows.append({"benchmark": f"loss memory: {label}", "setting": setting + how,
                     "result": f"peak RSS {m['peak_rss'] / 1e9:.2f} GB (model built: {m['rss_before_step'] / 1e9:.2f}"
                               f" GB), {m['step_s']:.2f} s/forward+backward, loss {m['loss']:.6f}{same}",
                     "target": f"<= {TARGET_GB} GB, loss equal to 1e-6" if variant == "chunked" else ""})
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=("full", "chunked"), required=True)
    p.add_argument("--vocab", type=int, default=SHAPE["vocab_size"])
    p.add_argument("--micro", type=int, default=MICRO)
    p.add_argument("--seq", type=int, default=SEQ)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--chunk-tokens", type=int, default=None, help="default: the model's own")
    a = p.parse_args()
    print(json.dumps(one_variant(a.variant, a.vocab, a.micro, a.seq, a.steps, a.chunk_tokens)))
