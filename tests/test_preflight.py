"""Pre-flight (`zerotrain preflight`, launcher/commands/preflight/) and the golden-step check of a real run.

A fault is planted for each stage and that stage catches it: a corrupted shard byte (v1 data), a
checkpoint whose read-back differs (v1, ZEROTRAIN_TEST_PREFLIGHT_READBACK), a data loader slowed on
purpose (v2, ZEROTRAIN_TEST_SLOW_LOADER), a step-time regression against a golden file (--golden-strict). One healthy
2-rank launch under the real `deepspeed` launcher runs all three stages and must pass them all
without touching the real run's files; the faults use 1-rank `python` launches. The golden
comparison's arithmetic is unit-tested without a process group.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BIN, REPO, free_port, write_mix
from zerotrain.launcher.commands import preflight
from zerotrain.launcher.commands.preflight import parse_args
from zerotrain.launcher.components import hooks
from zerotrain.launcher.components.ds_compat import allreduce_buffer_files
from zerotrain.launcher.components.observe import golden
from zerotrain.launcher.config_resolve import config_from
from zerotrain.launcher.ends import EXIT_GOLDEN, EXIT_PREFLIGHT_FAILED
from zerotrain.launcher.errors import UsageError
from zerotrain.launcher.components.observe.golden import GoldenCheck, golden_steps, make_golden
from zerotrain.launcher.settings import DEFAULT_MFU_THRESHOLD, resolve
from zerotrain.modeling.sizes import ModelArgs, flops_per_token

PREFLIGHT = "zerotrain.launcher.commands.preflight"  # run as a module, like the driver


def launch_preflight(launcher: str, args: list[str], env_extra=None, timeout: int = 300, port: int | None = None):
    cmd = ([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port or free_port()), "--module", PREFLIGHT,
            *args]
           if launcher == "deepspeed" else [sys.executable, "-m", PREFLIGHT, *args])
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Prepared shards of the two-source mix, a broken copy, and the cpu profile with a threshold this
    shared 2-core machine meets whatever else runs on it (the stage's judgement is unit-tested below)."""
    from zerotrain.dataio.pipeline.prepare import prepare
    from zerotrain.dataio.sources.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("preflight")
    shards = prepare(str(write_mix(root / "mix")), load_tokenizer("bytes"), root / "shards")
    profile = json.loads((REPO / "ds_configs" / "cpu.json").read_text())
    profile["zerotrain"]["mfu_threshold"] = 0.001
    (root / "cpu-low.json").write_text(json.dumps(profile))
    return {"root": root, "shards": Path(shards), "profile": str(root / "cpu-low.json")}


def flags(setup, out: Path, data=None) -> list[str]:
    return ["--profile", setup["profile"], "--data", str(data or setup["shards"]), "--seq-len", "128",
            "--micro-batch", "4", "--out", str(out), "--run-id", "r"]


def report(run_dir: Path, stage: str) -> dict:
    return json.loads((run_dir / "preflight" / f"{stage}.json").read_text())


def status(rep: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in rep["checks"]}


def tree_digest(root: Path, skip: str = "preflight") -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.relative_to(root).parts[0] != skip}


# -- one healthy 2-rank launch: v1, v2, v3 ---------------------------------------------------------

@pytest.fixture(scope="module")
def healthy(setup):
    out = setup["root"] / "runs"
    run_dir = out / "r"
    # what a real run of this config already wrote: pre-flight must leave it exactly as it is
    (run_dir / "checkpoints" / "global_step3").mkdir(parents=True)
    (run_dir / "checkpoints" / "global_step3" / "zerotrain.json").write_text('{"step": 3}\n')
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    before = tree_digest(run_dir)
    proc = launch_preflight("deepspeed", ["--stage", "v1,v2,v3", "--sweep", "2,4", "--sweep-steps", "3",
                                          "--loader-seconds", "0.5", "--steps", "8", *flags(setup, out)])
    return {"proc": proc, "run_dir": run_dir, "before": before, "out": out}


@pytest.mark.launches
def test_healthy_run_passes_every_stage_on_two_ranks(healthy, setup):
    proc, run_dir = healthy["proc"], healthy["run_dir"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    v1, v2, v3 = (report(run_dir, s) for s in ("v1", "v2", "v3"))
    assert status(v1) == dict.fromkeys(["backend", "collectives", "data", "build", "step", "checkpoint write",
                                        "checkpoint read-back", "evaluation", "resume"], "PASS")
    assert v1["world_size"] == 2 and "2 rank(s) on 1 host(s), gloo" in proc.stdout
    readback = next(c for c in v1["checks"] if c["name"] == "checkpoint read-back")
    assert readback["optimizer_tensors"] >= 3 and readback["tensors"] > readback["optimizer_tensors"]  # + exp_avg(_sq)
    assert status(v2) == dict.fromkeys(["plan", "micro-batch sweep", "data loader", "data wait"], "PASS")
    sweep = next(c for c in v2["checks"] if c["name"] == "micro-batch sweep")["candidates"]
    assert [c["micro_batch"] for c in sweep] == [2, 4] and sum(c["best"] for c in sweep) == 1
    assert all(c["tokens_per_s_per_rank"] > 0 and c["peak_gib"] > 0 and c["fits"] for c in sweep)
    assert status(v3) == {"rehearsal": "PASS", "utilisation": "PASS"}
    mfu = next(c for c in v3["checks"] if c["name"] == "utilisation")
    assert mfu["threshold"] == 0.001 and mfu["mfu"] > 0
    # the figure is the rehearsal's own: the median of its step records' MFU after the first step, each record's
    # MFU its tokens/s x our FLOPs per token over (peak x world), the peak the profile's (a wrong count, peak or
    # world size fails here, not only a missing figure)
    scratch = run_dir / "preflight" / "scratch" / "v3"
    records = [r for r in map(json.loads, (scratch / "metrics.jsonl").read_text().splitlines()) if "mfu" in r]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert mfu["mfu"] == pytest.approx(statistics.median(r["mfu"] for r in records[1:]))
    peak = json.loads(Path(setup["profile"]).read_text())["zerotrain"]["peak_flops_per_device"]
    assert mfu["peak_flops_per_device"] == peak
    saved = json.loads((scratch / "config.json").read_text())
    per_token = flops_per_token(ModelArgs(**saved["model"]), saved["run"]["seq_len"])
    for r in records:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * per_token / (peak * 2), rel=2e-3, abs=1e-5)
    for line in ("  PASS  checkpoint read-back", "  PASS  data loader", "  PASS  utilisation"):
        assert line in proc.stdout
    golden = json.loads((run_dir / "preflight" / "golden.json").read_text())
    assert [p["step"] for p in golden["steps"]] == [6, 7, 8] and golden["world_size"] == 2
    assert all(p["tokens_per_s"] > 0 and p["peak_rss_gib"] > 0 and "step_s_spread" in p for p in golden["steps"])


@pytest.mark.launches
def test_v1_checks_and_measures_the_sequence_parallel_all_to_all(setup):
    """--sequence-parallel 2 on 2 ranks (one launch): v1 checks N as the run does and times one layer's forward
    all-to-all (DeepSpeed's exchange over its sequence-parallel group, gloo here) next to the planner's figure
    for the profile's link (a copy of the cpu profile stating 1,000 GB/s, which loopback gloo is far below: the
    check says the plan's time is optimistic and what to set); build, step, checkpoint read-back, evaluation and
    resume then pass with every row shared by the 2 ranks."""
    profile = json.loads(Path(setup["profile"]).read_text())
    profile["zerotrain"]["hardware"]["interconnect_gb_s"] = 1000
    path = setup["root"] / "cpu-sp.json"
    path.write_text(json.dumps(profile))
    out = setup["root"] / "runs-sp"
    proc = launch_preflight("deepspeed", ["--stage", "v1", *flags({**setup, "profile": str(path)}, out),
                                          "--sequence-parallel", "2"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    v1 = report(out / "r", "v1")
    assert status(v1) == dict.fromkeys(["backend", "collectives", "sequence parallel", "data", "build", "step",
                                        "checkpoint write", "checkpoint read-back", "evaluation", "resume"], "PASS")
    sp = next(c for c in v1["checks"] if c["name"] == "sequence parallel")
    # the debug model (4 heads, 2 kv heads of 32), fp32, micro-batch 4 x 128: q, k, v, output of (4, 64, heads, 32)
    # on each rank, half of each sent
    sent = 4 * 64 * (4 + 2 + 2 + 4) * 32 * 4 // 2
    assert sp["all_to_all_bytes"] == sent and sp["all_to_all_s"] > 0
    assert sp["all_to_all_gb_s"] == pytest.approx(sent / sp["all_to_all_s"] / 1e9, rel=1e-2)
    assert sp["planned_gb_s"] == 1000 and sp["planned_s"] == pytest.approx(sent / 1000e9, rel=1e-3)
    assert sp["slower_than_planned"] == pytest.approx(1000 / sp["all_to_all_gb_s"], rel=1e-2)
    m = re.search(r"  PASS  sequence parallel .*N = 2 divides the world \(2\), --seq-len 128, heads 4 and kv heads"
                  r" 2; one layer's forward all-to-all .*: [\d.]+ ms, 0.197 MB sent per rank = ([\d.e-]+) GB/s;"
                  r" planner: 0.000197 ms at 1000 GB/s within a node \(zerotrain.hardware.interconnect_gb_s\);"
                  r" measured at [\d.e+]+x below the profile's link, so the plan's all-to-all time is optimistic:"
                  r" set zerotrain.hardware.interconnect_gb_s to ([\d.e-]+), or find the slow link", proc.stdout)
    assert m and m[1] == m[2], proc.stdout


@pytest.mark.launches
def test_real_run_files_untouched_and_scratch_checkpoints_removed(healthy):
    run_dir = healthy["run_dir"]
    assert tree_digest(run_dir) == healthy["before"]  # the real run's checkpoints and metrics, byte for byte
    scratch = run_dir / "preflight" / "scratch"
    assert (scratch / "v3" / "metrics.jsonl").is_file()
    assert not list(scratch.glob("*/checkpoints/global_step*"))


@pytest.mark.launches
def test_golden_file_of_another_config_or_world_is_refused(setup, healthy):
    golden = healthy["run_dir"] / "preflight" / "golden.json"
    base = {k.lstrip("-").replace("-", "_"): v for k, v in zip(*[iter(flags(setup, healthy["out"]))] * 2)}
    base.update(seq_len=128, micro_batch=4)
    cfg = config_from({**base, "golden": str(golden)})
    GoldenCheck.load(str(golden), cfg, world=2)  # the rehearsed config: accepted
    other = config_from({**base, "golden": str(golden), "lr": 0.001})
    with pytest.raises(UsageError, match=r"recorded for another config: lr 0\.003 -> 0\.001"):
        GoldenCheck.load(str(golden), other, world=2)  # what plan_run and `zerotrain launch` call first
    with pytest.raises(UsageError, match=r"world_size 2 -> 1"):
        GoldenCheck.load(str(golden), cfg, world=1)


# -- faults, one rank each ---------------------------------------------------------------------------

@pytest.mark.launches
def test_v1_catches_a_corrupted_shard_byte(setup):
    bad = setup["root"] / "shards-bad"
    bad.mkdir()
    for f in setup["shards"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    victim = next(bad.glob("prose-*.tokens.npy"))
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0x01  # one bit of one token: counts, dtype and offsets still agree, only the checksum catches it
    victim.write_bytes(bytes(raw))
    out = setup["root"] / "runs-bad"
    proc = launch_preflight("python", ["--stage", "v1", *flags(setup, out, data=bad)])
    assert proc.returncode == EXIT_PREFLIGHT_FAILED, proc.stderr[-2000:]
    assert "  FAIL  data" in proc.stdout and f"{victim.name}: sha256 mismatch" in proc.stdout
    assert "fix: fix or re-prepare the data" in proc.stdout
    rep = report(out / "r", "v1")
    assert status(rep)["data"] == "FAIL" and status(rep)["build"] == "SKIP" and not rep["ok"]
    assert not (out / "r" / "preflight" / "scratch").exists()  # nothing was built on bad data


@pytest.mark.launches
def test_v1_catches_a_differing_read_back_and_v2_a_slow_loader(setup):
    out = setup["root"] / "runs-hooks"
    proc = launch_preflight("python", ["--stage", "v1,v2", "--sweep", "4", "--sweep-steps", "3", "--loader-seconds",
                                       "1", *flags(setup, out)],
                            env_extra={hooks.PREFLIGHT_READBACK: "perturb", hooks.SLOW_LOADER: "1"})
    assert proc.returncode == EXIT_PREFLIGHT_FAILED, proc.stderr[-2000:]
    v1, v2 = report(out / "r", "v1"), report(out / "r", "v2")
    assert {k for k, v in status(v1).items() if v != "PASS"} == {"checkpoint read-back"}  # only the planted fault
    readback = next(c for c in v1["checks"] if c["name"] == "checkpoint read-back")
    assert re.search(r"fp32 master partition 0 differs \(sum [-\d.e]+ written, [-\d.e]+ read\)",
                     readback["detail"]), readback["detail"]
    assert status(v2) == {"plan": "PASS", "micro-batch sweep": "PASS", "data loader": "FAIL", "data wait": "FAIL"}
    # 1 s a batch vs a model step of ~0.2 s: the ratio (model step / 1 s) stays under 2 unless a step takes 2 s,
    # which not even a loaded host gives the debug model
    loader = next(c for c in v2["checks"] if c["name"] == "data loader")
    assert loader["ratio"] < preflight.DATA_RATIO_MIN
    assert next(c for c in v2["checks"] if c["name"] == "data wait")["data_wait_fraction"] > preflight.DATA_WAIT_MAX
    assert "fix: the loader cannot keep the model fed" in proc.stdout


@pytest.mark.launches
def test_an_out_of_memory_on_one_rank_ends_the_sweep_on_every_rank(setup):
    """Rank 1 alone runs out of memory in the sweep's micro-batch 4 (ZEROTRAIN_TEST_PREFLIGHT_OOM) while rank 0
    goes on into the step's collectives: the ranks' outcomes are exchanged through the rendezvous store, rank 1
    finds rank 0 missing and ends pre-flight with one verdict line, and the launch ends long before the 30-minute
    comm timeout (the subprocess's own limit, 300 s, would fail the test otherwise)."""
    out, port = setup["root"] / "oom", free_port()
    try:
        proc = launch_preflight("deepspeed", ["--stage", "v2", "--sweep", "2,4", "--sweep-steps", "2",
                                              "--loader-seconds", "0.5", *flags(setup, out)],
                                env_extra={"ZEROTRAIN_TEST_PREFLIGHT_OOM": "1:4"}, port=port)
    finally:  # the ranks that ended could not remove DeepSpeed's shared-memory buffers (named by the port)
        for leaked in allreduce_buffer_files(port):
            leaked.unlink(missing_ok=True)
    text = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_PREFLIGHT_FAILED, text[-3000:]
    assert ("zerotrain: preflight v2 micro-batch sweep: FAIL on rank 1: micro-batch 4 ran out of memory here while"
            " another rank was still inside the step's collectives; pre-flight ends now rather than at the comm"
            " timeout (1800 s): sweep micro-batches below 4 (--sweep)") in text, text[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.launches
def test_golden_strict_stops_a_run_slower_than_its_rehearsal(setup, healthy):
    """The rehearsal's golden file with its tokens/s made 10x faster: this run is then a step-time
    regression of about 90% at the first golden step, and --golden-strict stops it there, saved."""
    from conftest import launch, read_metrics

    golden = json.loads((healthy["run_dir"] / "preflight" / "golden.json").read_text())
    golden["world_size"] = 1
    for p in golden["steps"]:
        p["tokens_per_s"] *= 10
    path = setup["root"] / "golden-fast.json"
    path.write_text(json.dumps(golden))
    out = setup["root"] / "runs-golden"
    proc = launch("python", [*flags(setup, out), "--max-steps", "8", "--golden", str(path), "--golden-strict"])
    assert proc.returncode == EXIT_GOLDEN, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "golden step 6: tokens/s" in proc.stdout
    steps = read_metrics(out / "r")
    assert steps[-1]["step"] == 6
    assert (out / "r" / "checkpoints" / "global_step6" / "zerotrain.json").is_file()


# -- no process group ----------------------------------------------------------------------------------

def records(n: int, tokens_per_s: float = 1000.0, rss: float = 1.0) -> list[dict]:
    return [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": tokens_per_s, "step_s": 1.0, "data_wait_s": 0.01,
             "peak_rss_gib": rss, "mfu": 0.3} for s in range(1, n + 1)]


def golden_for(tmp_path, n=20, **kw) -> tuple[str, object]:
    cfg = config_from({"data": str(REPO / "dataio" / "mixes" / "demo.json")})
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(make_golden(records(n, **kw), cfg, 1, "cpu", "cpu", n)))
    return str(path), cfg


def run_against(check: GoldenCheck, recs: list[dict]) -> dict[int, str]:
    return {r["step"]: m for r in recs if (m := check.check(r["step"], r)) is not None}


def test_golden_check_warns_only_beyond_ten_percent(tmp_path):
    path, cfg = golden_for(tmp_path)
    check = GoldenCheck.load(path, cfg, world=1)
    assert check.steps == [6, 11, 15, 20]
    assert run_against(GoldenCheck.load(path, cfg), records(20, tokens_per_s=950.0, rss=1.08)) == {}  # within 10%
    slow = run_against(check, records(20, tokens_per_s=800.0))
    assert sorted(slow) == [6, 11, 15, 20] and "tokens/s 800 vs 1,000 in the rehearsal (-20%)" in slow[6]
    hungry = run_against(GoldenCheck.load(path, cfg), records(20, rss=1.25))
    assert "peak memory 1.25 GiB vs 1.00 GiB in the rehearsal (+25%)" in hungry[11] and "tokens/s" not in hungry[11]


def test_golden_check_uses_the_window_median_not_one_step(tmp_path):
    path, cfg = golden_for(tmp_path)
    recs = records(20)
    recs[9]["tokens_per_s"] = 100.0  # one slow step (a GC pause) inside the window of golden step 11
    assert run_against(GoldenCheck.load(path, cfg), recs) == {}
    for r in recs[6:11]:
        r["tokens_per_s"] = 700.0  # the whole window slower: a regression
    assert list(run_against(GoldenCheck.load(path, cfg), recs)) == [11]


def test_bad_golden_input_is_one_line(tmp_path):
    path, cfg = golden_for(tmp_path)
    with pytest.raises(UsageError, match="no such file"):
        GoldenCheck.load(str(tmp_path / "missing.json"), cfg)
    (tmp_path / "v1.json").write_text('{"stage": "v1"}')
    with pytest.raises(UsageError, match="not a zerotrain golden file"):
        GoldenCheck.load(str(tmp_path / "v1.json"), cfg)
    with pytest.raises(UsageError, match="--golden-strict: needs --golden"):
        config_from({"data": cfg.data.path, "golden_strict": True})


def test_stage_arguments_and_defaults():
    opts, rest = parse_args(["--stage", "v3,v1", "--data", "m.json", "--steps", "7", "--lr", "1e-3"])
    assert opts.stages == ["v1", "v3"] and opts.steps == 7 and rest == ["--data", "m.json", "--lr", "1e-3"]
    for bad in (["--stage", "v4"], ["--data", "m.json"], ["--stage", "v2", "--sweep", "4,x"]):
        with pytest.raises(UsageError):
            parse_args(bad)
    assert golden_steps(8) == ([6, 7, 8], 5) and golden_steps(2) == ([2], 1)
    assert preflight.rehearsal_steps(100) == 20 and preflight.rehearsal_steps(10**6) == 200
    def mfu_threshold(zt):
        return resolve(None, "p", {"zerotrain": zt}).mfu_threshold

    assert mfu_threshold({"mfu_threshold": 0.2}) == 0.2
    assert mfu_threshold({"expected_mfu": 0.4}) == pytest.approx(0.3)
    assert mfu_threshold({}) == DEFAULT_MFU_THRESHOLD


def test_zerotrain_preflight_bad_stage_is_exit_2(capsys):
    from zerotrain.launcher import cli
    with pytest.raises(SystemExit) as e:
        cli.main(["preflight", "--stage", "v9", "--data", "m.json"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "zerotrain: error: --stage v9: choose v1, v2 or v3 (or several, e.g. v1,v2)"]


def test_preflight_says_a_test_hook_first_as_the_run_does(tmp_path, mix_path, monkeypatch, capsys):
    """A stray ZEROTRAIN_TEST_* variable is said on pre-flight's own output before anything else, in the run's
    words: otherwise ZEROTRAIN_TEST_PREFLIGHT_READBACK would show only as an unexplained FAIL. In-process, ended
    by bad input right after the line (a sequence-parallel size the world cannot take); without one, no line."""
    from zerotrain.launcher import cli
    from zerotrain.launcher.components.hooks import PREFLIGHT_READBACK

    for var in [v for v in os.environ if v.startswith("ZEROTRAIN_TEST_")]:
        monkeypatch.delenv(var)
    for var, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        monkeypatch.setenv(var, value)  # a world of one, restored after the test
    argv = ["preflight", "--stage", "v1", "--data", str(mix_path), "--out", str(tmp_path / "runs"),
            "--sequence-parallel", "2"]
    said = []
    for hook in ("", "perturb"):
        if hook:
            monkeypatch.setenv(PREFLIGHT_READBACK, hook)
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        out, err = capsys.readouterr()
        assert err.startswith("zerotrain: error: --sequence-parallel 2") and len(err.strip().splitlines()) == 1
        said.append(out.splitlines())
    assert said == [[], [f"zerotrain: warning: test hooks active: {PREFLIGHT_READBACK}=perturb (faults and delays"
                         " planted by the test suite; unset them for a real run)"]]
    assert not (tmp_path / "runs").exists()


def test_nvme_throughput_is_measured_in_the_directory_and_leaves_nothing(tmp_path):
    """v2's NVMe check (at --nvme-path): the bytes written are fsync'd and read back, both rates positive, the
    probe file removed; a directory that cannot be written fails (the check's FAIL with the OS's message)."""
    from zerotrain.launcher.commands.preflight.measure import disk_throughput
    from zerotrain.launcher.offload import ops as offload
    from zerotrain.launcher.offload.keys import apply_offload

    m = disk_throughput(tmp_path, size=3 * 2**20 + 5, block=2**20)  # a last block shorter than the others
    assert m["bytes"] == 3 * 2**20 + 5
    assert m["write_bytes_per_s"] > 0 and m["read_bytes_per_s"] > 0
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError):
        disk_throughput(tmp_path / "missing", size=2**20)
    ds = {"zero_optimization": {"stage": 3}}
    assert offload.nvme_paths(apply_offload(ds, "all", str(tmp_path), "--offload")) == [str(tmp_path)]
    assert offload.nvme_paths(apply_offload(ds, "all", None, "--offload")) == []
    from types import SimpleNamespace

    from zerotrain.launcher.commands.preflight.throughput import Throughput

    ok, line, data = Throughput(SimpleNamespace(world=2)).c_nvme([str(tmp_path)])
    assert ok is True and re.fullmatch(rf"{tmp_path}: write \d+\.\d\d GB/s, read \d+\.\d\d GB/s \(256 MiB per rank, 2"
                                       r" rank\(s\) at once; fsync'd, read after dropping the page cache\)", line)
    assert data["nvme"][str(tmp_path)]["bytes"] == 256 * 2**20 and list(tmp_path.iterdir()) == []
