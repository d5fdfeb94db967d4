"""benchmarks/run.py: its command line (unknown names, a missing optional baseline) and a smoke run of
entries at BENCH_TINY sizes. Nothing here asserts a timing: `make bench` measures, tests only check
that each entry runs and prints its rows.

Not run here: two_ranks, startup, bf16_step, offload_step, sequence_parallel, planner_rss and local_source_memory
(real 2-rank launches and a generated source, minutes of work; `make bench` runs them) and the loader entries (dataio's own tests
cover the loader; they share `loader_rows` with packing_baselines' path through
zerotrain.dataio.pipeline.commands.bench).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def bench(args, tmp_path, **env):
    return subprocess.run([sys.executable, "benchmarks/run.py", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=600, env={**os.environ, "BENCH_TINY": "1", "OMP_NUM_THREADS": "1",
                                            "ZEROTRAIN_CACHE": str(tmp_path / "cache"), **env})


def table(stdout: str) -> dict[str, str]:
    """benchmark -> result, from the printed table."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 5 and cells[0] != "benchmark":
            rows[cells[0]] = cells[2]
    return rows


@pytest.mark.launches
def test_unknown_name_is_one_line_and_exit_2_before_anything_runs(tmp_path):
    r = bench(["shard_verify", "trainstep"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "benchmarks/run.py: unknown benchmark 'trainstep'; known: train_step, two_ranks, startup, init_from, shard_verify,"
        " checkpoint, packing_baselines, fused_projections, loss_memory, bf16_step, offload_step, sequence_parallel,"
        " stream_bytes, shards, stream_bpe, prepare_verify, packing, local_source_memory, planner_rss"]


@pytest.mark.launches
def test_missing_baseline_names_what_to_install_and_the_rest_runs(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "trl.py").write_text("raise ImportError('trl hidden by tests/test_benchmarks.py')\n")
    r = bench(["shard_verify", "packing_baselines", "fused_projections", "loss_memory", "init_from"], tmp_path,
              PYTHONPATH=str(hide))
    assert r.returncode == 0, r.stderr[-3000:]
    missing = [ln for ln in r.stderr.splitlines() if "trl" in ln and not ln.startswith("|")]  # not the tables
    assert missing == ["benchmark packing_baselines: TRL baseline skipped: needs `trl`: pip install -e .[bench]"
                       "  (or: pip install trl)"]
    rows = table(r.stdout)
    assert rows["packing: TRL pack_dataset"].startswith("not run: needs `trl`")
    for name in ("packing: ours: prepared shards (uint16), best-fit", "packing: ours: mix text, bytes tokenizer,"
                 " best-fit", "packing: datasets.map concatenate-and-chunk (run_clm)"):
        assert "tokens/s" in rows[name] and "efficiency" in rows[name], rows
    # the fused model computes the same loss as ours (same weights, concatenated)
    for shape in ("debug",):
        got = rows[f"fused projections ({shape})"]
        first = got.split("(first loss ")[1].rstrip(")").split(" vs ")
        assert first[0] == first[1] and "ms/step" in got, got
    # the chunked loss is the full-logits loss, in less memory
    full, chunked = rows["loss memory: full logits (before)"], rows["loss memory: chunked (LMHead)"]
    assert float(chunked.split("(relative difference ")[1].rstrip(")")) <= 1e-6, chunked
    assert float(chunked.split("peak RSS ")[1].split()[0]) < float(full.split("peak RSS ")[1].split()[0])
    # quick verification: the first start hashes every shard, a later one none (file identity cached)
    first, later = rows["shard verify: quick, first start on this node (cold)"], rows["shard verify: quick, later start (cold)"]
    n = first.split(", ")[1].split(" of ")[1].split()[0]
    assert f"{n} of {n} shards hashed" in first and f"0 of {n} shards hashed" in later
    assert "shards hashed per rank [0, " in rows["shard verify: 2 ranks of a node, quick, first start"] or \
        rows["shard verify: 2 ranks of a node, quick, first start"].endswith(f"[{n}, 0]")
    # --init-from's model: the same weights whether the initial ones are drawn first or not
    for label in ("initial weights drawn, then loaded over (until 2026-11-29)",
                  "initial weights not drawn (weights_loaded_after), loaded"):
        assert rows[f"init-from: {label}"].endswith("; same loaded weights"), rows


def gpu_bench(*args):
    return subprocess.run([sys.executable, "benchmarks/gpu.py", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


@pytest.mark.launches
def test_gpu_benchmark_arguments_are_checked_before_anything_runs():
    for args, says in ((["--nproc", "0"], "--nproc must be at least 1, got 0"),
                       (["--grad-accum", "0"], "--grad-accum must be at least 1, got 0"),
                       (["--steps", "5"], "--steps must be at least 11, got 5"),
                       (["--model", "debug", "--vocab-size", "100"], "--vocab-size must be 0 (bytes) or at least 259, got 100"),
                       (["--model", "debug", "--stages", "2,1"], "--stages '2,1': '1' is not one of 2, 3"),
                       (["--model", "debug", "--attention", "flash"],
                        "--attention 'flash': 'flash' is not one of sdpa, flex, varlen"),
                       (["--model", "debug", "--recipes", "all"],
                        "--recipes and --model: choose one (a recipe names its own model)"),
                       (["--seq-len", "512"],
                        "--seq-len is for --model runs; a recipe brings its own shape, stage and attention"),
                       (["--recipes", "rtx6000ada-x2-1.3b,nope"], "--recipes rtx6000ada-x2-1.3b,nope: 'nope' is not"
                        " a shipped recipe (a100x8-1.46b-edu-mix, a100x8-13b-offload, cpu-debug, h100pcie-x8-1000usd,"
                        " h100pcie-x8-1000usd-optimal, h100x8-xlarge-32k-extend, rtx6000ada-x2-1.3b,"
                        " rtx6000ada-x2-760m, rtx6000ada-x2-7b-offload)"),
                       (["--recipes", "h100x8-xlarge-32k-extend"], "--recipes h100x8-xlarge-32k-extend:"
                        " 'h100x8-xlarge-32k-extend' starts from --init-from: its model is that directory's, not"
                        " run here")):
        proc = gpu_bench(*args)
        assert proc.returncode == 2 and proc.stderr.strip() == f"benchmarks/gpu.py: {says}", (args, proc.stderr)
    for fine in (gpu_bench("--vocab-size", "128256", "--nproc", "2", "--grad-accum", "4", "--model", "debug"),
                 gpu_bench(), gpu_bench("--recipes", "rtx6000ada-x2-760m", "--grad-accum", "2")):
        assert fine.returncode == 0 and fine.stdout.startswith("benchmarks/gpu.py: no CUDA device"), fine.stderr
        assert len(fine.stdout.splitlines()) == 1


def test_make_bench_gpu_runs_every_gpu_recipes_shape_planned_as_the_driver_would(tmp_path, monkeypatch):
    """By default the benchmark runs each shipped recipe on a GPU profile (not the CPU one, not those offloading
    to the host): its model, seq len, vocabulary, micro-batch and its profile's stage, precision, checkpointing and
    optimizer, with this GPU's peak FLOP/s. Planned here through the driver's own plan_run (dry run) and the
    planner's fit for an 80 GB GPU; only the measurement (a CUDA run) is replaced."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu
    from harness import demo_mix

    from zerotrain.launcher.config import load_recipe
    from zerotrain.launcher.profiles import load_profile

    a = gpu.parse(["--out", str(tmp_path)])
    assert a.recipes == ["a100x8-1.46b-edu-mix", "h100pcie-x8-1000usd-optimal", "h100pcie-x8-1000usd",
                         "rtx6000ada-x2-1.3b", "rtx6000ada-x2-760m"]
    measured = []
    monkeypatch.setattr(gpu, "measure", lambda values, micro, out, nproc=1: measured.append((values, micro)) or {
        "tokens_per_s": 1.0, "mfu": None, "peak_gib": 1.0, "loss": 3.0, "last_step": 50})
    here, profile = load_profile("h100-80g-x8")
    common = {"data": str(demo_mix()), "max_steps": 50, "warmup_steps": 10, "out": str(tmp_path), "resume": "never"}
    rows = {}
    for row, prof, values in gpu.recipe_configs(a, here, profile, tmp_path):
        recipe = load_recipe(row["recipe"])
        own = load_profile(recipe["profile"])[1]
        assert prof["zero_optimization"] == own["zero_optimization"] and prof.get("bf16") == own.get("bf16")
        assert prof["zerotrain"]["peak_flops_per_device"] == profile["zerotrain"]["peak_flops_per_device"]
        assert {k: values[k] for k in ("seq_len", "micro_batch")} == {k: recipe[k] for k in ("seq_len", "micro_batch")}
        (tmp_path / "p.json").write_text(__import__("json").dumps(prof))
        row.update(gpu.run_one({**common, **values, "profile": str(tmp_path / "p.json")}, 80 * 2**30, tmp_path, 1))
        rows[row["recipe"]] = row
    assert rows["rtx6000ada-x2-1.3b"]["vocab"] == "128,256" and rows["rtx6000ada-x2-1.3b"]["micro"] == 4
    assert rows["rtx6000ada-x2-1.3b"]["kernel"] == "varlen" and rows["rtx6000ada-x2-1.3b"]["stage"] == 3
    assert rows["a100x8-1.46b-edu-mix"]["vocab"] == "bytes (320)" and rows["a100x8-1.46b-edu-mix"]["micro"] == 16
    assert rows["h100pcie-x8-1000usd"]["result"].startswith("not run: the planner fits no row")  # 12.9B on one GPU
    ran = {v["run_id"]: (v, micro) for v, micro in measured}
    assert set(ran) == set(rows) - {"h100pcie-x8-1000usd"}
    values, micro = ran["rtx6000ada-x2-760m"]
    assert values["model"] == "ws-760m" and values["optimizer"] == "muon" and values["activation_checkpointing"]
    from zerotrain.dataio.sources.tokenizer import load_tokenizer

    assert load_tokenizer(values["tokenizer"]).vocab_size == 128256 and micro == 8


def test_gpu_benchmarks_sized_tokenizer_gives_the_model_that_vocabulary(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu import sized_tokenizer

    from zerotrain.dataio.sources.tokenizer import load_tokenizer

    tok = load_tokenizer(str(sized_tokenizer(128256, tmp_path / "tok")))
    assert tok.vocab_size == 128256 and tok.eos_id is not None
    text = "packed rows, héllo ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < 258 + 2  # bytes and specials only: the rest is the head's size


def gpu_peers(*args, timeout=300):
    # OMP_NUM_THREADS=1: every program's process alike on the shared 2-core machine
    return subprocess.run([sys.executable, "benchmarks/gpu_peers.py", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.launches
def test_gpu_peers_arguments_are_checked_and_without_cuda_nothing_runs():
    for args, says in ((["--programs", "A,X"], "--programs: 'X' is not one of A, B, Bz, C, D, Dl, E"),
                       (["--steps", "9"], "--steps must be at least 10, got 9"),
                       (["--grad-accum", "1,x"], "--grad-accum '1,x': whole numbers, comma-separated"),
                       (["--vocab-size", "100"], "--vocab-size must be 0 (bytes) or at least 259, got 100"),
                       (["--model", "huge"], "--model 'huge' is not a preset (debug, tiny, small, medium,"
                                             " medium-large, large, xlarge, ws-760m, ws-1.3b)")):
        proc = gpu_peers(*args)
        assert proc.returncode == 2 and proc.stderr.strip() == f"benchmarks/gpu_peers.py: {says}", (args, proc.stderr)
    proc = gpu_peers("--docs", "both", "--largest", "--grad-accum", "1,8")
    assert proc.returncode == 0 and proc.stdout == "benchmarks/gpu_peers.py: no CUDA device; nothing run\n", proc.stderr


def test_gpu_peers_interleaves_every_program_once_a_round_every_other_round_reversed():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_peers import interleaved

    assert interleaved(["A", "B", "C"], 3) == [(1, "A"), (1, "B"), (1, "C"), (2, "C"), (2, "B"), (2, "A"),
                                                (3, "A"), (3, "B"), (3, "C")]


@pytest.mark.launches
def test_gpu_peers_smoke_runs_the_driver_old_and_new_a_plain_loop_and_hf_llama_on_the_same_documents(tmp_path):
    """`--smoke`: the debug model on the CPU, through the real driver (A: the cpu profile as of 72584b6 at ZeRO-2;
    B: the shipped one), our Transformer in a plain loop (C) and transformers' LlamaForCausalLM (D)."""
    import json
    import math

    proc = gpu_peers("--smoke", "--out", str(tmp_path), "--b-zero", '{"overlap_comm": false}')
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "gpu_peers.json").read_text())["rows"]
    assert [(r["round"], r["program"]) for r in rows] == [(1, p) for p in ("A", "B", "Bz", "C", "D", "Dl", "E")]
    for r in rows[:5]:
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and 0 < r["mfu_6n"] < r["mfu"], r
        assert math.isfinite(r["loss"]) and 0 < r["loss"] < math.log(320) + 1, r  # trained from ~ln(vocabulary)
        assert r["micro"] == 2 and r["accum"] == 1 and r["docs"] == "packed" and r["steps_timed"] == 3, r
    assert [r.get("planned_gib", "none") for r in rows[:4]] == [None, None, None, "none"]  # drivers: n/a on a CPU
    assert rows[5]["status"] == "not run: liger-kernel's kernels are Triton (CUDA only)"
    assert rows[6]["status"].startswith("not run: ")
    table = (tmp_path / "gpu_peers.md").read_text()
    assert sum(line.startswith("| 1 | ") for line in table.splitlines()) == 7 and table in proc.stdout
    assert "- packed docs, same micro-batch, accum 1: B/A " in table and "- D on packed documents: " in table
    assert 'Bz: B with zero_optimization {"overlap_comm": false}' in table
    profiles = (tmp_path / "profiles.txt").read_text()
    assert "==== C-packed-same-accum1-r1\nno device activity recorded: top 15 " in profiles
    assert "host syncs over 3 step(s): " in profiles
    assert (tmp_path / "runs.log").read_text().count("==== ") == 5


@pytest.mark.launches
def test_gpu_peers_starts_no_run_that_would_end_past_the_budget(tmp_path):
    import json

    # --vocab-size: the model's vocabulary through a tokenizer of that size (the 128k recipe shape on a GPU)
    proc = gpu_peers("--smoke", "--programs", "C,D,E", "--budget-s", "1", "--vocab-size", "448", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "gpu_peers.json").read_text())["rows"]
    assert [r["program"] for r in rows] == ["C", "D", "E"] and rows[0]["status"] == "ok"
    assert "vocabulary 448) at seq 128" in (tmp_path / "gpu_peers.md").read_text()
    assert rows[1]["status"].startswith("not run: budget (expected "), rows[1]


def test_gpu_peers_runs_a_at_its_own_fit_where_the_shared_micro_batch_does_not_fit_and_compares_like_with_like(
        tmp_path):
    """On an 80 GB H100 (2026-11-28) A's planner (the old profile, eager) refused xlarge at B's micro-batch 8:
    A now runs at the most it fits, and B/A is said only where both ran the same micro-batch."""
    import json

    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu
    from gpu_peers import OLD_PROFILES, driver_micro, mix_file, plan_error, planned_gib, ratios, write_documents

    prof = tmp_path / "A.profile.json"
    prof.write_text(json.dumps(gpu.staged_profile(json.loads(OLD_PROFILES["gpu"].read_text()), 2)))
    docs = write_documents(tmp_path / "docs.jsonl", "packed", 2048, 2**16)
    values = {"model": "xlarge", "seq_len": 2048, "profile": str(prof), "resume": "never", "max_steps": 20,
              "out": str(tmp_path / "runs"), "data": str(mix_file(docs)), "attention": "varlen", "compile": False}
    h100 = 79.18 * 2**30
    assert 0 < driver_micro("A", values, 8, "same", h100) < 8
    assert driver_micro("A", values, 4, "same", h100) == 4  # it fits: the shared one
    assert driver_micro("B", values, 8, "same", h100) == 8  # only A is lowered
    assert driver_micro("A", values, 8, "same", None) == 8  # no GPU (the smoke run): as given
    # the planner's prediction beside each driver row's peak, at the row's own micro-batch (aim: within +-10%)
    b_values = {**values, "profile": "h100-80g-x8"}
    b_values.pop("compile"), b_values.pop("attention")
    planned = {m: planned_gib(b_values, m, h100) for m in (6, 8)}
    assert 0 < planned[6] < planned[8] == gpu.plan_micro(b_values, h100)["planned_tensors"]  # B's own micro: 8
    assert planned_gib(b_values, 6, None) is None  # no GPU
    assert plan_error(46.95, 41.8) == "47.0 (+12.3%)" and plan_error(40.0, 41.8) == "40.0 (-4.3%)"
    assert plan_error(46.95, None) == "47.0" and plan_error(None, 41.8) == "n/a"
    row = {"docs": "packed", "sizing": "same", "accum": 1}
    rows = [{**row, "program": "A", "micro": 6, "tokens_per_s": 27801.0},
            {**row, "program": "B", "micro": 8, "tokens_per_s": 48617.0},
            {**row, "program": "C", "micro": 8, "tokens_per_s": 53427.0}]
    assert ratios(rows) == ["- packed docs, same micro-batch, accum 1: B/A n/a (A at micro-batch 6, B at 8),"
                            " B/C 0.910"]


def test_gpu_peers_bz_varies_the_shipped_profile_key_by_key():
    """--b-config merges an object into the shipped profile's object of that key (other keys kept), --b-zero its
    zero_optimization keys over that: what the next GPU call measures against B (e.g. DeepSpeed's BF16_Optimizer,
    stage 1 with fp32 accumulation, against the ZeRO-2 copies of 2026-11-28)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_peers import bz_change, varied_profile

    from zerotrain.launcher.profiles import load_profile

    shipped = load_profile("h100-80g-x8")[1]
    config = {"data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1}, "bf16": {"x": 1}}
    bz = varied_profile(shipped, {"overlap_comm": False}, config)
    assert bz["zero_optimization"] == {**shipped["zero_optimization"], "stage": 1, "overlap_comm": False}
    assert bz["data_types"] == {"grad_accum_dtype": "fp32"} and bz["bf16"] == {**shipped["bf16"], "x": 1}
    assert {k: v for k, v in bz.items() if k not in config} == {k: v for k, v in shipped.items() if k not in config}
    assert varied_profile(shipped, None, None) == shipped and "data_types" not in shipped
    assert bz_change({"overlap_comm": False}, {"bf16": {"x": 1}}) == \
        'zero_optimization {"overlap_comm": false} and {"bf16": {"x": 1}}'


@pytest.mark.launches
def test_step_traffic_counts_what_each_optimizer_wrapper_moves_and_what_trains_the_same():
    """benchmarks/step_traffic.py on a depth-2 model: DeepSpeed's ZeRO-2 step at a world of 1 moves more bytes
    per parameter than the plain loop (its bucket flatten, the all-reduce of 1, the copies back, the fp32
    accumulation), bf16 accumulation at grad-accum 1 moves less than fp32 and trains bit for bit the same."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "step_traffic.py"), "--variants",
                           "plain,zero2,zero2-bf16-accum", "--depth", "2"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in proc.stdout.splitlines()]
    rows = {c[0]: c[1:] for c in cells if len(c) == 5 and c[0] in ("plain", "zero2", "zero2-bf16-accum")}
    plain, fp32, bf16 = (float(rows[n][1]) for n in ("plain", "zero2", "zero2-bf16-accum"))
    assert plain < bf16 < fp32
    assert rows["zero2"][3] == rows["zero2-bf16-accum"][3]  # the same losses, printed to 9 digits
    assert "| add_ |" in proc.stdout  # the fp32 accumulation's pass, in the by-op table
