"""--eval-tasks: lm-evaluation-harness tasks scored in the loop (launcher/components/tasks/).

The sharding, padding and scoring are checked here without a process group; one 2-rank launch per layout
(ZeRO-3, killed -9 and resumed; sequence parallelism over 2 ranks, compiled) checks the rest at once: the
scores in metrics.jsonl and in RUN/eval_tasks/, --best-by choosing best.json and --keep-best, that a score
recorded before the kill survives it unchanged, and that the in-loop score of a step equals
lm-evaluation-harness's own (its HFLM) on that step's `zerotrain export`: accuracy identical, every
example's log-likelihood within 1e-4.
"""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import torch

from conftest import BIN, REPO, TRAIN_PY, cpu_profile, end_launched, free_port, launch, read_metrics, synthetic_docs
from zerotrain.launcher.components.tasks import batch_rows, request_row, score_rows, shard

lm_eval = pytest.importorskip("lm_eval")  # the `eval` extra (in the `test` extra too)

TASKS = "zerotrain_tiny_choice,zerotrain_tiny_text"
TASK_DIR = REPO / "recipes" / "eval_tasks"
LIMIT = 7  # 7 questions x 3 choices = 21 requests: odd, so one of 2 ranks pads


# -- no process group ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 21])
@pytest.mark.parametrize("world,micro", [(1, 1), (2, 1), (2, 4), (3, 2)])
def test_every_rank_runs_the_same_passes_and_every_request_once(n, world, micro):
    order = sorted(range(n), key=lambda i: (i * 7) % 5)
    shards = [shard(n, r, world, micro, order) for r in range(world)]
    assert len({s.passes for s in shards}) == 1  # ZeRO-3: nobody skips a parameter gather
    seen = sorted(i for s in shards for b in s.batches for i in b)
    assert seen == list(range(n))
    assert all(len(b) <= micro for s in shards for b in s.batches)
    if 0 < n < world:  # fewer requests than ranks: the others pad, none hangs
        assert shards[-1].batches == [] and shards[-1].padding == 1


def test_sequence_shards_add_up_to_the_whole_row():
    """Two sequence-parallel ranks each score their half of the positions: the sums are the whole row's."""
    torch.manual_seed(0)
    rows = [request_row([5, 6, 7, 8, 9], [3, 4], max_length=64)[0], request_row([1, 2], [3, 4, 5, 6], 64)[0]]
    conts = [2, 4]
    ids = batch_rows(rows, multiple=2, pad_id=0)
    assert ids.shape[1] % 2 == 0
    logits = torch.randn(2, ids.shape[1], 11)
    whole = score_rows(logits, rows, conts, slice(0, ids.shape[1]))
    half = ids.shape[1] // 2
    parts = score_rows(logits[:, :half], rows, conts, slice(0, half)) + \
        score_rows(logits[:, half:], rows, conts, slice(half, 2 * half))
    assert torch.allclose(whole, parts, rtol=0, atol=1e-12)  # float64 sums, added in another order
    lp = torch.log_softmax(logits, -1)  # by hand: row 0's continuation [3, 4] after inputs 5 6 7 8 9 3
    assert whole[0, 0] == pytest.approx(float(lp[0, 4, 3] + lp[0, 5, 4]))


def test_truncation_follows_lm_eval():
    row, n = request_row(list(range(10)), [10, 11], max_length=5)
    assert row == [6, 7, 8, 9, 10, 11] and n == 2  # (context + continuation)[-(max_length + 1):]


def test_a_task_that_cannot_load_or_generates_is_one_line(tmp_path):
    from zerotrain.launcher.components.tasks import check_best_by
    from zerotrain.launcher.components.tasks.lm import load_tasks
    from zerotrain.launcher.errors import UsageError

    bad = tmp_path / "bad.yaml"
    bad.write_text("task: zt_bad\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: missing.jsonl\n"
                   "test_split: test\noutput_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: ['a']\n"
                   "doc_to_target: 0\n")
    with pytest.raises(UsageError, match=r"--eval-tasks .*bad.yaml: cannot load the task") as e:
        load_tasks([str(bad)])
    assert "\n" not in str(e.value)
    gen = tmp_path / "gen.yaml"
    (tmp_path / "g.jsonl").write_text('{"q": "hi", "a": "there"}\n')
    gen.write_text("task: zt_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: g.jsonl\n"
                   "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n")
    with pytest.raises(UsageError, match="zt_gen: a generation task"):
        load_tasks([str(gen)])
    higher = {"zerotrain_tiny_choice": {"acc": True}}
    assert check_best_by("zerotrain_tiny_choice/acc", higher) is True
    with pytest.raises(UsageError, match="has no metric 'f1'"):
        check_best_by("zerotrain_tiny_choice/f1", higher)


# -- 2 ranks -------------------------------------------------------------------------------------------------

def _bpe(tmp_path) -> str:
    """A Hugging Face tokenizer (the byte tokenizer exports none, and lm-eval's HFLM needs one)."""
    from zerotrain.dataio.sources.tokenizer import train_bpe

    docs = synthetic_docs(300, seed=9) + [json.loads(line)["question"] for line in
                                         (TASK_DIR / "zerotrain_tiny_choice.jsonl").read_text().splitlines()]
    return str(train_bpe(docs, 400, tmp_path / "bpe"))


@pytest.mark.launches
@pytest.mark.parametrize("layout", ["zero3", "zero2_sp2"])
def test_in_loop_scores_equal_lm_eval_on_the_export(tmp_path, mix_path, layout, monkeypatch, launched):
    """zero3: the cpu profile (ZeRO-3, partitioned parameters) on 2 data-parallel ranks, 21 requests: one rank
    pads; with the parameters and the optimizer offloaded (--offload all: each forward gathers the parameters
    from host memory; DeepSpeed's CPU Adam). The run is killed -9 (its whole process group) once step 2 is
    scored and saved, and resumed: step 2's scores stay as recorded (its metrics.jsonl row and eval_tasks file
    untouched, not scored again), and step 4's, scored after the resume, equal lm-eval's on step 4's export.
    zero2_sp2: ZeRO-2 with the 2 ranks sharing every row (sequence parallelism; one data-parallel rank), with
    activation checkpointing, DeepSpeed's TiledMLP (--tiled-mlp) and --compile (inductor: the blocks scored
    compiled). Scoring is forward-only in eval mode: each engine must give lm-eval's numbers."""
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM

    from zerotrain.launcher.components.tasks.lm import load_tasks

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # HFLM below: the export and its tokenizer only
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # a task from a YAML file of one example: one request for 2 ranks (the other pads; nobody hangs)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "one.jsonl").write_text(json.dumps({"text": "One sentence, scored by one rank."}) + "\n")
    (tmp_path / "one" / "one.yaml").write_text(
        "task: zt_one_text\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: one.jsonl\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: byte_perplexity\n    aggregation: weighted_perplexity\n"
        "    higher_is_better: false\n")
    specs = f"{TASKS},{tmp_path / 'one' / 'one.yaml'}"
    names = {"zerotrain_tiny_choice", "zerotrain_tiny_text", "zt_one_text"}
    flags = ["--offload", "all"] if layout == "zero3" else [
        "--profile", cpu_profile(tmp_path, stage=2), "--sequence-parallel", "2", "--activation-checkpointing",
        "--tiled-mlp", "--compile"]
    out = tmp_path / "runs"
    args = ["--data", str(mix_path), "--tokenizer", _bpe(tmp_path), "--model", "debug", "--seq-len", "64",
            "--micro-batch", "2", "--lr", "3e-3", "--warmup-steps", "1", "--log-data-every-steps", "0",
            "--max-steps", "4", "--save-every-steps", "2", "--out", str(out), "--run-id", "r",
            "--eval-tasks", specs, "--eval-tasks-every", "2", "--eval-limit", str(LIMIT),
            "--best-by", "zerotrain_tiny_choice/acc_norm", "--keep-best", "2", *flags]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    run = out / "r"
    if layout == "zero3":
        text, before = killed_after_step_2(args, run, env, launched, tmp_path / "killed.log")
        resumed = launch("deepspeed", args, nproc=2, env_extra=env)
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        assert f"resumed from {run / 'checkpoints' / 'global_step2'} at step 2" in resumed.stdout
    else:
        proc = launch("deepspeed", args, nproc=2, env_extra=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        text = proc.stdout
    assert "eval tasks: zerotrain_tiny_choice, zerotrain_tiny_text, zt_one_text" in text
    assert "eval tasks cost: 2 scoring(s) (every 2 steps and at the end)" in text  # planning/evaluation.py
    if layout == "zero3":  # the engines named above, as the start-up says them
        assert ("offload (ZeRO-Offload): optimizer states and fp32 master weights -> host memory; parameters -> host"
                " memory") in text
    else:
        assert "activation-checkpointing True (flag)" in text and "tiled MLP: 1 tile(s)" in text
        assert "torch.compile: the first step took" in text
    rows = {m["step"]: m for m in read_metrics(run)}
    scored = {s: m["eval"] for s, m in rows.items() if "eval" in m}
    assert sorted(scored) == [2, 4]  # every 2 steps, and the last
    for s in scored:
        assert set(scored[s]) == names
        assert rows[s]["eval_tasks_s"] > 0
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    by = {s: scored[s]["zerotrain_tiny_choice"]["acc_norm"] for s in scored}
    assert [b["step"] for b in best["kept"]] == sorted(by, key=lambda s: (-by[s], s))
    assert best["metric"] == "zerotrain_tiny_choice/acc_norm" and best["score"] == by[best["step"]]

    if layout == "zero3":  # the kill -9 lost nothing scored before it, and scored nothing twice
        after = read_metrics(run)
        assert [m for m in after if m["step"] <= 2] == before["rows"]
        assert (run / "eval_tasks" / "step_00000002.json").read_bytes() == before["file"]
        lines = (run / "metrics.jsonl").read_text().splitlines()
        assert sum(1 for line in lines if line.startswith('{"step": 2,') and '"eval":' in line) == 1, lines
    # lm-evaluation-harness's own score of a step's export: zero3, the last step (scored after the resume);
    # zero2_sp2, the best (`export --best` follows --best-by)
    hf = tmp_path / "hf"
    step = 4 if layout == "zero3" else best["step"]
    which = [str(run / "checkpoints" / "global_step4")] if layout == "zero3" else [str(run), "--best"]
    exported = subprocess.run([str(BIN / "zerotrain"), "export", *which, "--to", str(hf)],
                              capture_output=True, text=True, cwd=REPO)
    assert exported.returncode == 0, exported.stderr
    assert f"exported {run / 'checkpoints' / f'global_step{step}'}" in exported.stdout
    runs = subprocess.run([str(BIN / "zerotrain"), "runs", str(out)], capture_output=True, text=True, cwd=REPO)
    assert "zerotrain_tiny_choice/acc_norm" in runs.stdout, runs.stdout + runs.stderr
    ours = json.loads((run / "eval_tasks" / f"step_{step:08d}.json").read_text())
    tasks = load_tasks(specs.split(","))
    theirs = evaluator.evaluate(HFLM(pretrained=str(hf), batch_size=4, device="cpu"), tasks.task_dict, limit=LIMIT,
                                bootstrap_iters=0, log_samples=True)
    same_as_lm_eval(ours, theirs, sorted(names))


def killed_after_step_2(args: list[str], run, env: dict, launched, log) -> tuple[str, dict]:
    """Launch, and kill -9 the whole job once step 2 is scored and its checkpoint complete (steps 3-4 and step 4's
    scoring still to come). Returns its output and what step 2 left: its metrics rows, its eval_tasks file."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port),
                                 str(TRAIN_PY), *args], stdout=out, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **env}, start_new_session=True)
    launched.append((proc, port))
    marker = run / "checkpoints" / "global_step2" / "zerotrain.json"
    t0 = time.time()
    while not marker.is_file() and proc.poll() is None and time.time() - t0 < 400:
        time.sleep(0.05)
    assert proc.poll() is None and marker.is_file(), log.read_text()[-3000:]
    end_launched([(proc, port)])  # SIGKILL to the process group: every rank and the launcher at once
    text = log.read_text()
    assert not (run / "checkpoints" / "global_step4").exists(), text[-3000:]  # killed before the end
    rows = [m for m in read_metrics(run) if m["step"] <= 2]
    assert "eval" in rows[-1]
    return text, {"rows": rows, "file": (run / "eval_tasks" / "step_00000002.json").read_bytes()}


def same_as_lm_eval(ours: dict, theirs: dict, names: list[str]) -> None:
    """Our scoring (RUN/eval_tasks/step_N.json's metrics and samples) equals lm-eval's results: accuracy identical,
    other metrics within 1e-4 relative, every example's log-likelihoods within 1e-4."""
    for task in names:
        for metric, value in ours["metrics"][task].items():
            if metric.startswith("acc"):
                assert theirs["results"][task][f"{metric},none"] == value, (task, metric)
            else:
                assert theirs["results"][task][f"{metric},none"] == pytest.approx(value, rel=1e-4), (task, metric)
        mine = {s["doc_id"]: s["loglikelihoods"] for s in ours["samples"][task]}
        assert len(mine) == {"zerotrain_tiny_choice": LIMIT, "zerotrain_tiny_text": 5, "zt_one_text": 1}[task]
        for s in theirs["samples"][task]:
            lls = [float(r[0]) if isinstance(r, (list, tuple)) else float(r) for r in s["filtered_resps"]]
            assert mine[s["doc_id"]] == pytest.approx(lls, abs=1e-4), (task, s["doc_id"])


# -- refused at start-up (and by --dry-run), before anything is written ------------------------------------

REFUSALS = {
    "unknown task": (["--eval-tasks", "no_such_task_anywhere"], "--eval-tasks no_such_task_anywhere: not a task"),
    "missing file": (["--eval-tasks", "tasks/nowhere.yaml"], "--eval-tasks tasks/nowhere.yaml: no such file"),
    "best-by metric": (["--eval-tasks", "zerotrain_tiny_choice", "--best-by", "zerotrain_tiny_choice/f1"],
                       "--best-by zerotrain_tiny_choice/f1: task zerotrain_tiny_choice has no metric 'f1'"),
    "best-by task": (["--eval-tasks", "zerotrain_tiny_choice", "--best-by", "zerotrain_tiny_text/acc"],
                     "--best-by zerotrain_tiny_text/acc: zerotrain_tiny_text is not one of --eval-tasks' tasks"),
    "limit alone": (["--eval-limit", "5"], "--eval-limit 5: needs --eval-tasks"),
    "cadence": (["--eval-tasks", "zerotrain_tiny_choice", "--eval-tasks-every", "often"],
                "--eval-tasks-every: must be N (steps) or COUNT-tokens"),
    "a hub dataset offline": (["--eval-tasks", "arc_easy"], "--eval-tasks arc_easy: cannot load the task"),
}


@pytest.mark.parametrize("case,dry", [(c, False) for c in REFUSALS] + [("unknown task", True),
                                                                      ("a hub dataset offline", True)])
def test_tasks_refused_in_one_line_before_anything_is_written(case, dry, tmp_path, mix_path, monkeypatch):
    import datasets
    import huggingface_hub

    from zerotrain.launcher.config_resolve import resolve_config
    from zerotrain.launcher.errors import UsageError
    from zerotrain.launcher.run_plan import plan_run

    # no network, an empty cache: what a cluster node without internet sees
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.chdir(tmp_path)
    extra, expected = REFUSALS[case]
    out = tmp_path / "runs"
    argv = ["--data", str(mix_path), "--out", str(out), *extra, *(["--dry-run"] if dry else [])]
    with pytest.raises(UsageError) as err:
        plan_run(resolve_config(argv), world=1)
    message = str(err.value)
    assert message.startswith(expected) and "\n" not in message, message
    if case == "a hub dataset offline":
        assert "fetch its data once" in message
    assert not out.exists()


def test_preflight_refuses_a_task_as_the_run_does_before_writing(tmp_path, mix_path, monkeypatch):
    from zerotrain.launcher.commands.preflight.harness import Preflight, parse_args
    from zerotrain.launcher.config_resolve import resolve_config
    from zerotrain.launcher.errors import UsageError

    for var, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        monkeypatch.setenv(var, value)  # a world of one, restored after the test (run() would set them for good)
    out = tmp_path / "runs"
    opts, rest = parse_args(["--stage", "v1", "--data", str(mix_path), "--out", str(out), "--eval-tasks",
                             "tasks/nowhere.yaml"])
    with pytest.raises(UsageError, match="^--eval-tasks tasks/nowhere.yaml: no such file or folder$"):
        Preflight(resolve_config(rest), opts).run()
    assert not out.exists()


def test_a_missing_extra_is_one_line(tmp_path, mix_path, monkeypatch):
    import importlib.util

    from zerotrain.launcher.config_resolve import resolve_config
    from zerotrain.launcher.errors import UsageError
    from zerotrain.launcher.run_plan import plan_run

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    with pytest.raises(UsageError, match=r"^--eval-tasks: lm-evaluation-harness is not installed \(pip install"
                                         r" 'zerotrain\[eval\]'"):
        plan_run(resolve_config(["--data", str(mix_path), "--out", str(tmp_path / "runs"), "--eval-tasks",
                                 "zerotrain_tiny_choice"]), world=1)
    assert not (tmp_path / "runs").exists()


# -- --best-by and the record, without a run -----------------------------------------------------------------

@pytest.mark.parametrize("higher", [True, False])
def test_best_by_ranks_by_the_score_and_best_json_reads_back(tmp_path, higher):
    from zerotrain import durable
    from zerotrain.launcher.components.checkpoints.checkpoint import (best_entry, best_json, rank_best, read_best,
                                                                     read_best_list, same_criterion)

    by = ("zerotrain_tiny_choice/acc", higher)
    kept = []
    for step, score in ((2, 0.3), (4, 0.7), (6, 0.5)):
        kept = rank_best(kept, best_entry(f"global_step{step}", step, score, by), keep_best=2)
    assert [b["step"] for b in kept] == ([4, 6] if higher else [2, 6])
    durable.write_json(tmp_path / "best.json", best_json(kept))
    assert read_best_list(tmp_path) == kept and read_best(tmp_path)["step"] == kept[0]["step"]
    assert all(same_criterion(b, by) for b in kept) and not any(same_criterion(b, None) for b in kept)


def test_scores_before_a_kill_survive_the_resume(tmp_path):
    """metrics.jsonl as a run killed -9 after scoring step 2 and saving it, then resumed from step 2, leaves it:
    the effective history keeps step 2's scores (the rows a resume keeps, as for the loss)."""
    from zerotrain.launcher.components.observe.metrics import read_metrics as effective
    from zerotrain.launcher.components.observe.metrics import scalars

    scores = {"zerotrain_tiny_choice": {"acc": 0.4, "acc_norm": 0.6}}
    lines = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "eval": scores, "eval_tasks_s": 0.5},
             {"step": 3, "loss": 3.9}]
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "lo'  # cut by the kill
    text += "\n" + json.dumps({"event": "resume", "step": 2}) + "\n" + json.dumps({"step": 3, "loss": 3.8}) + "\n"
    (tmp_path / "metrics.jsonl").write_text(text)
    history = effective(tmp_path)
    assert [r["step"] for r in history] == [1, 2, 3] and history[1]["eval"] == scores
    assert history[2]["loss"] == 3.8
    # what TensorBoard and W&B are given for the record (observe/metrics.py sinks)
    assert scalars(history[1])["eval/zerotrain_tiny_choice/acc_norm"] == 0.6


def test_a_recipe_and_a_profile_give_the_tasks_each_recorded_with_its_source(tmp_path, mix_path):
    from zerotrain.launcher.config_resolve import resolve_config
    from zerotrain.launcher.run_plan import plan_run

    profile = json.loads((REPO / "ds_configs" / "cpu.json").read_text())
    profile["zerotrain"]["eval_tasks_every"] = "1K-tokens"
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"data": str(mix_path), "eval_tasks": ["zerotrain_tiny_choice"], "eval_limit": 3,
                                  "seq_len": 64, "micro_batch": 2, "grad_accum": 1}))
    plan = plan_run(resolve_config(["--config", str(recipe), "--profile", str(tmp_path / "profile.json"),
                                    "--out", str(tmp_path / "runs")]), world=1)
    s = plan.settings
    assert plan.eval_tasks.names == ["zerotrain_tiny_choice"] and s.eval_limit == 3
    assert s.sources["eval_tasks"] == "recipe" and s.sources["eval_limit"] == "recipe"
    assert s.sources["eval_tasks_every"].endswith(": zerotrain.eval_tasks_every")
    assert plan.eval_tasks_every == 8  # 1,000 tokens at 128 tokens per step, rounded up
    assert not (tmp_path / "runs").exists()


# -- zerotrain report: the task curves, from metrics.jsonl alone ---------------------------------------------

def test_report_plots_each_task_over_the_steps_and_names_the_last_scores(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from zerotrain.launcher.commands.report import load_run, report_main
    from zerotrain.launcher.commands.report_plots import task_plots

    run = tmp_path / "r"
    run.mkdir()
    rows = [{"step": s, "tokens_seen": 128 * s, "loss": 5.0 - s / 10, "elapsed_s": float(s)} for s in range(1, 7)]
    scores = {2: (0.3, 0.4, 900.0, 9.8), 4: (0.5, 0.6, 400.0, 8.6), 6: (0.7, 0.6, 150.0, 7.2)}
    for r in rows:
        if r["step"] in scores:
            acc, acc_norm, wppl, bpb = scores[r["step"]]
            r["eval"] = {"zerotrain_tiny_choice": {"acc": acc, "acc_norm": acc_norm},
                         "zerotrain_tiny_text": {"word_perplexity": wppl, "bits_per_byte": bpb}}
            r["eval_tasks_s"] = 0.25
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "report").mkdir()
    (run / "report" / "eval_gone_task.png").write_bytes(b"old")  # a task of an earlier report: removed

    report_main([str(run)])
    report = run / "report"
    for name in ("eval_zerotrain_tiny_choice.png", "eval_zerotrain_tiny_text.png"):
        data = (report / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    assert not (report / "eval_gone_task.png").exists()
    text = (report / "report.md").read_text()
    assert ("| task scores (step 6) | zerotrain_tiny_choice acc 0.7, acc_norm 0.6; zerotrain_tiny_text"
            " bits_per_byte 7.2, word_perplexity 150 |") in text
    assert "| task scorings | 3, 0.8 s (12.5%) |" in text  # 3 x 0.25 s of 6 s
    assert "![eval_zerotrain_tiny_choice](eval_zerotrain_tiny_choice.png)" in text

    # what each panel draws: every metric, at the scored steps, with its values
    drawers = dict(task_plots([load_run(run)]))
    fig, ax = plt.subplots()
    assert drawers["eval_zerotrain_tiny_choice.png"](ax, [load_run(run)], ["r"])
    curves = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    assert curves == {"acc": ([2, 4, 6], [0.3, 0.5, 0.7]), "acc_norm": ([2, 4, 6], [0.4, 0.6, 0.6])}
    assert ax.get_yscale() == "linear"
    fig2, ax2 = plt.subplots()
    assert drawers["eval_zerotrain_tiny_text.png"](ax2, [load_run(run)], ["r"])
    assert ax2.get_yscale() == "log"  # perplexities in the hundreds beside bits in single digits
    plt.close(fig)
    plt.close(fig2)


# -- the cost of scoring: planning/evaluation.py -------------------------------------------------------------

@pytest.mark.parametrize("start,end,every,expected", [(0, 10, 4, 3), (0, 8, 4, 2), (0, 10, 0, 1), (4, 10, 4, 2),
                                                      (8, 8, 4, 0), (0, 3, 5, 1), (0, None, 4, None)])
def test_scorings_count_the_cadence_and_the_end_once(start, end, every, expected):
    from zerotrain.launcher.planning import scorings

    assert scorings(start, end, every) == expected
    if end is not None and end > start:  # as the participant decides: due at every multiple and at the last step
        due = [s for s in range(start + 1, end + 1) if s == end or (every and s % every == 0)]
        assert len(due) == expected


@pytest.mark.parametrize("world,micro,sp", [(1, 1, 1), (2, 1, 1), (2, 3, 1), (1, 2, 2), (3, 2, 1)])
def test_every_rank_runs_passes_of_the_same_widths_and_the_planner_counts_them(world, micro, sp):
    """Every data-parallel rank feeds the model the same sequence of widths (a tiled MLP's tile count follows
    the width, and at ZeRO-3 each tile gathers weights: other widths would hang), and the planner's positions
    per scoring equal what rank 0 runs, counted on a module that records its inputs."""
    from zerotrain.launcher.components.tasks import forward_positions
    from zerotrain.launcher.components.tasks.lm import LiveLM
    from zerotrain.modeling.sizes import mlp_tiles

    class Recorder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(1, 11)
            self.widths = []

        def forward(self, input_ids, position_ids):
            self.widths.append((input_ids.shape[0], input_ids.shape[1]))
            return torch.zeros(input_ids.shape[0], input_ids.shape[1] // sp, 11)

    class Tok:
        eos_id, bos_id = 0, None

    requests = [(None, [1] * c, [2] * k) for c, k in ((9, 1), (3, 4), (5, 2), (1, 1), (12, 3), (2, 2), (30, 1))]
    seen = []
    for rank in range(world):
        model = Recorder()
        lm = LiveLM(model, Tok(), max_length=16, micro_batch=micro, dp_rank=rank, dp_world=world,
                    sequence_parallel=sp)
        lm._loglikelihood_tokens(requests)
        seen.append(model.widths)
        if rank == 0:
            lengths = [len(row) for row in lm._rows(requests)[0]]
            assert max(lengths) == 17  # the 31-token request cut to the model's length + 1
            # a sequence-parallel rank runs its 1/sp of each row
            assert forward_positions(lengths, world, micro, sp) == sum(b * w // sp for b, w in model.widths)
    assert len({tuple(w for _, w in widths) for widths in seen}) == 1, seen
    assert len({tuple(mlp_tiles(w // sp, 4) for _, w in widths) for widths in seen}) == 1  # dim 4: tiles vary


def test_eval_cost_from_flops_and_the_dry_run_states_it(tmp_path, mix_path, capsys):
    from zerotrain.launcher.components.tasks.lm import row_lengths
    from zerotrain.launcher.config_resolve import resolve_config
    from zerotrain.launcher.planning import eval_cost
    from zerotrain.launcher.run_plan import describe, eval_tasks_cost, plan_run
    from zerotrain.modeling.sizes import flops_per_token

    cost = eval_cost(0, 10, 4, requests=21, positions=1000, forward_flops_per_position=3e6, peak_flops=1e9, mfu=0.5)
    assert (cost.scorings, cost.seconds, cost.total_seconds) == (3, 6.0, 18.0)  # 1000 x 3e6 / (0.5 x 1e9) = 6 s

    argv = ["--data", str(mix_path), "--out", str(tmp_path / "runs"), "--seq-len", "64", "--micro-batch", "2",
            "--max-steps", "10", "--eval-tasks", "zerotrain_tiny_choice,zerotrain_tiny_text", "--eval-limit", "3",
            "--eval-tasks-every", "4", "--dry-run"]
    plan = plan_run(resolve_config(argv), world=1)
    cost = eval_tasks_cost(plan)
    lengths = row_lengths(plan.eval_tasks, plan.tokenizer, plan.model_args.max_seq_len, 3)
    assert cost.scorings == 3 and cost.every == 4  # steps 4, 8 and the end, 10
    assert cost.requests == len(lengths) >= 3 * 3 + 3  # 3 questions x 3 choices, 3 texts (one or more windows)
    fpp = flops_per_token(plan.model_args, plan.model_args.max_seq_len) / 3
    assert cost.seconds == pytest.approx(cost.positions * fpp / (0.35 * 75e9))  # ds_configs/cpu.json's MFU and peak
    lines = describe(plan)
    line = next(x for x in lines if x.startswith("eval tasks cost:"))
    assert line.startswith(f"eval tasks cost: 3 scoring(s) (every 4 steps and at the end), {cost.requests}"
                           f" requests per scoring ({cost.positions:,} forward positions on the busiest rank):"
                           f" ~{cost.seconds:.3g} s per scoring at MFU 0.35"), line
    assert not (tmp_path / "runs").exists()


def test_zerotrain_plan_counts_the_scorings_without_loading_tasks(capsys):
    from zerotrain.launcher.commands.plan import plan_main

    plan = plan_main(["--model", "debug", "--vocab-size", "512", "--seq-len", "64", "--micro-batch", "2",
                      "--max-steps", "1000", "--eval-tasks", "no_such_task_is_loaded", "--eval-tasks-every", "300"])
    assert plan["eval_tasks"]["scorings"] == 4 and plan["eval_tasks"]["seconds_per_scoring"] is None  # 300..900, 1000
    out = capsys.readouterr().out
    assert ("eval tasks cost: 4 scoring(s) (every 300 steps and at the end); the time per scoring is measured at"
            " the first scoring") in out


# -- when the tasks are scored: the end of a run that ends normally (participants/eval_tasks.py) -------------

def test_tasks_are_scored_at_a_normal_end_and_not_at_a_signal_or_budget_stop():
    """Scored at the cadence and at the last step of a run that ends normally: --max-steps, the data ran out (the
    next step's batches, agreed at this step), an early stop (known at observe: its participant runs first).
    Not at a signal's or a budget's stop, which must not wait for a scoring."""
    from zerotrain.launcher.components import participants
    from zerotrain.launcher.components.observe.phases import PhaseClock
    from zerotrain.launcher.components.participants.base import Agreed, StepState
    from zerotrain.launcher.components.participants.early_stop import EarlyStop
    from zerotrain.launcher.components.participants.eval_tasks import EvalTasks

    class Counted(EvalTasks):
        def score(self):
            return {"zerotrain_tiny_choice": {"acc": 0.5}}, {}

    tasks = Counted(None, None, every=4, limit=None, clock=PhaseClock(), is_main=False, run_dir=None,
                    checkpointer=None, best_by=None)
    early = EarlyStop(patience=1)
    order = [p for cls in participants.ORDER for p in (early, tasks) if isinstance(p, cls)]
    assert order == [early, tasks]  # early stop decides before the tasks observe

    def observe(step_no, last=False, val=None, **agreed):
        step = StepState(step_no, "", 0.0, step_time=0.1, trained_at=0.0, last=last,
                         agreed=Agreed({"data_ended": [0, 0], **agreed}), val=val)
        for p in order:
            p.observe(step)
        return step

    assert observe(1).scores is None
    assert observe(4).scores["eval"] == {"zerotrain_tiny_choice": {"acc": 0.5}}  # the cadence
    assert "eval" in observe(5, data_ended=[0, 1]).scores  # one rank's data ran out: the run ends after step 5
    assert "eval" in observe(6, last=True).scores  # --max-steps
    # a signal or a budget: the run stops after this step, unscored (both ride on the same gather)
    assert observe(7, signal=True, over_budget=True).scores is None
    observe(8, val={"val_loss": 1.0})
    stopped = observe(9, val={"val_loss": 2.0})  # no better: patience 1 is used up
    assert stopped.ending == "early-stop" and "eval" in stopped.scores
    assert early.logged(stopped).kind == "early-stop"


def test_only_rank_0_prints_while_tasks_are_scored(capfd):
    """lm-eval's progress bars and log lines while scoring: on rank 0 only (LiveLM(quiet=True) on the others)."""
    from zerotrain.dataio.sources.tokenizer import ByteTokenizer
    from zerotrain.launcher.components.tasks.lm import LiveLM, load_tasks, score
    from zerotrain.modeling.model import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=320, max_seq_len=64))
    tasks = load_tasks(["zerotrain_tiny_choice"])
    capfd.readouterr()
    printed = {}
    for quiet in (False, True):
        lm = LiveLM(model, ByteTokenizer(), max_length=64, micro_batch=4, quiet=quiet)
        metrics = score(tasks, lm, 3)[0]
        out = capfd.readouterr()
        printed[quiet] = out.out + out.err
    assert printed[False]  # rank 0: lm-eval's bars ("building contexts"), as lm_eval prints them
    assert printed[True] == "", printed[True]
    assert set(metrics["zerotrain_tiny_choice"]) == {"acc", "acc_norm"}


def _bos_tokenizer(tmp_path):
    """A BPE whose post-processor prepends BOS (as Llama's and Gemma's do), built on disk."""
    from tokenizers import Tokenizer, processors

    from zerotrain.dataio.sources.tokenizer import HFTokenizer

    path = tmp_path / "bos"
    path.mkdir()
    tok = Tokenizer.from_file(str(_bpe(tmp_path) + "/tokenizer.json"))
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": "<|endoftext|>"}))
    return HFTokenizer(path)


def test_a_tokenizer_that_adds_bos_scores_as_lm_eval_does(tmp_path, monkeypatch):
    """In-process: our scoring of a model whose tokenizer prepends BOS equals lm-eval's HFLM on its export
    (accuracy identical, every example's log-likelihood within 1e-4); rolling windows of a 64-token model."""
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM

    from zerotrain.launcher.commands.export import copy_tokenizer
    from zerotrain.launcher.components.tasks.lm import LiveLM, load_tasks, score
    from zerotrain.modeling import hf
    from zerotrain.modeling.model import ModelArgs, Transformer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = _bos_tokenizer(tmp_path)
    assert tok.encode_as_transformers("Hello")[0] == tok.bos_id != tok.encode("Hello")[0]
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=448, max_seq_len=64)
    torch.manual_seed(0)
    model = Transformer(args).eval()
    out = tmp_path / "hf"
    hf.save(out, model.state_dict(), args, bos_id=tok.bos_id, eos_id=tok.eos_id)
    copy_tokenizer(tok, out, args.max_seq_len)
    tasks = load_tasks(TASKS.split(","))
    metrics, samples = score(tasks, LiveLM(model, tok, max_length=args.max_seq_len, micro_batch=4), LIMIT)
    theirs = HFLM(pretrained=str(out), batch_size=4, device="cpu")
    assert theirs.tok_encode("Hello")[0] == tok.bos_id  # lm-eval's tokenization adds the BOS too
    lm = LiveLM(model, tok, max_length=args.max_seq_len, micro_batch=4)
    for text in ("Hello there", "<|begin_of_text|>Hello there"):  # a string starting with BOS gets no second one
        assert lm.tok_encode(text) == theirs.tok_encode(text), text
    result = evaluator.evaluate(theirs, tasks.task_dict, limit=LIMIT, bootstrap_iters=0, log_samples=True)
    same_as_lm_eval({"metrics": metrics, "samples": samples}, result, ["zerotrain_tiny_choice", "zerotrain_tiny_text"])
