"""The plan `zerotrain plan` prints (`make_plan`: one JSON-ready dict, keys documented in docs/planning.md), its
one-line verdict, and its lines (`render`, `render_offload`, `render_sequence`; the start-up and --dry-run print the
offload lines too)."""
from __future__ import annotations

from zerotrain.launcher.planning.alternatives import alternatives
from zerotrain.launcher.planning.budget import CHINCHILLA_TOKENS_PER_PARAM, budget
from zerotrain.launcher.planning.hardware import Setup
from zerotrain.launcher.planning.host import host_need, host_verdict, offload_devices, offload_summary
from zerotrain.launcher.planning.memory import OFFLOAD, STAGE_LABELS, STAGES, max_micro_batch, memory
from zerotrain.launcher.planning.sequence import sequence_summary
from zerotrain.launcher.planning.units import GiB, count_text, gib, size_text
from zerotrain.modeling.sizes import count_params, flops_per_token


def make_plan(args, setup: Setup, stage: int, micro: int, accum: int, seq_len: int, checkpointing: bool,
              peak_flops: float | None = None, mfu: float | None = None, total_tokens: int | None = None,
              max_hours: float | None = None, budget_usd: float | None = None, gpu_hour_usd: float | None = None,
              max_steps: int | None = None, tokens_set_length: bool = False) -> dict:
    """Everything `zerotrain plan` prints, as one JSON-ready dict (keys documented in docs/planning.md).
    `tokens_set_length`: --total-tokens sets the run's length (launcher/hparams.py), its last step whole."""
    counts = count_params(args)
    fpt = flops_per_token(args, seq_len)
    per_stage = stage_rows(args, setup, micro, seq_len, checkpointing)
    chosen = per_stage[stage if stage in OFFLOAD else f"zero{stage}"]
    tokens_per_step = micro * accum * (setup.world // setup.sequence_parallel) * seq_len  # N ranks share a row
    plan = {
        "model": {"layers": args.n_layers, "dim": args.dim, "heads": args.n_heads, "kv_heads": args.n_kv_heads,
                  "ffn_hidden": args.ffn_hidden, "vocab_size": args.vocab_size, "tie_embeddings": args.tie_embeddings},
        "params_total": counts["total"], "params_non_embedding": counts["non_embedding"],
        "flops_per_token": fpt,
        "hardware": {"accelerator": setup.accelerator, "gpus_per_node": setup.gpus_per_node, "nodes": setup.nodes,
                     "world": setup.world, "device_memory_gib": gib(setup.device_bytes),
                     "peak_flops_per_device": peak_flops},
        "precision": "bf16/fp16 mixed" if setup.mixed else "fp32", "attention": setup.kernel,
        "zero_stage": stage, "activation_checkpointing": checkpointing, "seq_len": seq_len, "micro_batch": micro,
        "memory": per_stage, "memory_per_gpu_gib": chosen["total_gib"], "fits": chosen["fits"],
        "headroom_gib": round(gib(setup.device_bytes) - chosen["total_gib"], 2),
        "max_micro_batch": chosen["max_micro_batch"], "grad_accum": accum, "tokens_per_step": tokens_per_step,
    }
    plan["would_fit"] = [] if chosen["fits"] else alternatives(args, setup, int(stage[4]) if stage in OFFLOAD else stage,
                                                               micro, seq_len, checkpointing)
    for name, s in zip(per_stage, (*STAGES, *OFFLOAD)):  # the offload rows' host memory per node, and the chosen's
        if s in OFFLOAD or (s == stage and offload_devices(s, setup.zero)):
            per_stage[name]["host_per_node_gib"] = gib(host_need(args, setup, s, micro, seq_len, checkpointing,
                                                                  accum)[1])
    plan.update(offload_summary(args, setup, stage, micro, seq_len, checkpointing, accum))
    plan["sequence_parallel"] = sequence_summary(args, setup, stage, micro, seq_len, checkpointing, accum)
    plan.update(budget(counts["total"], fpt, tokens_per_step, setup.world, peak_flops, mfu, total_tokens,
                       max_hours, budget_usd, gpu_hour_usd, max_steps, tokens_set_length,
                       (plan["offload_traffic"]["seconds_per_step"] or 0.0)
                       + (plan["sequence_parallel"]["all_to_all"]["seconds_per_step"] or 0.0)))
    plan["verdict"] = verdict(plan)
    return plan


def stage_rows(args, setup: Setup, micro: int, seq_len: int, checkpointing: bool) -> dict[str, dict]:
    """The plan's `memory`: per ZeRO stage and offload variant, GiB per rank by component, whether it fits and
    the largest micro-batch that would."""
    rows = {}
    for s in (*STAGES, *OFFLOAD):
        m = memory(args, setup, s, micro, seq_len, checkpointing)
        rows[f"zero{s}" if isinstance(s, int) else s] = {
            **{f"{k}_gib": gib(v) for k, v in m.as_dict().items()}, "fits": m.total <= setup.device_bytes,
            "max_micro_batch": max_micro_batch(args, setup, s, seq_len, checkpointing)}
    return rows


def verdict(plan: dict) -> str:
    """One line: fits (with headroom) or not (by how much, and what would); an offloaded run that fits its
    devices but not its host says that."""
    hw = plan["hardware"]
    host = plan.get("host_memory") or {}
    if plan["fits"] and not host.get("fits", True):
        return host_verdict(host["per_node_gib"] * GiB, host["host_memory_gib"] * GiB,
                            "a node (zerotrain.hardware.host_memory_gib)")
    unit = "rank" if hw["accelerator"] == "cpu" else "GPU"
    stage = STAGE_LABELS.get(plan["zero_stage"], plan["zero_stage"])
    where = f"ZeRO-{stage}{' + activation checkpointing' if plan['activation_checkpointing'] else ''}," \
            f" micro-batch {plan['micro_batch']} x {plan['seq_len']}, {hw['world']} x {size_text(hw['device_memory_gib'])}"
    need = plan["memory_per_gpu_gib"]
    if plan["fits"]:
        return f"fits: {size_text(need)} per {unit} ({where}), headroom {size_text(plan['headroom_gib'])}, largest" \
               f" micro-batch {plan['max_micro_batch']}"
    alts = "; ".join(f"{a['change']} ({size_text(a['memory_per_gpu_gib'])})" for a in plan["would_fit"][:4])
    return f"does not fit: needs {size_text(need)} per {unit} ({where}), short by {size_text(-plan['headroom_gib'])}; " + \
        (f"would fit: {alts}" if alts else "nothing tried fits: a smaller model")


def render(plan: dict) -> str:
    """The plan as the table `zerotrain plan` prints."""
    m, hw = plan["model"], plan["hardware"]
    lines = [f"model: {m['layers']} layers x {m['dim']} (heads {m['heads']}, kv {m['kv_heads']}, ffn {m['ffn_hidden']},"
             f" vocab {m['vocab_size']}): {plan['params_total']:,} params ({plan['params_non_embedding']:,}"
             f" non-embedding), {plan['flops_per_token']:.3e} training FLOPs/token at seq {plan['seq_len']}",
             f"hardware: {hw['world']} x {hw['accelerator']} ({hw['nodes']} node(s)), {hw['device_memory_gib']} GiB"
             f" each, {plan['precision']}, attention {plan['attention']}; batch {plan['micro_batch']} x"
             f" {plan['grad_accum']} x {hw['world'] // plan['sequence_parallel']['size']} x"
             f" {plan['seq_len']} = {plan['tokens_per_step']:,} tokens/step", "",
             "| ZeRO | model states | buffers | activations | context | fragm. | total GiB | fits | max micro |",
             "|---|---|---|---|---|---|---|---|---|"]
    ac = " + AC" if plan["activation_checkpointing"] else ""
    for name, r in plan["memory"].items():
        label = STAGE_LABELS.get(
            name, name[4:]) + ac + (" (chosen)" if name in (plan["zero_stage"], f"zero{plan['zero_stage']}") else "")
        lines.append(f"| {label} | {r['model_states_gib']} | {r['buffers_gib']} | {r['activations_gib']} |"
                     f" {r['context_gib']} | {r['fragmentation_gib']} | {r['total_gib']} |"
                     f" {'yes' if r['fits'] else 'no'} | {r['max_micro_batch']} |")
    lines += [""] + render_offload(plan) + render_sequence(plan) + [""]
    if plan["hours"] is not None:
        usd = f", ${plan['usd']:,.0f}" if plan["usd"] is not None else ""
        extra = {what: seconds for what, seconds in (
            ("offload traffic", (plan.get("offload_traffic") or {}).get("seconds_per_step")),
            ("all-to-all", (plan.get("sequence_parallel") or {}).get("all_to_all", {}).get("seconds_per_step")))
            if seconds}
        traffic = " with " + " and ".join(f"{v:.3g} s per step of {k}" for k, v in extra.items()) if extra else ""
        lines.append(f"time: {plan['steps']:,} steps = {plan['tokens']:,} tokens ({plan['binding']} binds) at MFU"
                     f" {plan['mfu']} of {hw['peak_flops_per_device']:.3g} FLOP/s per device ="
                     f" {plan['tokens_per_s']:,.0f} tokens/s{traffic}: {plan['hours']:,} h{usd}")
    else:
        lines.append(f"time: {plan['steps']:,} steps = {plan['tokens']:,} tokens (no peak FLOP/s: give a --profile or"
                     " --peak-tflops for hours and dollars)")
    co = plan["compute_optimal"]
    lines.append(f"tokens per parameter: {plan['tokens_per_param']} (Chinchilla ~{CHINCHILLA_TOKENS_PER_PARAM});"
                 f" compute-optimal for C = 6ND = {co['flops']:.3g} FLOPs: {count_text(co['params'])} params on"
                 f" {count_text(co['tokens'])} tokens")
    lines.append(plan["verdict"])
    return "\n".join(lines)


def render_sequence(plan: dict) -> list[str]:
    """The sequence-parallel lines: N, the all-to-all per layer and per step over the slowest link the group
    spans, and the longest row that fits at micro-batch 1."""
    sp = plan.get("sequence_parallel")
    if not sp:
        return []
    a, n = sp["all_to_all"], sp["size"]
    valid = ", ".join(map(str, sp["valid_sizes"]))
    if n == 1:
        lines = [f"sequence parallel: off (--sequence-parallel N; for this model, world and row N may be {valid})"]
    else:
        recompute = " and the recomputation" if plan["activation_checkpointing"] else ""
        when = (f"at {a['link_gb_s']:g} GB/s {a['link']}: {a['seconds_per_layer'] * 1e3:.3g} ms per layer,"
                f" {a['seconds_per_step']:.3g} s per step, not overlapped (an upper bound), in the time below"
                if a["link_gb_s"] is not None else f"{a['link']}: no bandwidth in the profile, not in the time")
        unit = "rank" if plan["hardware"]["accelerator"] == "cpu" else "GPU"
        lines = [f"sequence parallel: {n} ranks per row (N may be {valid}); all-to-all per {unit} per layer:"
                 f" {a['gb_per_layer_forward']:g} GB forward (q, k, v, output; (N-1)/N of each), {a['gb_per_layer']:g}"
                 f" GB with the backward{recompute}; {a['gb_per_step_per_gpu']:g} GB per step {when}"]
    stage = STAGE_LABELS.get(plan["zero_stage"], plan["zero_stage"])
    lines.append(f"longest row that fits at micro-batch 1 (ZeRO-{stage}, {plan['attention']}, N = {n}):"
                 f" {sp['max_seq_len']:,} positions" + ("" if plan["activation_checkpointing"] else
                                                        f", {sp['max_seq_len_with_ac']:,} with activation checkpointing"))
    return lines


def render_offload(plan: dict, rows: bool = True) -> list[str]:
    """The host-memory and host-link lines: with `rows` (`zerotrain plan`) each offload row's host memory per
    node first; for an offloaded run its components and traffic (--dry-run and the start-up too)."""
    h, t = plan["host_memory"], plan["offload_traffic"]
    of = f" of {size_text(h['host_memory_gib'])}" if h["host_memory_gib"] is not None else \
        " (host size unknown: zerotrain.hardware.host_memory_gib)"
    lines = []
    if rows:
        per_row = {STAGE_LABELS.get(name) or f"{name[4:]} + {' + '.join(h['offloaded'])} offload":
                   r["host_per_node_gib"] for name, r in plan["memory"].items() if "host_per_node_gib" in r}
        lines.append("host memory per node, offload rows: "
                     + "; ".join(f"ZeRO-{k} {size_text(v)}" for k, v in per_row.items()) + of)
    if h["offloaded"]:
        where = ", ".join(f"{what} -> {device}" for what, device in h["offloaded"].items())
        lines.append(f"host memory (offload: {where}): {size_text(h['per_node_gib'])} per node{of}"
                     f" (optimizer {h['optimizer_gib']}, gradients {h['gradients_gib']}, parameters"
                     f" {h['parameters_gib']}, buffers {h['buffers_gib']}, ranks' own {h['processes_gib']} GiB"
                     + (", the ranks' device memory: the same RAM" if plan["hardware"]["accelerator"] == "cpu" else "")
                     + ")" + ("" if h["fits"] else ": does not fit"))
        if plan["hardware"]["accelerator"] == "cpu":
            lines.append("offload traffic: none over a bus on a CPU node (host and device are the same RAM); the"
                         " time below is the compute's")
        else:
            link = (f"at {t['host_link_gb_s']:g} GB/s (zerotrain.hardware.host_link_gb_s):"
                    f" +{t['seconds_per_step']:.3g} s per step, not overlapped (an upper bound), in the time below"
                    if t["host_link_gb_s"] is not None else
                    "(no host link bandwidth in the profile: zerotrain.hardware.host_link_gb_s; not in the time)")
            lines.append(f"offload traffic: {t['gb_per_step_per_gpu']:g} GB per step per GPU over its host link"
                         f" {link}; CPU Adam's time and NVMe I/O not counted")
    return lines
