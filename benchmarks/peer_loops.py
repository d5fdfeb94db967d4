"""The plain training loops `benchmarks/gpu_peers.py` measures beside our driver, one per process:

    python benchmarks/peer_loops.py SPEC.json RESULT.json

C   our `Transformer` (zerotrain.modeling.model) without DeepSpeed: the document layout computed on the host
    (cu_seqlens from the packer, max_seqlen fixed at seq_len, so one compiled graph serves every batch), each
    Block compiled on its own (regional torch.compile), the loss through the model's own head.
D   Hugging Face `LlamaForCausalLM` of the same shape (zerotrain.modeling.hf `hf_config`), sdpa, each decoder
    layer compiled; Dl the same with liger-kernel's fused RMSNorm, RoPE, SwiGLU and linear cross-entropy.

Both: parameters in bf16 on a GPU (fp32 on the CPU) with fp32 master weights stepped by
`torch.optim.AdamW(fused=True)` (DeepSpeed's bf16 layout, so the comparison with our driver is like for like),
gradient clipping at 1.0, the rows packed by our packer (zerotrain.dataio.format.packing, best-fit) from the documents
the driver reads. Time per step: a CUDA event recorded at the start of every step (and after the last), so the
host's work between steps is in the period; on the CPU, the host clock. `profile_at` (1-based step) runs
`profile_count` steps under torch.profiler and keeps `summarize`'s text. `largest`: the micro-batch is doubled
(one step each) until the device runs out of memory, and the largest that ran is timed.

The result (JSON): status "ok" with the step periods, the losses, the peak memory, the micro-batch timed and the
first step's seconds (compilation); or status "failed: why".
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_MICRO = 1024  # --largest stops doubling here, out of memory or not
BF16_NOTE = "bf16 parameters, fp32 master weights and AdamW states (fused), gradients cast to fp32 before the step"


def documents(path: Path) -> list:
    """The documents of a jsonl file of {"text": ...} as byte-tokenizer token arrays (what the driver reads)."""
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer

    texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    return ByteTokenizer().encode_batch(texts)


def host_batches(docs: list, seq_len: int, micro: int, count: int, pin: bool) -> list[dict]:
    """`count` micro-batches packed best-fit from `docs` (cycled), as CPU tensors (pinned for a GPU), with what
    C needs computed on the host: next-token targets and cu_seqlens."""
    import torch

    from zerotrain.dataio.format.packing import make_packer, to_torch
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer
    from zerotrain.modeling.loss import next_token_targets

    packer = make_packer("best-fit", seq_len, ByteTokenizer.eos_id, micro)
    cursor = [0]

    def next_documents(n_tokens: int) -> list:
        out, filled = [], 0
        while filled < n_tokens:
            doc = docs[cursor[0] % len(docs)]
            cursor[0] += 1
            out.append(doc)
            filled += len(doc) + 1
        return out

    batches = []
    for _ in range(count):
        b = to_torch(packer.next_batch(next_documents))
        b["targets"] = next_token_targets(b["labels"])
        b = {k: (v.pin_memory() if pin else v) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
        batches.append(b)
    return batches


class Loop:
    """One program's model, optimizer and step (see the module docstring)."""

    def __init__(self, spec: dict):
        import torch

        from zerotrain.modeling.sizes import ModelArgs

        self.spec, self.device = spec, torch.device(spec["device"])
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.args = ModelArgs(**spec["model_args"])
        torch.manual_seed(spec.get("seed", 0))
        self.model = self.build_c() if spec["program"] == "C" else self.build_d(spec["program"] == "Dl")
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if self.dtype == torch.float32:
            self.master = self.params
        else:
            self.master = [p.detach().float().requires_grad_() for p in self.params]
            for m in self.master:
                m.grad = torch.zeros_like(m)
        hp = spec["optimizer"]
        self.opt = torch.optim.AdamW(self.master, lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"],
                                     weight_decay=hp["weight_decay"], fused=True)
        self.clip = spec.get("gradient_clipping", 1.0)

    def build_c(self):
        import torch

        from zerotrain.modeling.model import Transformer

        with self.device:
            model = Transformer(self.args).to(self.dtype)
        model.attention = self.spec["attention"]
        if self.spec["compile"]:
            for block in model.layers:
                block.compile()
        return model

    def build_d(self, liger: bool):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from zerotrain.modeling.hf import hf_config

        if liger:
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama(rms_norm=True, rope=True, swiglu=True, fused_linear_cross_entropy=True,
                                        cross_entropy=False)
        cfg = LlamaConfig.from_dict({**hf_config(self.args), "use_cache": False, "attn_implementation": "sdpa",
                                     "dtype": str(self.dtype).removeprefix("torch.")})
        with self.device:
            model = LlamaForCausalLM(cfg).to(self.dtype)
        if self.spec["compile"]:
            for layer in model.model.layers:
                layer.compile()
        return model

    def to_device(self, b: dict) -> dict:
        import torch

        from zerotrain.modeling.model import DocumentLayout

        out = {k: v.to(self.device, non_blocking=True) for k, v in b.items() if isinstance(v, torch.Tensor)}
        if self.spec["program"] == "C":
            if self.spec["attention"] == "varlen":
                # the layout from the host: no nonzero() or max() on the device, and max_seqlen fixed at the row
                # length (an upper bound is all the flash kernel needs), so the compiled blocks never recompile on it
                out["docs"] = DocumentLayout("varlen", cu_seqlens=out["cu_seqlens"], max_seqlen=self.spec["seq_len"])
            else:  # sdpa (the CPU smoke): the mask built from the host's positions
                layout = DocumentLayout.from_positions(b["position_ids"], "sdpa")
                out["docs"] = layout._replace(mask=None if layout.mask is None else layout.mask.to(self.device))
        return out

    def loss(self, b: dict):
        if self.spec["program"] != "C":
            return self.model(input_ids=b["input_ids"], position_ids=b["position_ids"], labels=b["labels"]).loss
        from zerotrain.modeling.model import rotary_cos_sin

        m = self.model
        x = m.embed_tokens(b["input_ids"])  # (B, T, dim)
        cos, sin = rotary_cos_sin(b["position_ids"], self.args.head_dim, self.args.rope_theta, x.dtype)
        for layer in m.layers:
            x = layer(x, cos, sin, b["docs"])
        return m.lm_head(m.norm(x), b["targets"])

    def step(self, batches: list[dict]):
        """One optimizer step over the micro-batches (on the host); returns the mean loss, a device tensor."""
        import torch

        total = None
        for b in batches:
            loss = self.loss(self.to_device(b)) / len(batches)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        if self.master is not self.params:
            torch._foreach_copy_([m.grad for m in self.master], [p.grad for p in self.params])  # bf16 -> fp32
        torch.nn.utils.clip_grad_norm_(self.master, self.clip, foreach=True)
        self.opt.step()
        if self.master is not self.params:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)  # fp32 -> bf16
            self.model.zero_grad(set_to_none=True)
        else:
            self.opt.zero_grad(set_to_none=True)
        return total

    def sync(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()


def largest_micro(loop: Loop, docs: list, micro: int, accum: int) -> int:
    """Double the micro-batch (one step each) until the device runs out of memory; the largest that ran."""
    import torch

    best = micro
    while best * 2 <= MAX_MICRO:
        try:
            loop.step(host_batches(docs, loop.spec["seq_len"], best * 2, accum, False))
            loop.sync()
        except RuntimeError as e:  # torch.OutOfMemoryError, or the same met while compiling for the new shape
            if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in str(e):
                raise
            break
        finally:
            loop.model.zero_grad(set_to_none=True)
            if loop.cuda:
                torch.cuda.empty_cache()
        best *= 2
    return best


def run(spec: dict) -> dict:
    import torch

    from zerotrain.launcher.components.observe.torch_profile import summarize

    loop = Loop(spec)
    docs = documents(Path(spec["docs_file"]))
    micro, accum, steps = spec["micro"], spec["accum"], spec["steps"]
    if spec.get("largest"):
        micro = largest_micro(loop, docs, micro, accum)
    batches = host_batches(docs, spec["seq_len"], micro, steps * accum, loop.cuda)
    if loop.cuda:
        torch.cuda.reset_peak_memory_stats()
    first = spec.get("profile_at") or 0
    last = first + spec.get("profile_count", 3) - 1

    def mark():  # a step boundary: a CUDA event in the stream (host gaps between steps count), else the clock
        if not loop.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    marks, losses, profile, prof, first_step_s = [], [], None, None, None
    for i in range(1, steps + 1):
        if i == first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            activities += [torch.profiler.ProfilerActivity.CUDA] if loop.cuda else []
            prof = torch.profiler.profile(activities=activities)
            prof.__enter__()
        marks.append(mark())
        t0 = time.perf_counter()
        losses.append(loop.step(batches[(i - 1) * accum:i * accum]))
        if i == 1:  # compilation happens here: its time is said, once
            loop.sync()
            first_step_s = time.perf_counter() - t0
        if i == last and prof is not None:
            loop.sync()
            prof.__exit__(None, None, None)
            profile = summarize(prof, steps=spec.get("profile_count", 3))
    marks.append(mark())
    loop.sync()
    periods = [a.elapsed_time(b) / 1e3 if loop.cuda else b - a for a, b in zip(marks, marks[1:])]
    result = {"status": "ok", "periods_s": periods, "losses": [float(x) for x in losses], "micro": micro,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if loop.cuda else None,
              "first_step_s": first_step_s, "profile": profile}
    if spec["program"] != "C":  # whether this transformers masks packed documents (found from position_ids)
        from transformers import masking_utils

        result["masks_documents"] = hasattr(masking_utils, "find_packed_sequence_indices")
    return result


def main(argv: list[str]) -> int:
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    try:
        result = run(spec)
    except Exception as e:  # the row says why; the traceback goes to this run's log
        traceback.print_exc()
        oom = type(e).__name__ == "OutOfMemoryError"
        result = {"status": f"failed: {'out of memory' if oom else type(e).__name__}: {' '.join(str(e).split())[:200]}"}
    result_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
