"""benchmarks/run.py: its command line (unknown names, a missing optional baseline) and a smoke run of
entries at BENCH_TINY sizes. Nothing here asserts a timing: `make bench` measures, tests only check
that each entry runs and prints its rows.

Not run here: two_ranks, startup, bf16_step, planner_rss and local_source_memory (real 2-rank launches and a
generated source, minutes of work; `make bench` runs them) and the loader entries (dataio's own tests
cover the loader; they share `loader_rows` with packing_baselines' path through zerotrain.dataio.commands.bench).
"""
import os
import subprocess
import sys
from pathlib import Path

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


def test_unknown_name_is_one_line_and_exit_2_before_anything_runs(tmp_path):
    r = bench(["shard_verify", "trainstep"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "benchmarks/run.py: unknown benchmark 'trainstep'; known: train_step, two_ranks, startup, shard_verify,"
        " checkpoint, packing_baselines, fused_projections, loss_memory, bf16_step, stream_bytes, shards, stream_bpe,"
        " prepare_verify, packing, local_source_memory, planner_rss"]


def test_missing_baseline_names_what_to_install_and_the_rest_runs(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "trl.py").write_text("raise ImportError('trl hidden by tests/test_benchmarks.py')\n")
    r = bench(["shard_verify", "packing_baselines", "fused_projections", "loss_memory"], tmp_path,
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


def gpu_bench(*args):
    return subprocess.run([sys.executable, "benchmarks/gpu.py", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_gpu_benchmark_arguments_are_checked_before_anything_runs():
    for args, says in ((["--nproc", "0"], "--nproc must be at least 1, got 0"),
                       (["--grad-accum", "0"], "--grad-accum must be at least 1, got 0"),
                       (["--steps", "5"], "--steps must be at least 11, got 5"),
                       (["--vocab-size", "100"], "--vocab-size must be 0 (bytes) or at least 259, got 100"),
                       (["--stages", "2,1"], "--stages '2,1': '1' is not one of 2, 3"),
                       (["--attention", "flash"], "--attention 'flash': 'flash' is not one of sdpa, flex, varlen")):
        proc = gpu_bench(*args)
        assert proc.returncode == 2 and proc.stderr.strip() == f"benchmarks/gpu.py: {says}", (args, proc.stderr)
    fine = gpu_bench("--vocab-size", "128256", "--nproc", "2", "--grad-accum", "4", "--model", "debug")
    assert fine.returncode == 0 and fine.stdout.startswith("benchmarks/gpu.py: no CUDA device"), fine.stderr


def test_gpu_benchmarks_sized_tokenizer_gives_the_model_that_vocabulary(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu import sized_tokenizer

    from zerotrain.dataio.tokenizer import load_tokenizer

    tok = load_tokenizer(str(sized_tokenizer(128256, tmp_path / "tok")))
    assert tok.vocab_size == 128256 and tok.eos_id is not None
    text = "packed rows, héllo ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < 258 + 2  # bytes and specials only: the rest is the head's size
